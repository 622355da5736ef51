"""`pagedllm bench quality`: its multiple-choice data, the lm-eval task built from it, its
options and summary, and one shrunk run through lm-eval against two real servers."""
from __future__ import annotations

import json
import sys

import pytest

from pagedllm.benchmarks import quality_bench, server_process
from pagedllm.entrypoints.cli import run_bench

ITEMS = [json.loads(line) for line in (quality_bench.DATA / "facts.jsonl").read_text().splitlines()]


def test_the_data_has_200_well_formed_items_with_unique_questions():
    assert len(ITEMS) >= 200
    assert len({item["question"] for item in ITEMS}) == len(ITEMS)
    for item in ITEMS:
        assert set(item) == {"question", "choices", "answer", "category"}, item
        assert len(item["choices"]) == 4 and len(set(item["choices"])) == 4, item
        assert item["answer"] in range(4), item
        assert item["question"].endswith("?"), item
    # The right answer is not always in one place.
    assert all(sum(item["answer"] == i for item in ITEMS) > len(ITEMS) // 8 for i in range(4))


def test_lm_eval_builds_the_task_from_the_yaml_in_the_repository_root(monkeypatch):
    pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(server_process.ROOT)  # as `lm_eval --include_path ...` run there
    manager = TaskManager(include_path=str(quality_bench.DATA), include_defaults=False)
    task = manager.load(["pagedllm_facts"])["tasks"]["pagedllm_facts"]
    assert task.OUTPUT_TYPE == "multiple_choice"
    docs = list(task.test_docs())
    assert len(docs) == len(ITEMS)
    doc = docs[1]
    assert task.doc_to_text(doc) == f"Question: {ITEMS[1]['question']}\nAnswer:"
    assert task.doc_to_choice(doc) == ITEMS[1]["choices"]
    assert task.doc_to_target(doc) == ITEMS[1]["answer"]


def test_help_lists_the_options(capsys):
    assert run_bench("quality", ["--help"]) == 0
    out = capsys.readouterr().out
    assert all(flag in out for flag in ("--model", "--limit", "--num-concurrent", "--out"))


def test_a_bad_limit_is_one_error_line(capsys):
    assert run_bench("quality", ["--limit", "0"]) == 2
    assert capsys.readouterr().err == "error: --limit must be at least 1\n"


def test_without_lm_eval_it_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
    assert run_bench("quality", ["--limit", "4"]) == 1
    assert capsys.readouterr().err == ("error: lm-eval is not installed: pip install "
                                       "'pagedllm[eval]' (or: pip install lm-eval)\n")


def test_summary_gives_points_the_target_and_answers_alike():
    runs = [{"name": "fp32", "acc": 0.50, "acc_norm": 0.40},
            {"name": "int8", "acc": 0.52, "acc_norm": 0.40}]
    summary = quality_bench.summarize(runs, [[0, 1, 2, 3], [0, 1, 2, 0]])
    assert summary["acc int8 - fp32 (points)"] == pytest.approx(2.0)
    assert summary["acc_norm int8 - fp32 (points)"] == pytest.approx(0.0)
    assert summary["target"] == "|acc difference| <= 1.0 point: MISSED"
    assert summary["same answer"] == "3/4 questions"
    runs[1]["acc"] = 0.495
    assert quality_bench.summarize(runs, [[0], [0]])["target"].endswith(": met")


@pytest.mark.slow
def test_a_shrunk_run_scores_both_modes_through_real_servers(tmp_path, capsys):
    pytest.importorskip("lm_eval")
    out = tmp_path / "quality.json"
    assert run_bench("quality", ["--limit", "4", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [run["name"] for run in report["runs"]] == ["fp32", "int8"]
    for run in report["runs"]:
        assert run["items"] == 4 and 0.0 <= run["acc"] <= 1.0 and 0.0 <= run["acc_norm"] <= 1.0
    assert report["summary"]["same answer"].endswith("/4 questions")
    assert report["command"] == "pagedllm bench quality --limit 4 --out " + str(out)
    printed = capsys.readouterr().out
    assert "acc int8 - fp32 (points)" in printed and "same answer" in printed
    assert run_bench("render", [str(out)]) == 0  # the generic table: its columns and summary
    markdown = capsys.readouterr().out
    assert "| --cpu-activations | items | acc |" in markdown and "- same answer: " in markdown
