"""`pagedllm bench load`: its serve row starts and stops a real server; targets per row."""
from __future__ import annotations

import pytest

from pagedllm.benchmarks import load_bench


@pytest.mark.slow
def test_serve_row_waits_for_health_then_stops_the_server():
    wall, inner = load_bench._serve_health(["--num-gpu-blocks-override", "64"], timeout=300)
    assert wall > 0 and inner["cpu_s"] > 0  # it raises unless /health said 200 and SIGINT
    # stopped the server with exit 0 or 130


def test_serve_row_reports_a_server_that_cannot_start():
    with pytest.raises(RuntimeError, match=r"exited with 2 before serving: error: --port must"):
        load_bench._serve_health(["--port", "70000"], timeout=300)


def row(name: str, **medians: float) -> dict:
    return {"name": name, **{k: {"median_s": v, "min_s": v, "max_s": v}
                             for k, v in medians.items()}}


def test_targets_apply_to_each_rows_own_column():
    ready = row("LLM()", process=5.0, ready=1.9)
    assert load_bench._target(ready)["target"] == {"key": "ready", "seconds": 2.0, "met": True}
    serve = row("pagedllm serve (to /health 200)", process=3.6)
    assert load_bench._target(serve)["target"]["met"] is False
    assert load_bench._target(row("pagedllm --help", process=0.3)) == {}
    table = load_bench.format_table([{**serve, **load_bench._target(serve)}])
    assert "process <= 3.5: MISSED" in table and "3.60 (3.60-3.60)" in table
