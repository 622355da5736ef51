// The chat page: conversations in localStorage, answers streamed from /v1/chat/completions.
import { apiFetch, errorMessage, keyPanel } from "./api.js";
import { renderMarkdown } from "./markdown.js";

const STORE = "pagedllm.conversations";
const CURRENT = "pagedllm.current";
const SETTINGS = "pagedllm.settings";
const $ = (id) => document.getElementById(id);

let conversations = load(STORE, {});
let currentId = localStorage.getItem(CURRENT);
let controller = null; // the AbortController of the answer streaming now
const key = keyPanel(loadModels);

function load(name, fallback) {
  try {
    return JSON.parse(localStorage.getItem(name)) || fallback;
  } catch (_) {
    return fallback;
  }
}

function save() {
  localStorage.setItem(STORE, JSON.stringify(conversations));
  if (currentId) localStorage.setItem(CURRENT, currentId);
}

function current() {
  if (!conversations[currentId]) newConversation();
  return conversations[currentId];
}

function newConversation() {
  const id = Date.now().toString(36) + Math.random().toString(36).slice(2, 6);
  conversations[id] = { title: "New conversation", messages: [], system: "", created: Date.now() };
  currentId = id;
  save();
}

// ---- sidebar -------------------------------------------------------------------------------

function renderSidebar() {
  const list = $("conversations");
  list.replaceChildren();
  const ids = Object.keys(conversations).sort((a, b) => conversations[b].created - conversations[a].created);
  for (const id of ids) {
    const item = document.createElement("li");
    item.className = id === currentId ? "active" : "";
    item.dataset.id = id;
    const title = document.createElement("button");
    title.type = "button";
    title.className = "title";
    title.textContent = conversations[id].title;
    title.addEventListener("click", () => select(id));
    const rename = button("✎", "Rename", () => startRename(item, id));
    const remove = button("×", "Delete", () => removeConversation(id));
    item.append(title, rename, remove);
    list.appendChild(item);
  }
}

function button(text, label, onClick) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = "icon";
  b.textContent = text;
  b.title = label;
  b.setAttribute("aria-label", label);
  b.addEventListener("click", onClick);
  return b;
}

function startRename(item, id) {
  const input = document.createElement("input");
  input.className = "rename";
  input.value = conversations[id].title;
  const finish = (keep) => {
    if (keep && input.value.trim()) conversations[id].title = input.value.trim();
    save();
    renderSidebar();
  };
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter") finish(true);
    if (e.key === "Escape") finish(false);
  });
  input.addEventListener("blur", () => finish(true));
  item.replaceChildren(input);
  input.focus();
  input.select();
}

function removeConversation(id) {
  delete conversations[id];
  if (id === currentId) currentId = Object.keys(conversations)[0] || null;
  if (!currentId) newConversation();
  save();
  renderAll();
}

function select(id) {
  if (controller) return; // finish or stop the answer first
  currentId = id;
  save();
  renderAll();
}

// ---- messages ------------------------------------------------------------------------------

function renderMessages() {
  const box = $("messages");
  box.replaceChildren();
  for (const message of current().messages) box.appendChild(messageNode(message));
  $("system").value = current().system || "";
  box.scrollTop = box.scrollHeight;
}

function messageNode(message) {
  const node = document.createElement("article");
  node.className = "message " + message.role;
  const body = document.createElement("div");
  body.className = "body";
  fillBody(body, message);
  const stats = document.createElement("div");
  stats.className = "stats";
  stats.textContent = message.stats || "";
  node.append(body, stats);
  return node;
}

function fillBody(body, message) {
  if (message.role === "assistant") body.replaceChildren(renderMarkdown(message.content));
  else body.textContent = message.content;
  if (message.error) {
    const error = document.createElement("p");
    error.className = "error";
    error.textContent = message.error;
    body.appendChild(error);
  }
}

function statsLine(usage, seconds, stopped, chunks) {
  if (!usage) return stopped ? `stopped after ${chunks} chunks` : "";
  const rate = seconds > 0 ? (usage.completion_tokens / seconds).toFixed(1) : "–";
  return `${usage.completion_tokens} tokens · ${usage.prompt_tokens} prompt tokens · ${rate} tok/s`;
}

// ---- sending -------------------------------------------------------------------------------

