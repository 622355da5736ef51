"""`pagedllm bench load`: how long a new user waits before the first token.

Each measurement runs in a fresh Python process (nothing imported or cached in memory; the
file system's page cache stays warm after the first run), `--repeats` times, interleaved;
the table shows the median and the spread. Rows:

    pagedllm --help        the CLI answering, process start to exit
    LLM()                  `from pagedllm import LLM` and LLM(model), inside the process;
                           the load split into tokenizer, weights (the model built and
                           loaded), KV cache (sizing and allocation) and the rest, then the
                           first step (a one-token generate) after it
    pagedllm generate      a short answer end to end, process start to exit
    pagedllm serve         as `make serve`: process start to the first 200 from /health,
                           then stopped with Ctrl-C (SIGINT)
    transformers           AutoTokenizer + AutoModelForCausalLM.from_pretrained of the same
                           model (gguf_file= for a GGUF), fp32, inside the process

Beside each row its target (issue 34): LLM() ready (import + load) <= 2.0 s, generate and
serve /health <= 3.5 s. Load figures on a shared machine move with its load: the load average
is printed beside them, and each process's CPU seconds (all threads) beside its wall time.
"""
from __future__ import annotations

import json
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PROMPT = "hi"
# Seconds a newcomer should wait, by row name prefix, and the column they apply to.
TARGETS = {"LLM()": ("ready", 2.0), "pagedllm generate": ("process", 3.5),
           "pagedllm serve": ("process", 3.5)}

_PAGEDLLM = """
import json, sys, time
start = time.perf_counter()
from pagedllm import LLM, SamplingParams
from pagedllm.worker import worker
from pagedllm.engine import config_resolver
imported = time.perf_counter()
phases = {"tokenizer_s": 0.0, "weights_s": 0.0, "kv_cache_s": 0.0}

def timed(owner, name, phase):
    inner = getattr(owner, name)
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            phases[phase + "_s"] += time.perf_counter() - t
    setattr(owner, name, wrapper)

timed(config_resolver, "load_tokenizer", "tokenizer")
timed(worker.Worker, "_load_model", "weights")
timed(worker.Worker, "_profile_num_blocks", "kv_cache")
timed(worker, "CacheEngine", "kv_cache")
llm = LLM(json.loads(sys.argv[1]))
loaded = time.perf_counter()
llm.generate("hi", SamplingParams(max_tokens=1), use_tqdm=False)
print(json.dumps({"import_s": imported - start, "load_s": loaded - imported, **phases,
                  "first_step_s": time.perf_counter() - loaded}))
"""

_TRANSFORMERS = """
import json, os, sys, time
start = time.perf_counter()
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
imported = time.perf_counter()
path = sys.argv[1]
if path.endswith(".gguf"):
    folder, name = os.path.split(path)
    kwargs = {"gguf_file": name}
else:
    folder, kwargs = path, {}
AutoTokenizer.from_pretrained(folder, **kwargs)
AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs)
print(json.dumps({"import_s": imported - start, "load_s": time.perf_counter() - imported}))
"""


# A newcomer's Python caches each compiled module (__pycache__); with this variable set every
# process compiles pagedllm's own sources again, a cost a newcomer does not pay.
BYTECODE_NOTE = ("note: PYTHONDONTWRITEBYTECODE is set, so each process above compiled "
                 "pagedllm's sources again; unset it (and run twice) to measure the start a "
                 "newcomer's cached bytecode gives")

ROOT = str(Path(__file__).resolve().parents[2])  # the pagedllm being measured


def _env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=ROOT + (os.pathsep + path if path else ""))


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run(argv: list[str], timeout: float) -> tuple[float, dict]:
    """Wall seconds of one fresh process, and the JSON it printed last (if any) with its
    CPU seconds (all its threads) as cpu_s: less moved by a busy machine than the wall."""
    cpu = _children_cpu_s()
    start = time.perf_counter()
    # Run in ROOT: `python -m` and `-c` put the working directory first on sys.path, so
    # another checkout there would be measured instead.
    result = subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                            env=_env(), cwd=ROOT, timeout=timeout)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        tail = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"`{' '.join(argv[:4])} ...` failed: {tail}")
    lines = result.stdout.strip().splitlines()
    inner = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
    return wall, {"cpu_s": _children_cpu_s() - cpu, **inner}


def _process_cpu_s(pid: int) -> float:
    """CPU seconds a running process has used so far (Linux's /proc; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _serve_health(model_args: list[str], timeout: float) -> tuple[float, dict]:
    """Seconds from starting `pagedllm serve --port 0` to the first 200 from /health; the
    server is then stopped with SIGINT, as Ctrl-C after `make serve`."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve",
                             "--port", "0", *model_args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
    try:
        url = _announced_url(proc)
        while True:
            if time.perf_counter() - start > timeout:
                raise RuntimeError(f"`pagedllm serve` did not answer /health in {timeout:.0f} s")
            try:
                with urllib.request.urlopen(url + "/health", timeout=timeout) as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(0.01)
        wall = time.perf_counter() - start
        cpu = _process_cpu_s(proc.pid)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            _, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise RuntimeError("`pagedllm serve` did not stop on SIGINT") from None
    if proc.returncode not in (0, 130):
        tail = (stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"`pagedllm serve` exited with {proc.returncode}: {tail}")
    return wall, {"cpu_s": cpu}


