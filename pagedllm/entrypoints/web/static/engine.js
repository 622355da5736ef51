// The engine view: polls /v1/engine/state a few times a second and draws the block pool,
// the queues, throughput and KV usage charts and the events (preemptions, prefix hits).
import { apiFetch, errorMessage, keyPanel } from "./api.js";

const POLL_MS = 250;
const HISTORY_S = 300;
const MAX_CELLS = 4096; // a bigger pool is drawn with several blocks per cell
const PRIORITY = "wcsuf"; // the state a cell of several blocks shows: the first present
const STATE_NAMES = { f: "free", u: "used", s: "shared", c: "cached", w: "swapped" };
const $ = (id) => document.getElementById(id);

const history = []; // {t, tps, kv}
let previous = null; // the last snapshot
let paused = false;
const key = keyPanel(() => { paused = false; poll(); });

async function poll() {
  if (paused) return;
  try {
    const response = await apiFetch("/v1/engine/state");
    if (!response.ok) {
      const message = await errorMessage(response);
      $("status").textContent = message;
      if (response.status === 401) {
        paused = true;
        key.ask(message);
        return;
      }
    } else {
      key.hide();
      show(await response.json());
      $("status").textContent = "live";
    }
  } catch (error) {
    $("status").textContent = "server unreachable";
  }
  setTimeout(poll, POLL_MS);
}

function show(state) {
  const seqsOf = blockOwners(state);
  drawGrid($("grid"), state.gpu_blocks, seqsOf.gpu, "GPU");
  drawGrid($("cpu-grid"), state.cpu_blocks, seqsOf.cpu, "CPU");
  countStates(state);
  showNumbers(state);
  showQueues(state);
  record(state);
  showEvents(state);
  previous = state;
}

// block number -> names of the sequences holding it, per pool (swapped ones: the CPU's)
function blockOwners(state) {
  const owners = { gpu: new Map(), cpu: new Map() };
  for (const [queue, entries] of Object.entries(state.queues)) {
    const map = queue === "swapped" ? owners.cpu : owners.gpu;
    for (const seq of entries) {
      const name = `seq ${seq.seq_id} (request ${seq.request_id.slice(0, 12)}, ${queue})`;
      for (const block of seq.blocks) {
        if (!map.has(block)) map.set(block, []);
        map.get(block).push(name);
      }
    }
  }
  return owners;
}

function drawGrid(grid, codes, owners, pool) {
  const per = Math.max(1, Math.ceil(codes.length / MAX_CELLS));
  const cells = Math.ceil(codes.length / per);
  if (grid.childElementCount !== cells || grid.dataset.per !== String(per)) {
    grid.replaceChildren();
    for (let i = 0; i < cells; i++) grid.appendChild(document.createElement("i"));
    grid.dataset.per = per;
  }
  for (let i = 0; i < cells; i++) {
    const first = i * per;
    const part = codes.slice(first, first + per);
    const code = per === 1 ? part : [...PRIORITY].find((c) => part.includes(c));
    const cell = grid.children[i];
    const names = new Set(); // a cell of several blocks names each sequence once
    for (let b = first; b < first + part.length; b++) for (const n of owners.get(b) || []) names.add(n);
    const range = per === 1 ? `${pool} block ${first}` : `${pool} blocks ${first}–${first + part.length - 1}`;
    const label = `${range}: ${STATE_NAMES[code]}${names.size ? " · " + [...names].join(", ") : ""}`;
    if (cell.className !== "block b-" + code) cell.className = "block b-" + code;
    if (cell.title !== label) cell.title = label;
  }
}

function countStates(state) {
  const counts = { f: 0, u: 0, s: 0, c: 0, w: 0 };
  for (const c of state.gpu_blocks) counts[c]++;
  for (const c of state.cpu_blocks) if (c === "w") counts.w++;
  for (const [c, n] of Object.entries(counts)) $("count-" + c).textContent = n;
  $("pool-info").textContent =
    `${state.num_gpu_blocks} GPU blocks, ${state.num_cpu_blocks} CPU blocks, ${state.block_size} tokens each`;
}