function requestBody(conversation) {
  const messages = [];
  if (conversation.system.trim()) messages.push({ role: "system", content: conversation.system });
  // An answer that failed or was stopped before its first token is not sent back.
  for (const m of conversation.messages) {
    if (m.content) messages.push({ role: m.role, content: m.content });
  }
  const body = {
    model: $("model").value || undefined,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: parseFloat($("temperature").value),
    top_p: parseFloat($("top_p").value),
    max_tokens: parseInt($("max_tokens").value, 10),
  };
  return { ...body, ...extraFields() };
}

function extraFields() {
  const text = $("extra").value.trim();
  $("extra-error").textContent = "";
  if (!text) return {};
  try {
    const value = JSON.parse(text);
    if (value && typeof value === "object" && !Array.isArray(value)) return value;
  } catch (_) { /* reported below */ }
  $("extra-error").textContent = "Extra request fields must be a JSON object; they were not sent.";
  return {};
}

async function send(text) {
  const conversation = current();
  if (conversation.messages.length === 0) conversation.title = text.slice(0, 40);
  conversation.system = $("system").value;
  conversation.messages.push({ role: "user", content: text });
  const answer = { role: "assistant", content: "" };
  const body = requestBody(conversation);
  conversation.messages.push(answer);
  save();
  renderAll();
  const node = $("messages").lastElementChild;
  await stream(body, answer, node);
  save();
}

async function stream(body, answer, node) {
  controller = new AbortController();
  setBusy(true);
  const started = performance.now();
  let first = null, usage = null, chunks = 0, stopped = false;
  try {
    const response = await apiFetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!response.ok) {
      answer.error = await errorMessage(response);
      if (response.status === 401) key.ask(answer.error);
    } else {
      for await (const event of events(response)) {
        if (event.error) answer.error = event.error.message;
        if (event.usage) usage = event.usage;
        const delta = event.choices && event.choices[0] && event.choices[0].delta;
        if (delta && delta.content) {
          first = first || performance.now();
          answer.content += delta.content;
          chunks++;
          node.dataset.chunks = chunks;
          fillBody(node.querySelector(".body"), answer);
          node.scrollIntoView({ block: "end" });
        }
      }
    }
  } catch (error) {
    if (error.name === "AbortError") stopped = true;
    else answer.error = "The request failed: " + error.message;
  } finally {
    controller = null;
    setBusy(false);
  }
  const seconds = (performance.now() - (first || started)) / 1000;
  answer.stats = statsLine(usage, seconds, stopped, chunks);
  if (stopped) answer.stopped = true;
  fillBody(node.querySelector(".body"), answer);
  node.querySelector(".stats").textContent = answer.stats;
  node.dataset.done = stopped ? "stopped" : "finished";
}

// Server-sent events of the response: each `data:` line's JSON, until [DONE].
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("prompt").disabled = busy;
}

// ---- models and settings -------------------------------------------------------------------

async function loadModels() {
  const response = await apiFetch("/v1/models");
  if (!response.ok) {
    const message = await errorMessage(response);
    if (response.status === 401) key.ask(message);
    return;
  }
  key.hide();
  const select = $("model");
  const chosen = select.value;
  select.replaceChildren();
  for (const model of (await response.json()).data) {
    const option = document.createElement("option");
    option.value = option.textContent = model.id;
    select.appendChild(option);
  }
  if (chosen) select.value = chosen;
}

function loadSettings() {
  const settings = load(SETTINGS, {});
  for (const id of ["temperature", "top_p", "max_tokens", "extra"]) {
    if (settings[id] !== undefined) $(id).value = settings[id];
    $(id).addEventListener("change", () => {
      settings[id] = $(id).value;
      localStorage.setItem(SETTINGS, JSON.stringify(settings));
    });
  }
  $("system").addEventListener("change", () => {
    current().system = $("system").value;
    save();
  });
}

function renderAll() {
  renderSidebar();
  renderMessages();
}

function wire() {
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => controller && controller.abort());
  $("new-chat").addEventListener("click", () => {
    if (controller) return;
    newConversation();
    renderAll();
    $("prompt").focus();
  });
  $("toggle-settings").addEventListener("click", () => { $("settings").hidden = !$("settings").hidden; });
  $("toggle-sidebar").addEventListener("click", () => document.body.classList.toggle("show-sidebar"));
}

wire();
loadSettings();
renderAll();
loadModels();