def _announced_url(proc: subprocess.Popen) -> str:
    for line in proc.stdout:
        found = re.search(r" at (http://[^ ]+)", line)
        if found:
            return found.group(1)
    tail = (proc.stderr.read().strip().splitlines() or ["(no output)"])[-1]
    raise RuntimeError(f"`pagedllm serve` exited with {proc.wait()} before serving: {tail}")


def _summary(values: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(values), "min_s": min(values), "max_s": max(values)}


def measure(model: str | None, repeats: int, max_tokens: int, peer: bool) -> list[dict]:
    from pagedllm.loader import default_model_path

    model_args = [] if model is None else ["--model", model]
    peer_path = model or default_model_path()
    cases = {
        "pagedllm --help": lambda: _run(["-m", "pagedllm.entrypoints.cli", "--help"], 60),
        "LLM()": lambda: _run(["-c", _PAGEDLLM, json.dumps(model)], 600),
        f"pagedllm generate ({max_tokens} tokens)": lambda: _run(
            ["-m", "pagedllm.entrypoints.cli", "generate", PROMPT, "--max-tokens",
             str(max_tokens), *model_args], 600),
        "pagedllm serve (to /health 200)": lambda: _serve_health(model_args, 600),
    }
    if peer and (peer_path.endswith(".gguf") or Path(peer_path).is_dir()):
        cases["transformers from_pretrained"] = lambda: _run(
            ["-c", _TRANSFORMERS, peer_path], 600)
    walls: dict[str, list[float]] = {name: [] for name in cases}
    inner: dict[str, list[dict]] = {name: [] for name in cases}
    for _ in range(repeats):  # interleaved, so a busy minute touches every row alike
        for name, run in cases.items():
            wall, measured = run()
            walls[name].append(wall)
            inner[name].append(measured)
    rows = []
    for name in cases:
        row = {"name": name, "process": _summary(walls[name])}
        if inner[name][0]:
            for key in inner[name][0]:
                row[key.removesuffix("_s")] = _summary([m[key] for m in inner[name]])
            if "load_s" in inner[name][0]:  # LLM(): ready once imported and loaded
                row["ready"] = _summary([m["import_s"] + m["load_s"] for m in inner[name]])
        row.update(_target(row))
        rows.append(row)
    return rows


def _target(row: dict) -> dict:
    """The row's target and whether its median meets it (none for rows without one)."""
    for prefix, (key, seconds) in TARGETS.items():
        if row["name"].startswith(prefix) and key in row:
            return {"target": {"key": key, "seconds": seconds,
                               "met": row[key]["median_s"] <= seconds}}
    return {}


def format_table(rows: list[dict]) -> str:
    def cell(row: dict, key: str) -> str:
        s = row.get(key)
        return "-" if s is None else f"{s['median_s']:.2f} ({s['min_s']:.2f}-{s['max_s']:.2f})"

    def target(row: dict) -> str:
        t = row.get("target")
        return "-" if t is None else \
            f"{t['key']} <= {t['seconds']:.1f}: {'met' if t['met'] else 'MISSED'}"

    keys = ["process", "cpu", "import", "load", "ready", "tokenizer", "weights", "kv_cache",
            "first_step"]
    header = ["", "process wall s", "process CPU s", "import s", "load s", "ready s", "tokenizer s",
              "weights s", "KV cache s", "first step s", "target (median)"]
    cells = [[r["name"], *(cell(r, k) for k in keys), target(r)] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w)
                       for i, (h, w) in enumerate(zip(header, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) if i == 0 else v.rjust(w)
                        for i, (v, w) in enumerate(zip(c, widths))) for c in cells]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    from pagedllm.entrypoints.usage import EXIT_USAGE, Parser, UsageError

    parser = Parser(prog="pagedllm bench load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct GGUF")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per row")
    parser.add_argument("--max-tokens", type=int, default=8, help="for `pagedllm generate`")
    parser.add_argument("--no-peer", dest="peer", action="store_false",
                        help="skip transformers' load")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--out", default=None, metavar="FILE.json",
                        help="write the rows, date, command and host to this file as JSON")
    try:
        args = parser.parse_args(argv)
        for name in ("repeats", "max_tokens"):
            if getattr(args, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    before = os.getloadavg()[0]
    try:
        rows = measure(args.model, args.repeats, args.max_tokens, args.peer)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    load = {"cores": os.cpu_count(), "load_before": before, "load_after": os.getloadavg()[0],
            "bytecode_cached": not os.environ.get("PYTHONDONTWRITEBYTECODE")}
    if args.out:
        from pagedllm.benchmarks import machine

        report = {"workload": "load", **machine.stamp(argv, "load"), "rows": rows,
                  "machine": load}
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    if args.json:
        print(json.dumps({"rows": rows, "machine": load}, indent=2))
    else:
        print(format_table(rows))
        print(f"median (min-max) of {args.repeats} fresh processes each; {load['cores']} cores, "
              f"load average {load['load_before']:.1f} before, {load['load_after']:.1f} after")
        if not load["bytecode_cached"]:
            print(BYTECODE_NOTE)
    return 0
