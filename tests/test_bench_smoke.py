"""`pagedllm bench` workloads: the list, option parsing, and tiny real runs (cpu, scheduler)."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pagedllm.benchmarks import cpu_targets, workloads
from pagedllm.benchmarks.scheduler_bench import percentile
from pagedllm.benchmarks.workloads import parse_args
from pagedllm.entrypoints.usage import EXIT_USAGE, UsageError

ROOT = Path(__file__).resolve().parent.parent


def run_script(name: str, *args: str, interpret: bool = True) -> subprocess.CompletedProcess:
    """scripts/<name> with these arguments, run by this Python from the repository root.
    interpret=False: without TRITON_INTERPRET (a script that compiles or intercepts Triton's
    own launches rather than the interpreter's)."""
    env = {k: v for k, v in os.environ.items() if interpret or k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)

GPU_WORKLOADS = ["nano", "decode-8b", "throughput-8b", "prefix-8b"]


def test_workload_list():
    assert list(workloads.WORKLOADS) == ["cpu", *GPU_WORKLOADS, "scheduler", "spec",
                                        "structured", "sharegpt"]
    assert set(workloads.RUNNERS) == set(workloads.WORKLOADS)
    assert [w for w in workloads.WORKLOADS.values() if w.needs_cuda] == [
        workloads.WORKLOADS[n] for n in [*GPU_WORKLOADS, "sharegpt"]
    ]


def test_defaults_follow_the_workload():
    nano = parse_args(["nano", "--device", "cpu"])
    assert (nano.num_requests, nano.input_len, nano.output_len) == (256, (100, 1024), (100, 1024))
    assert (nano.model, nano.load_format, nano.dtype, nano.peer) == (
        "qwen3-0.6b", "dummy", "bfloat16", True)
    assert nano.temperature == 0.6
    cpu = parse_args(["cpu"])
    assert (cpu.model, cpu.device, cpu.peer, cpu.output_len) == (None, "cpu", True, (64, 64))
    assert str(cpu.out) == "bench-results/cpu.json"
    prefix = parse_args(["prefix-8b", "--device", "cpu"])
    assert (prefix.prefix_len, prefix.input_len, prefix.peer) == (2000, (50, 50), False)


def test_overriding_one_end_of_a_range():
    assert parse_args(["nano", "--device", "cpu", "--max-tokens", "4"]).output_len == (4, 4)
    assert parse_args(["nano", "--device", "cpu", "--min-tokens", "2000"]).output_len == (2000, 2000)
    assert parse_args(["nano", "--device", "cpu", "--min-tokens", "200"]).output_len == (200, 1024)
    assert parse_args(["cpu", "--max-input-len", "8"]).input_len == (8, 8)
    assert parse_args(["cpu", "--no-peer"]).peer is False
    assert parse_args(["throughput-8b", "--device", "cpu", "--peer"]).peer is True


@pytest.mark.parametrize("argv, message", [
    (["nano", "--device", "cpu", "--min-tokens", "9", "--max-tokens", "5"],
     "--min-tokens (9) is above --max-tokens (5)"),
    (["cpu", "--max-tokens", "0"], "--max-tokens must be at least 1, got 0"),
    (["cpu", "--num-requests", "0"], "--num-requests must be at least 1, got 0"),
    (["cpu", "--repeats", "0"], "--repeats must be at least 1"),
    (["prefix-8b", "--device", "cpu", "--prefix-len", "0"], "--prefix-len must be at least 1"),
    (["warp-speed"], "unknown benchmark workload 'warp-speed'"),
    (["cpu", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["cpu", "--peer", "--no-peer"], "not allowed with argument"),
    ([], "name a workload"),
])
def test_bad_options_raise_a_clear_error(argv, message, capsys):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_args(argv)
    assert workloads.main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("name", GPU_WORKLOADS)
def test_gpu_workloads_need_cuda_or_device_cpu(name, capsys):
    assert workloads.main([name, "--no-peer"]) == 2
    assert "CUDA, which is not available" in capsys.readouterr().err
    assert parse_args([name, "--device", "cpu"]).device == "cpu"


class CharTokenizer:
    """One token per character: enough to check the windows' lengths."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


def test_text_prompts_have_exact_seeded_lengths():
    tok = CharTokenizer()
    a = workloads.text_prompts(tok, random.Random(3), 20, (16, 5000))
    b = workloads.text_prompts(tok, random.Random(3), 20, (16, 5000))
    assert a == b
    assert all(16 <= len(p) <= 5000 for p in a)
    assert any(len(p) > len("\n\n".join(workloads.PASSAGES)) for p in a)  # wraps around
    text = "".join(chr(t) for t in a[0])
    assert text in "\n\n".join(workloads.PASSAGES) * 3


def test_percentile_interpolates():
    values = [float(v) for v in range(101)]
    random.Random(0).shuffle(values)
    assert percentile(values, 99) == 99.0
    assert percentile(values, 50) == 50.0
    assert percentile([1.0, 2.0], 50) == 1.5
    assert percentile([7.0], 99) == 7.0


def test_scheduler_workload_writes_json(tmp_path, capsys):
    out = tmp_path / "s.json"
    argv = ["scheduler", "--num-requests", "8", "--num-steps", "5",
            "--max-input-len", "20", "--out", str(out)]
    assert workloads.main(argv) == 0
    data = json.loads(out.read_text())
    (row,) = data["runs"]
    assert (row["num_seqs"], row["prompt_len"], row["num_steps"]) == (8, 20, 5)
    assert 0 < row["p50_us"] <= row["p99_us"] <= row["max_us"]
    assert row["schedule_mean_us"] <= row["mean_us"]
    assert "p99 (us)" in capsys.readouterr().out


def test_cpu_workload_runs_shrunk(tmp_path, capsys):
    # A dummy preset instead of the default GGUF: parsing the GGUF twice (weights and
    # tokenizer) would take most of this test's time budget.
    out = tmp_path / "cpu.json"
    argv = ["cpu", "--model", "smollm2-135m", "--load-format", "dummy", "--num-requests", "2",
            "--max-tokens", "4", "--max-input-len", "24", "--no-peer", "--repeats", "1",
            "--kv-cache-memory", "5e7", "--max-num-batched-tokens", "32", "--out", str(out)]
    assert workloads.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["workload"] == "cpu"
    assert data["settings"]["output_len"] == [4, 4]
    assert data["environment"]["device"] == "cpu"
    (run,) = data["runs"]
    assert run["name"] == "pagedllm"
    assert run["num_requests"] == 2
    assert run["output_tokens"] == 2 * 4
    assert 2 * 16 <= run["input_tokens"] <= 2 * 24
    assert run["elapsed_s"] > 0
    assert run["output_tokens_per_s"] == pytest.approx(8 / run["elapsed_s"])
    assert data["summary"]["prompts"].startswith("random token ids")  # no tokenizer
    assert "ratio" not in data["summary"]
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[0].split()[:2] == ["run", "requests"]
    assert printed[2].startswith("pagedllm")


def test_cpu_workload_runs_pairs_on_their_own_prompts_and_takes_the_median_ratio(tmp_path):
    out = tmp_path / "cpu.json"
    argv = ["cpu", "--model", "smollm2-135m", "--load-format", "dummy", "--num-requests", "2",
            "--max-tokens", "3", "--max-input-len", "20", "--repeats", "3",
            "--kv-cache-memory", "5e7", "--out", str(out)]
    assert workloads.main(argv) == 0
    data = json.loads(out.read_text())
    names = [r["name"] for r in data["runs"]]
    assert names == [f"{engine} #{i}" for i in (1, 2, 3)
                     for engine in ("pagedllm", "transformers generate")]
    assert all(r["output_tokens"] == 2 * 3 for r in data["runs"])
    pairs = [a["output_tokens_per_s"] / b["output_tokens_per_s"]
             for a, b in zip(data["runs"][0::2], data["runs"][1::2])]
    assert data["summary"]["ratio"] == pytest.approx(sorted(pairs)[1])
    assert data["summary"]["ratios_per_pair"] == ", ".join(f"{r:.3f}" for r in pairs)
    inputs = [r["input_tokens"] for r in data["runs"]]
    assert inputs[0::2] == inputs[1::2]  # a pair shares its prompts ...
    assert len(set(inputs[0::2])) > 1  # ... and each pair has its own


def test_cpu_target_rows_keep_every_repeat_and_the_median():
    """cpu_targets.measure: each engine and workload in turns; the row's rate is the median
    run's, and `rates` lists every repeat's in run order (prompt tok/s for prefill)."""
    seconds = iter([1.0, 4.0, 2.0, 0.5, 2.0, 1.0, 2.0, 4.0, 1.0])  # 3 repeats x 3 workloads
    calls = []

    def run(prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
        calls.append((len(prompts), len(prompts[0]), max_tokens))
        return len(prompts) * max_tokens, next(seconds)

    shapes = cpu_targets.Shapes(decode_tokens=8, prompt_len=4, streams=2, prefill_len=16)
    rows = cpu_targets.measure({"e": run}, lambda n, length, seed: [[1] * length] * n, shapes,
                               3, set())
    assert calls == [(1, 4, 8), (2, 4, 8), (1, 16, 1)] * 3
    rate = {r["workload"]: (r["rate"], r["rates"]) for r in rows}
    assert rate["1 stream"] == (8 / 1.0, [8.0, 16.0, 4.0])  # 1.0, 0.5, 2.0 s
    assert rate["2 streams"] == (16 / 4.0, [4.0, 8.0, 4.0])  # 4.0, 2.0, 4.0 s
    assert rate["prefill 16"] == (16 / 1.0, [8.0, 16.0, 16.0])  # 2.0, 1.0, 1.0 s


def test_spec_workload_runs_on_a_tiny_model(tmp_path, capsys):
    """`bench spec` with both proposers on a tiny random model (draft = target): plain and
    speculative runs give the same tokens; the table reports acceptance."""
    model = tmp_path / "tiny.json"
    model.write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 97, "hidden_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 64, "max_position_embeddings": 256}))
    out = tmp_path / "spec.json"
    argv = ["spec", "--model", str(model), "--load-format", "dummy", "--num-requests", "2",
            "--max-tokens", "16", "--max-input-len", "24", "--method", "both",
            "--kv-cache-memory", str(4 << 20), "--out", str(out)]
    assert workloads.main(argv) == 0
    data = json.loads(out.read_text())
    assert [r["name"] for r in data["runs"]] == ["plain", "ngram", "draft_model"]
    summary = data["summary"]
    assert summary["ngram_identical_outputs"] == summary["draft_model_identical_outputs"] == "2/2"
    assert summary["draft_model_acceptance_rate"] == 1.0
    assert "accepted" in capsys.readouterr().out


def test_structured_workload_runs_shrunk_with_a_saved_tokenizer(tmp_path, capsys):
    # What the GPU step does: a random-weight model, the default model's tokenizer saved
    # to a directory (README: structured output).
    from pagedllm.loader import default_model_path
    from pagedllm.loader.tokenizer import load_tokenizer

    load_tokenizer(str(default_model_path())).save_pretrained(tmp_path / "tok")
    out = tmp_path / "structured.json"
    argv = ["structured", "--model", "smollm2-135m", "--load-format", "dummy",
            "--tokenizer", str(tmp_path / "tok"), "--batch-sizes", "1,2",
            "--constrained-fraction", "0.5", "--max-tokens", "4", "--max-input-len", "16",
            "--repeats", "1",
            "--kv-cache-memory", "5e7", "--out", str(out)]
    assert workloads.main(argv) == 0
    data = json.loads(out.read_text())
    names = [r["name"] for r in data["runs"]]
    assert names == ["batch 1: unconstrained", "batch 1: 1/1 constrained",
                     "batch 2: unconstrained", "batch 2: 1/2 constrained"]
    assert all(r["output_tokens"] == 4 * r["batch"] for r in data["runs"])  # to max_tokens
    assert "batch 2: throughput ratio (constrained / unconstrained)" in data["summary"]
    (pair,) = data["summary"]["batch 2: ratio per repeat (its two runs)"]  # one repeat
    ratio = data["summary"]["batch 2: throughput ratio (constrained / unconstrained)"]
    assert pair == pytest.approx(ratio, abs=1e-3)
    assert data["summary"]["batch 2: engine thread's mask fill + matcher advance per constrained token (us)"] > 0
    assert data["summary"]["batch 2: constrained outputs valid"] == "1/1"
    assert "us/token" in capsys.readouterr().out


def test_sharegpt_help_lists_its_options(capsys):
    assert workloads.main(["sharegpt", "--help"]) == 0
    text = capsys.readouterr().out
    for flag in ("--num-prompts", "--seed", "--model", "--quantization", "--kv-cache-dtype",
                 "--max-num-seqs", "--max-num-batched-tokens", "--out", "--top-p", "--profile"):
        assert flag in text
    args = parse_args(["sharegpt", "--device", "cpu"])
    assert (args.num_requests, args.input_len, args.output_len) == (1000, (4, 2048), (4, 1024))
    assert (args.model, args.load_format, args.dtype) == ("llama-3-8b", "dummy", "bfloat16")
    assert (args.temperature, args.top_p, args.kv_cache_dtype) == (0.8, 0.95, "auto")
    assert parse_args(["sharegpt", "--device", "cpu", "--num-prompts", "7"]).num_requests == 7
    # the batch limits are the engine's (sized by the device) unless given
    kwargs = workloads.engine_kwargs(args)
    assert (kwargs["max_num_seqs"], kwargs["max_num_batched_tokens"]) == (None, None)
    given = parse_args(["sharegpt", "--device", "cpu", "--max-num-seqs", "64",
                        "--max-num-batched-tokens", "4096"])
    assert (given.max_num_seqs, given.max_num_batched_tokens) == (64, 4096)


def test_profile_is_for_cuda_runs():
    assert not parse_args(["nano", "--device", "cpu"]).profile
    for workload in ("nano", "sharegpt"):
        assert workloads.main([workload, "--device", "cpu", "--profile"]) == EXIT_USAGE
    if torch.cuda.is_available():
        assert parse_args(["nano", "--profile"]).profile


def test_profile_summary_is_empty_without_kernels_and_gives_the_busy_share(capsys):
    from pagedllm.benchmarks.kernel_profile import profile_summary

    assert profile_summary({}, 2.0) == {}
    seconds = {"decode attention": 0.5, "the rest": 1.0}
    assert profile_summary(seconds, 2.0) == {"kernel_seconds": seconds, "gpu_busy_share": 0.75}
    assert "| all kernels / wall time | 1.50 / 2.00 (75% busy) |" in capsys.readouterr().out


def test_kernel_profile_sorts_kernels_into_the_tables_kinds():
    from pagedllm.benchmarks.kernel_profile import KINDS, kind_of

    names = {
        "nvjet_sm90_tst_128x16_64x11_2x1_v_bz_TNT": 0, "_skinny_kernel": 0,
        "_paged_decode_kernel": 1, "_merge_splits_kernel": 1, "_paged_prefill_kernel": 2,
        "void at::native::(anonymous namespace)::radixSortKVInPlace<...>": 3,
        "_threshold_kernel": 3, "_check_kernel": 3, "_race_kernel": 3,
        "_rms_norm_kernel": 4, "_rotary_and_cache_kernel": 4,
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>": 5,
        "_expand_kernel": 6,
    }
    assert {name: kind_of(name) for name in names} == {
        name: KINDS[index][0] for name, index in names.items()}


def test_idle_gaps_merge_overlapping_kernels_and_bucket_by_length():
    from pagedllm.benchmarks.kernel_profile import gap_report, idle_gaps

    # Two streams overlap over 0-15 us; then 5 us, 500 us and 3 ms of nothing.
    spans = [(20.0, 30.0, "b"), (0.0, 10.0, "a"), (5.0, 15.0, "s2"), (530.0, 540.0, "c"),
             (3540.0, 3550.0, "d")]
    assert idle_gaps(spans) == [(15.0, 5.0, "b"), (30.0, 500.0, "c"), (540.0, 3000.0, "d")]
    assert idle_gaps([]) == []
    lines = gap_report(idle_gaps(spans), 0.0)
    assert lines[1:5] == ["  0-20 us               1    0.000", "  20-200 us             0    0.000",
                          "  200-2000 us           1    0.001", "  >= 2000 us            1    0.003"]
    assert lines[6].split() == ["0.001", "3.00", "d"]  # the longest first


def test_sharegpt_lengths_are_seeded_lognormal_with_the_mix_means():
    lengths = workloads.lognormal_lengths(random.Random(0), 1000, 290, 1.0, (4, 2048))
    assert lengths == workloads.lognormal_lengths(random.Random(0), 1000, 290, 1.0, (4, 2048))
    assert 250 < sum(lengths) / 1000 < 330
    assert min(lengths) >= 4 and max(lengths) == 2048  # the tail reaches the cap
    assert sorted(lengths)[500] < 250  # a long right tail: the median is under the mean
    out = workloads.lognormal_lengths(random.Random(1), 1000, 220, 0.9, (4, 1024))
    assert 190 < sum(out) / 1000 < 250


def test_sharegpt_workload_runs_shrunk(tmp_path, capsys):
    out = tmp_path / "sharegpt.json"
    argv = ["sharegpt", "--device", "cpu", "--model", "smollm2-135m", "--num-prompts", "3",
            "--max-input-len", "24", "--max-tokens", "5", "--kv-cache-memory", "5e7",
            "--out", str(out)]
    assert workloads.main(argv) == 0
    data = json.loads(out.read_text())
    (run,) = data["runs"]
    summary = data["summary"]
    assert run["num_requests"] == 3
    assert run["output_tokens"] == summary["output_len"]["total"]  # every output ran to length
    assert run["input_tokens"] == summary["input_len"]["total"]
    assert summary["input_len"]["max"] <= 24 and summary["output_len"]["max"] <= 5
    assert run["total_tokens_per_s"] == pytest.approx(
        (run["input_tokens"] + run["output_tokens"]) / run["elapsed_s"])
    # the limits the engine chose (the settings say null: left to the engine)
    assert data["settings"]["max_num_seqs"] is None
    limits = data["engine_limits"]
    assert limits["max_num_seqs"] >= 1 and limits["max_num_batched_tokens"] >= 24
    # 5e7 bytes of bf16 K and V (the bench's dtype): 30 layers x 3 KV heads x 64 dims
    assert 0 < limits["kv_cache_tokens"] <= 5e7 / (30 * 2 * 3 * 64 * 2)
    printed = capsys.readouterr().out
    assert "total tok/s" in printed and "input_len: mean" in printed


def test_serve_arrivals_are_seeded_poisson():
    from pagedllm.benchmarks.serve_bench import arrival_gaps

    gaps = arrival_gaps(4.0, 2000, seed=7)
    assert gaps == arrival_gaps(4.0, 2000, seed=7) != arrival_gaps(4.0, 2000, seed=8)
    assert gaps[0] == 0.0 and all(g > 0 for g in gaps[1:])
    assert 0.22 < sum(gaps) / 1999 < 0.28  # mean gap 1 / rate
    assert arrival_gaps(float("inf"), 3, seed=0) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("argv, message", [
    (["--request-rate", "0"], "must be positive (or inf), got 0"),
    (["--request-rate", "fast"], "not a number of requests/s: 'fast'"),
    (["--num-prompts", "0"], "--num-requests must be at least 1"),
])
def test_serve_bench_refuses_bad_rates(argv, message):
    from pagedllm.benchmarks import serve_bench

    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        serve_bench.main(["--url", "http://127.0.0.1:9", *argv])


@pytest.mark.slow
def test_serve_bench_at_request_rates_writes_json(tmp_path, capsys):
    """Two rates against the default model on the CPU: every request answered, the figures
    printed per rate and written to --out."""
    from pagedllm.benchmarks import serve_bench

    out = tmp_path / "serve.json"
    code = serve_bench.main(["--request-rate", "8", "inf", "--num-prompts", "3",
                             "--max-tokens", "4", "--out", str(out),
                             "--num-gpu-blocks-override", "64", "--swap-space", "0.01"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "request rate 8.0/s, requests 3 (0 failed)" in printed
    assert "request rate inf/s, requests 3 (0 failed)" in printed
    report = json.loads(out.read_text())
    assert (report["num_prompts"], report["max_tokens"], report["seed"]) == (3, 4, 0)
    assert [run["request_rate"] for run in report["runs"]] == [8.0, "inf"]
    for run in report["runs"]:
        assert (run["requests"], run["failed"], run["output_tokens"]) == (3, 0, 12)
        assert run["requests_per_s"] > 0 and run["output_tokens_per_s"] > 0
        assert 0 < run["ttft_p50_ms"] <= run["ttft_p99_ms"]
        assert 0 < run["itl_p50_ms"] <= run["itl_p99_ms"]


def test_host_profile_script_wraps_the_engine_it_runs(tmp_path):
    """scripts/profile_host.py (gpu-check's host-profile step) wraps engine methods by
    name: a tiny run on the CPU, so a renamed method fails here, not on a GPU machine."""
    from pagedllm.loader import default_model_path
    from pagedllm.loader.tokenizer import load_tokenizer

    load_tokenizer(str(default_model_path())).save_pretrained(tmp_path / "tok")
    run = run_script(
        "profile_host.py", "--model", "smollm2-135m", "--load-format", "dummy", "--tokenizer",
        str(tmp_path / "tok"), "--device", "cpu", "--batch", "4", "--min-input-len", "8",
        "--max-input-len", "24", "--max-tokens", "4", "--num-scheduler-steps", "2",
        "--async-scheduling", "--max-num-batched-tokens", "48", "--kv-cache-memory", "50000000")
    assert run.returncode == 0, run.stderr[-3000:]
    for row in ("unconstrained: 16 tokens", "2/4 constrained: ", "scheduler.schedule",
                "scheduler.update_from_output", "outputs.process", "runner.gather"):
        assert row in run.stdout, run.stdout


def test_host_stalls_time_each_call_and_restore_the_method(capsys):
    from pagedllm.benchmarks.kernel_profile import host_stall_report, timed_calls

    def my_kernel():
        pass

    class Jit:  # as triton's JITFunction: `fn` is the kernel's Python function
        fn = staticmethod(my_kernel)

        def compile(self, ms):
            time.sleep(ms / 1e3)
            return ms

    original = Jit.compile
    with timed_calls(Jit, "compile") as calls:
        assert Jit().compile(30) == 30
        Jit().compile(1)
    assert Jit.compile is original
    assert [name for _, name, _ in calls] == ["my_kernel"] * 2 and calls[0][0] <= calls[1][0]
    assert 25 < calls[0][2] < 1000 and calls[1][2] < calls[0][2]
    lines = host_stall_report(calls, {"num_alloc_retries": 1}, {"num_alloc_retries": 3})
    assert lines[0].startswith("Triton compiles or loads in the run: 2 (")
    assert lines[1].split()[-1] == "my_kernel" and float(lines[1].split()[1]) >= 25  # longest first
    assert lines[-1] == "CUDA caching allocator in the run: num_alloc_retries +2"
    assert host_stall_report([], {}, {}) == ["Triton compiles or loads in the run: 0 (0.000 s)"]


def test_jit_compiles_hooks_this_tritons_compile():
    triton = pytest.importorskip("triton")
    from triton.runtime.jit import JITFunction

    from pagedllm.benchmarks.kernel_profile import jit_compiles

    assert hasattr(JITFunction, "_do_compile"), triton.__version__  # else nothing is counted
    original = JITFunction._do_compile
    with jit_compiles() as calls:
        assert JITFunction._do_compile is not original
    assert JITFunction._do_compile is original and calls == []


def test_jit_variants_script_reports_each_kernels_variants():
    """scripts/jit_variants.py: an engine run whose Triton launches record the JIT's variant
    instead of running (CPU tensors, no compile): the kernels of a decode step, and what
    selects a decode variant (its split count) among the parameters that vary."""
    pytest.importorskip("triton")
    run = run_script("jit_variants.py", "--num-requests", "6", "--max-num-seqs", "4",
                     "--max-num-batched-tokens", "512", interpret=False)
    assert run.returncode == 0, run.stderr[-3000:]
    kernels = {line.split(":")[0]: line for line in run.stdout.splitlines()
               if not line.startswith(" ")}
    assert {"_paged_decode_kernel", "_paged_prefill_kernel", "_rms_norm_kernel",
            "_rotary_and_cache_kernel", "_silu_and_mul_kernel"} <= set(kernels), run.stdout
    decode = run.stdout.split("_paged_decode_kernel:")[1].split("\n_")[0]
    assert "  NUM_SPLITS: 1, 2" in decode, run.stdout
    # the attention kernels do not specialize on what changes every step
    assert "stride_bt" not in run.stdout and "min_tiles" not in run.stdout, run.stdout
    assert kernels["_paged_prefill_kernel"].endswith(": 1 variants, 0 first launched in the run")
    assert kernels["_silu_and_mul_kernel"].endswith(": 1 variants, 0 first launched in the run")


def test_kernel_resources_counts_the_decode_key_loop():
    """scripts/kernel_resources.py --loop: the decode kernel compiled for sm_90 on the CPU,
    its registers and its key loop's instructions a pass; over an FP8 cache the loop holds
    the E4M3 -> fp16 conversions (F2FP), over bf16 it has none among its top opcodes."""
    import re

    pytest.importorskip("triton")
    run = run_script("kernel_resources.py", "--block-n", "128", "--warps", "4", "--loop",
                     interpret=False)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = {m.group(1): m for m in re.finditer(
        r"(bf16|fp8) cache, BLOCK_N 128, 4 warps: REG:\d+ STACK:(\d+) SHARED:\d+ "
        r"K/V buffers:1/1  loop: (\d+) "
        r"instructions a pass \((.*)\)", run.stdout)}
    assert set(lines) == {"bf16", "fp8"}, run.stdout
    for m in lines.values():
        assert m.group(2) == "0" and int(m.group(3)) > 100, run.stdout  # no spills; a real loop
        assert re.search(r"\bH\w*MMA\b", m.group(4)), run.stdout  # the two dots are in the loop
    assert "F2FP" in lines["fp8"].group(4) and "F2FP" not in lines["bf16"].group(4), run.stdout
