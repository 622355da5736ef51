"""`pagedllm bench render FILE.json...`: the Markdown of benchmark results, one section per
`--out` file (its command, machine, date and a table of its figures), printed, or written
into a page with `--into docs/benchmarks.md` (a section rendered before from a file of the
same name is replaced in place; a new one is appended).

It reads what `pagedllm bench <workload> --out`, `pagedllm bench serve --out` (concurrent
clients or `--request-rate`) and `pagedllm bench load --out` write.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from pagedllm.benchmarks import WORKLOAD_HELP
from pagedllm.entrypoints.usage import EXIT_USAGE, Parser, UsageError

SERVE_COLUMNS = [("load", "load", "{}"), ("requests", "requests", "{}"),
                 ("failed", "failed", "{}"), ("requests_per_s", "req/s", "{:.2f}"),
                 ("output_tokens_per_s", "output tok/s", "{:.1f}"),
                 ("ttft_p50_ms", "TTFT p50 ms", "{:.1f}"), ("ttft_p99_ms", "TTFT p99 ms", "{:.1f}"),
                 ("itl_p50_ms", "ITL p50 ms", "{:.1f}"), ("itl_p99_ms", "ITL p99 ms", "{:.1f}")]
LOAD_KEYS = [("process", "process wall s"), ("cpu", "process CPU s"), ("import", "import s"),
             ("load", "load s"), ("ready", "ready s"), ("first_step", "first step s")]
BEGIN = "<!-- rendered by `pagedllm bench render` from {} -->"
END = "<!-- end of {} -->"


def table(headers: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table; the first column left-aligned, the figures right-aligned."""
    lines = ["| " + " | ".join(headers) + " |",
             "|" + "|".join(["---"] + ["---:"] * (len(headers) - 1)) + "|"]
    return lines + ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]


def cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):  # e.g. "inf" where a float format is asked
        return str(value)


def summary_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                         for k, v in value.items())
    return str(value)


def workload_table(data: dict) -> list[str]:
    columns = [(c["key"], c["header"], c["format"]) for c in data.get("columns", [])]
    if not columns:  # a file from before the columns were written: every key of the runs
        keys = dict.fromkeys(k for run in data["runs"] for k in run)
        columns = [(k, k, "{:.2f}" if isinstance(data["runs"][0].get(k), float) else "{}")
                   for k in keys]
    rows = []
    for run in data["runs"]:
        if "error" in run:
            rows.append([run["name"], f"failed: {run['error']}"] + [""] * (len(columns) - 2))
        else:
            rows.append([cell(run.get(k), f) for k, _, f in columns])
    lines = table([h for _, h, _ in columns], rows)
    return lines + [""] + [f"- {k}: {summary_value(v)}" for k, v in data.get("summary", {}).items()]


def serve_table(data: dict) -> list[str]:
    rows = []
    for run in data["runs"]:
        load = (f"{run['num_clients']} clients" if "num_clients" in run
                else f"rate {run['request_rate']}/s")
        rows.append([cell({**run, "load": load}.get(k), f) for k, _, f in SERVE_COLUMNS])
    settings = (f"- {data['num_prompts']} requests per run, {data['max_tokens']} output tokens "
                f"each, arrival seed {data['seed']}")
    return table([h for _, h, _ in SERVE_COLUMNS], rows) + ["", settings]


def load_table(data: dict) -> list[str]:
    def spread(s: dict | None) -> str:
        return "-" if s is None else f"{s['median_s']:.2f} ({s['min_s']:.2f}-{s['max_s']:.2f})"

    def target(r: dict) -> str:
        t = r.get("target")
        return "-" if t is None else \
            f"{t['key']} <= {t['seconds']:.1f}: {'met' if t['met'] else 'MISSED'}"

    rows = [[r["name"], *(spread(r.get(k)) for k, _ in LOAD_KEYS), target(r)]
            for r in data["rows"]]
    m = data.get("machine", {})
    return table(["", *(h for _, h in LOAD_KEYS), "target (median)"], rows) + [
        "", "- median (min-max) of fresh processes; load average "
        f"{m.get('load_before', 0):.1f} before, {m.get('load_after', 0):.1f} after"]


def describe_host(data: dict) -> str:
    host = data.get("host")
    if host is None:  # older files: what the workload's environment says
        env = data.get("environment", {})
        return ", ".join(f"{k} {v}" for k, v in env.items()) or "not recorded"
    parts = [f"{host['cpu']} ({host['cores']} cores)"]
    if host.get("gpus"):
        parts.append(", ".join(host["gpus"]))
    device = data.get("environment", {}).get("device")
    parts += ([f"device {device}"] if device else []) + [f"Python {host['python']}"] + ([f"torch {host['torch']}"] if "torch" in host else [])
    if "load_average" in host:
        parts.append(f"load average {host['load_average']}")
    return ", ".join(parts)


def section(data: dict, name: str) -> str:
    """One results file as a Markdown section: heading, command, machine, date, table."""
    workload = data.get("workload") or ("serve" if "serve_args" in data else
                                        "load" if "rows" in data else None)
    if workload is None or ("runs" not in data and "rows" not in data):
        raise UsageError(f"{name}: not a `pagedllm bench ... --out` file (no workload and runs)")
    body = {"serve": serve_table, "load": load_table}.get(workload, workload_table)(data)
    title = data.get("description") or WORKLOAD_HELP.get(workload, f"pagedllm bench {workload}")
    command = data.get("command") or f"pagedllm bench {workload}"
    if workload == "serve" and "command" not in data and data.get("serve_args"):
        command += " " + " ".join(data["serve_args"])
    lines = [BEGIN.format(name), f"### `{workload}`: {title}", "",
             f"- command: `{command}`", f"- machine: {describe_host(data)}",
             f"- date: {data.get('date', 'not recorded')}"]
    if "settings" in data and "command" not in data:
        lines.append("- settings: " + ", ".join(f"{k}={v}" for k, v in data["settings"].items()))
    if data.get("engine_limits"):
        lines.append("- engine: " + ", ".join(f"{k} {v:,}" for k, v in data["engine_limits"].items()))
    return "\n".join(lines + [""] + body + [END.format(name)]) + "\n"


def place(page: str, name: str, text: str) -> str:
    """The page with the section rendered from `name` replaced by text, or text appended."""
    block = re.compile(re.escape(BEGIN.format(name)) + r".*?" + re.escape(END.format(name)) + r"\n?",
                       re.S)
    if block.search(page):
        return block.sub(lambda _: text, page, count=1)
    return page.rstrip("\n") + "\n\n" + text


def render(paths: list[Path]) -> list[tuple[str, str]]:
    """(name, section) per file; the name is the file's name, the key of its section."""
    out = []
    for path in paths:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise UsageError(f"cannot read {path}: {exc}") from None
        out.append((path.name, section(data, path.name)))
    return out


def main(argv: list[str]) -> int:
    parser = Parser(prog="pagedllm bench render", description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, metavar="FILE.json",
                        help="what a bench wrote with --out")
    parser.add_argument("--into", type=Path, default=None, metavar="PAGE.md",
                        help="write the sections into this Markdown page instead of printing")
    try:
        args: argparse.Namespace = parser.parse_args(argv)
        sections = render(args.files)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    if args.into is None:
        print("\n".join(text for _, text in sections), end="")
        return 0
    page = args.into.read_text() if args.into.exists() else ""
    for name, text in sections:
        page = place(page, name, text)
    args.into.write_text(page)
    print(f"wrote {len(sections)} section(s) into {args.into}", file=sys.stderr)
    return 0
