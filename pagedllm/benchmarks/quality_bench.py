"""`pagedllm bench quality`: task accuracy of int8 activations against fp32 activations on
the same GGUF, through lm-eval's `local-completions` against the real server.

The task (data/facts.yaml, data/facts.jsonl) is 1099 four-choice questions on public-domain
general knowledge; lm-eval scores each choice by its log-likelihood after the question
(/v1/completions with echo and logprobs: the prompt's own logprobs) and tokenizes through
the server's /tokenize (tokenizer_backend=remote), so nothing but the server is consulted.
The server is started once per `--cpu-activations` mode with --max-num-batched-tokens 64:
a step's matmuls take the packed GGUF kernels (int8 activations where asked) only up to 64
rows, and a longer step would run both modes on the same fp32 BLAS path. Rows: acc and
acc_norm (lm-eval's; acc_norm divides by the choice's length in bytes) per mode; the summary
has int8 - fp32 in points, beside the target (within 1.0 point, issue 34), and how many
questions both modes answer alike.

lm-eval is an optional extra: pip install 'pagedllm[eval]' (or pip install lm-eval).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pagedllm.benchmarks.server_process import ServerProcess

DATA = Path(__file__).parent / "data"
TASK_YAML = DATA / "facts.yaml"
TARGET_POINTS = 1.0
INSTALL = "lm-eval is not installed: pip install 'pagedllm[eval]' (or: pip install lm-eval)"
COLUMNS = [("name", "--cpu-activations", "{}"), ("items", "items", "{}"),
           ("acc", "acc", "{:.4f}"), ("acc_stderr", "acc stderr", "{:.4f}"),
           ("acc_norm", "acc_norm", "{:.4f}"), ("acc_norm_stderr", "acc_norm stderr", "{:.4f}"),
           ("eval_s", "eval s", "{:.1f}")]


def task_config(limit_path: Path | None = None) -> dict[str, Any]:
    """The task YAML as a config dict, its data file as an absolute path (the YAML's is
    relative to the repository root, for `lm_eval --include_path` run there)."""
    import yaml

    config = yaml.safe_load(TASK_YAML.read_text())
    config["dataset_kwargs"]["data_files"]["test"] = str(limit_path or DATA / "facts.jsonl")
    return config


def evaluate(url: str, model: str, task: dict, concurrent: int) -> tuple[dict, list[int]]:
    """lm-eval's local-completions on the task: its metrics, and the choice picked (highest
    log-likelihood) per question in document order."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    # Without lm-eval's own tasks: indexing their thousands of YAML files takes seconds.
    out = lm_eval.simple_evaluate(
        model="local-completions", tasks=[task], log_samples=True, verbosity="WARNING",
        task_manager=TaskManager(include_defaults=False),
        model_args={"base_url": url + "/v1/completions", "model": model,
                    "tokenizer_backend": "remote", "num_concurrent": concurrent})
    metrics = out["results"][task["task"]]
    samples = sorted(out["samples"][task["task"]], key=lambda s: s["doc_id"])
    picks = [max(range(len(s["filtered_resps"])), key=lambda i: s["filtered_resps"][i][0])
             for s in samples]
    return metrics, picks


def run_mode(mode: str, args: Any, task: dict) -> tuple[dict, list[int]]:
    serve_args = ["--cpu-activations", mode, "--max-num-batched-tokens", "64"]
    if args.model:
        serve_args += ["--model", args.model]
    server = ServerProcess(serve_args, timeout=600)
    try:
        model = server.served_model()
        start = time.perf_counter()
        metrics, picks = evaluate(server.url, model, task, args.num_concurrent)
        elapsed = time.perf_counter() - start
    finally:
        server.stop()
    row = {"name": mode, "model": model, "items": len(picks), "eval_s": elapsed}
    for key in ("acc", "acc_norm"):
        row[key] = metrics[f"{key},none"]
        row[f"{key}_stderr"] = metrics[f"{key}_stderr,none"]
    return row, picks


def summarize(runs: list[dict], picks: list[list[int]]) -> dict[str, Any]:
    """int8 - fp32 in points of accuracy, the target, and the questions answered alike."""
    base, other = runs
    acc = 100 * (other["acc"] - base["acc"])
    alike = sum(a == b for a, b in zip(*picks))
    return {f"acc {other['name']} - {base['name']} (points)": acc,
            f"acc_norm {other['name']} - {base['name']} (points)":
                100 * (other["acc_norm"] - base["acc_norm"]),
            "target": f"|acc difference| <= {TARGET_POINTS} point: "
                      f"{'met' if abs(acc) <= TARGET_POINTS else 'MISSED'}",
            "same answer": f"{alike}/{len(picks[0])} questions"}


def format_report(runs: list[dict], summary: dict) -> str:
    header = [h for _, h, _ in COLUMNS]
    cells = [[f.format(run[k]) for k, _, f in COLUMNS] for run in runs]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.rjust(w) for v, w in zip(c, widths)) for c in cells]
    lines += [f"{k}: {f'{v:+.2f}' if isinstance(v, float) else v}" for k, v in summary.items()]
    return "\n".join(lines)


def limited_data(limit: int, folder: str) -> Path:
    path = Path(folder) / "facts.jsonl"
    lines = (DATA / "facts.jsonl").read_text().splitlines()[:limit]
    path.write_text("\n".join(lines) + "\n")
    return path


def parse(argv: list[str]) -> Any:
    from pagedllm.entrypoints.usage import Parser, UsageError

    parser = Parser(prog="pagedllm bench quality", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file; default: SmolLM2-135M-"
                        "Instruct GGUF")
    parser.add_argument("--limit", type=int, default=None,
                        help="only the first N questions (default: all 1099)")
    parser.add_argument("--num-concurrent", type=int, default=4,
                        help="lm-eval's requests in flight at once")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--out", default=None, metavar="FILE.json",
                        help="write the rows, date, command and host to this file as JSON")
    args = parser.parse_args(argv)
    for name in ("limit", "num_concurrent"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv: list[str]) -> int:
    from pagedllm.entrypoints.usage import EXIT_USAGE, UsageError

    try:
        args = parse(argv)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        print(f"error: {INSTALL}", file=sys.stderr)
        return 1
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the data file is local
    before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as folder:
        task = task_config(limited_data(args.limit, folder) if args.limit else None)
        try:
            results = [run_mode(mode, args, task) for mode in ("fp32", "int8")]
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    runs, picks = [r for r, _ in results], [p for _, p in results]
    summary = summarize(runs, picks)
    load = {"cores": os.cpu_count(), "load_before": before, "load_after": os.getloadavg()[0]}
    if args.out:
        from pagedllm.benchmarks import machine

        report = {"workload": "quality", **machine.stamp(argv, "quality"),
                  "columns": [{"key": k, "header": h, "format": f} for k, h, f in COLUMNS],
                  "runs": runs, "summary": summary, "machine": load}
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    if args.json:
        print(json.dumps({"runs": runs, "summary": summary, "machine": load}, indent=2))
    else:
        print(format_report(runs, summary))
        print(f"{load['cores']} cores, load average {load['load_before']:.1f} before, "
              f"{load['load_after']:.1f} after")
    return 0