function showNumbers(state) {
  const c = state.counters;
  const requests = (queue) => new Set(state.queues[queue].map((e) => e.request_id)).size;
  $("n-running").textContent = requests("running");
  $("n-waiting").textContent = requests("waiting");
  $("n-swapped").textContent = requests("swapped");
  $("kv-usage").textContent = (100 * state.kv_cache_usage).toFixed(1) + "%";
  $("n-preemptions").textContent = c.num_preemptions_recompute + c.num_preemptions_swap;
  $("n-hits").textContent = c.prefix_cache_hit_blocks;
}

function showQueues(state) {
  const rows = [];
  for (const [queue, entries] of Object.entries(state.queues)) {
    for (const seq of entries) {
      rows.push(row([queue, seq.request_id, seq.seq_id, seq.num_prompt_tokens,
        seq.num_cached_tokens, seq.num_output_tokens, seq.num_computed_tokens,
        seq.blocks.length || "–"], queue));
    }
  }
  if (rows.length === 0) rows.push(row(["idle", "", "", "", "", "", "", ""], "idle"));
  $("queue-rows").replaceChildren(...rows);
}

function row(values, queue) {
  const tr = document.createElement("tr");
  tr.className = "q-" + queue;
  for (const value of values) {
    const td = document.createElement("td");
    td.textContent = value;
    tr.appendChild(td);
  }
  return tr;
}

function record(state) {
  if (previous) {
    const dt = state.time - previous.time;
    const tokens = state.counters.generation_tokens - previous.counters.generation_tokens;
    const tps = dt > 0 ? Math.max(0, tokens) / dt : 0;
    history.push({ t: state.time, tps, kv: 100 * state.kv_cache_usage });
  }
  while (history.length && history[0].t < state.time - HISTORY_S) history.shift();
  // Throughput over the last second of samples: one poll's delta is a step or none.
  const recent = history.filter((h) => h.t > state.time - 1);
  const tps = recent.length ? recent.reduce((a, h) => a + h.tps, 0) / recent.length : 0;
  $("tps-now").textContent = `now ${tps.toFixed(1)}`;
  $("kv-now").textContent = `now ${(100 * state.kv_cache_usage).toFixed(1)}`;
  chart($("chart-tps"), history.map((h) => [h.t, h.tps]), state.time, null, "#1f6fd1");
  chart($("chart-kv"), history.map((h) => [h.t, h.kv]), state.time, 100, "#c2571a");
}

function chart(canvas, points, now, fixedMax, color) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || canvas.width;
  const height = canvas.clientHeight || canvas.height;
  if (canvas.width !== Math.round(width * ratio)) {
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  const max = fixedMax || Math.max(1, ...points.map((p) => p[1])) * 1.1;
  ctx.fillStyle = "#667";
  ctx.font = "11px sans-serif";
  ctx.fillText(max.toFixed(0), 2, 11);
  ctx.fillText("0", 2, height - 2);
  ctx.strokeStyle = color;
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  points.forEach(([t, v], i) => {
    const x = width - ((now - t) / HISTORY_S) * width;
    const y = height - (v / max) * (height - 14) - 1;
    if (i === 0) ctx.moveTo(x, y);
    else ctx.lineTo(x, y);
  });
  ctx.stroke();
}

function showEvents(state) {
  if (!previous) return;
  const a = previous.counters, b = state.counters;
  const recompute = b.num_preemptions_recompute - a.num_preemptions_recompute;
  const swap = b.num_preemptions_swap - a.num_preemptions_swap;
  const hits = b.prefix_cache_hit_blocks - a.prefix_cache_hit_blocks;
  const queried = b.prefix_cache_queried_blocks - a.prefix_cache_queried_blocks;
  if (recompute > 0) event(`preempted ${recompute} request(s) by recompute`, "preemption");
  if (swap > 0) event(`preempted ${swap} request(s) by swapping to the CPU`, "preemption");
  if (hits > 0) event(`prefix cache: ${hits} of ${queried} prompt blocks found`, "hit");
}

function event(text, kind) {
  const list = $("events");
  const item = document.createElement("li");
  item.className = "ev-" + kind;
  item.textContent = `${new Date().toLocaleTimeString()} ${text}`;
  list.prepend(item);
  while (list.childElementCount > 50) list.lastElementChild.remove();
}

for (const id of ["grid", "cpu-grid"]) {
  $(id).addEventListener("mouseover", hover);
  $(id).addEventListener("click", hover); // a phone has no hover: a tap names the block
}

function hover(e) {
  if (e.target.classList.contains("block")) $("hover").textContent = e.target.title;
}

poll();
