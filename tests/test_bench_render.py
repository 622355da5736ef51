"""`pagedllm bench render`: the Markdown of what the benches write with --out (files written
by a real bench run, or by the writer's own code), placed into a page section by section."""
from __future__ import annotations

import json

import pytest

from pagedllm.benchmarks import render, serve_bench, workloads


def rows_of(markdown: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split(" | ")]
            for line in markdown.splitlines() if line.startswith("| ")]


@pytest.fixture(scope="module")
def sharegpt_json(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "sharegpt.json"
    argv = ["sharegpt", "--device", "cpu", "--model", "smollm2-135m", "--num-prompts", "3",
            "--max-input-len", "24", "--max-tokens", "5", "--kv-cache-memory", "5e7",
            "--out", str(out)]
    assert workloads.main(argv) == 0
    return out


def test_a_sharegpt_run_renders_its_command_machine_date_and_figures(sharegpt_json, capsys):
    data = json.loads(sharegpt_json.read_text())
    capsys.readouterr()
    assert render.main([str(sharegpt_json)]) == 0
    text = capsys.readouterr().out
    assert "- command: `pagedllm bench sharegpt --device cpu --model smollm2-135m --num-prompts 3" \
        in text
    assert f"- date: {data['date']}" in text and data["date"].startswith("20")
    assert f"({data['host']['cores']} cores)" in text and "device cpu" in text
    limits = data["engine_limits"]  # what the engine chose, as the bench left it the limits
    assert (f"- engine: max_num_seqs {limits['max_num_seqs']:,}, max_num_batched_tokens "
            f"{limits['max_num_batched_tokens']:,}, kv_cache_tokens "
            f"{limits['kv_cache_tokens']:,}") in text
    (run,) = data["runs"]
    header, *body = rows_of(text)
    assert header == ["run", "requests", "input tok", "output tok", "time (s)", "output tok/s",
                      "total tok/s"]
    assert body == [["pagedllm", "3", str(run["input_tokens"]), "15", f"{run['elapsed_s']:.2f}",
                     f"{run['output_tokens_per_s']:.1f}", f"{run['total_tokens_per_s']:.1f}"]]
    assert "- output_len: mean 5.0" in text


def test_into_a_page_replaces_the_files_section_and_appends_a_new_one(sharegpt_json, tmp_path):
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n\nBy hand.\n")
    assert render.main([str(sharegpt_json), "--into", str(page)]) == 0
    once = page.read_text()
    assert once.startswith("# Benchmarks\n\nBy hand.\n\n<!-- rendered by")
    other = tmp_path / "other.json"
    other.write_text(sharegpt_json.read_text().replace('"sharegpt"', '"sharegpt-b"', 1))
    assert render.main([str(sharegpt_json), str(other), "--into", str(page)]) == 0
    twice = page.read_text()
    assert twice.count("from sharegpt.json -->") == 1 and twice.count("from other.json -->") == 1
    assert twice.startswith(once.rstrip("\n"))


def test_serve_request_rates_render_one_row_per_rate(tmp_path, capsys):
    argv = ["--url", "http://127.0.0.1:8000", "--request-rate", "8", "inf",
            "--num-prompts", "2", "--max-tokens", "3"]
    args, serve_args = serve_bench.build_parser().parse_known_args(argv)
    results = [serve_bench.RequestResult(ok=True, ttft=0.05 * i, itls=[0.01, 0.02],
                                         output_tokens=3) for i in (1, 2)]
    runs = [{"request_rate": rate, **serve_bench.summarize(results, 2.0)} for rate in (8.0, "inf")]
    out = tmp_path / "serve.json"
    out.write_text(json.dumps(serve_bench.out_report(args, argv, serve_args, runs)))
    assert render.main([str(out)]) == 0
    text = capsys.readouterr().out
    assert "- command: `pagedllm bench serve --url http://127.0.0.1:8000 --request-rate 8 inf" in text
    header, *body = rows_of(text)
    assert header[:5] == ["load", "requests", "failed", "req/s", "output tok/s"]
    assert body == [[f"rate {r}/s", "2", "0", "1.00", "3.0", "75.0", "99.5", "15.0", "20.0"]
                    for r in ("8.0", "inf")]
    assert "- 2 requests per run, 3 output tokens each, arrival seed 0" in text


def test_a_file_that_is_no_bench_output_is_refused_by_name(tmp_path, capsys):
    bad = tmp_path / "notes.json"
    bad.write_text('{"hello": 1}')
    assert render.main([str(bad)]) == 2
    assert capsys.readouterr().err == (
        "error: notes.json: not a `pagedllm bench ... --out` file (no workload and runs)\n")


def test_load_rows_render_with_their_spread_and_target(tmp_path, capsys):
    from pagedllm.benchmarks import load_bench

    def row(name: str, **medians: float) -> dict:
        r = {"name": name, **{k: {"median_s": v, "min_s": v - 0.1, "max_s": v + 0.1}
                              for k, v in medians.items()}}
        return {**r, **load_bench._target(r)}

    out = tmp_path / "load.json"
    out.write_text(json.dumps({"workload": "load", "date": "2026-12-03T12:00:00Z",
                               "command": "pagedllm bench load --repeats 3",
                               "rows": [row("LLM()", process=5.0, ready=1.9)],
                               "machine": {"cores": 2, "load_before": 1.0, "load_after": 1.5}}))
    assert render.main([str(out)]) == 0
    text = capsys.readouterr().out
    assert "### `load`: LLM(), `pagedllm --help`" in text
    assert rows_of(text)[1] == ["LLM()", "5.00 (4.90-5.10)", "-", "-", "-", "1.90 (1.80-2.00)",
                                "-", "ready <= 2.0: met"]
    assert "load average 1.0 before, 1.5 after" in text
