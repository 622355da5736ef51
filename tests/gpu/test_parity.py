"""Greedy parity of the CUDA path against the CPU path, of CUDA graphs against eager, of async
against sync scheduling and of speculative against plain decoding (fp32).

A SmolLM2-135M-shaped Llama (30 layers, hidden 576, 9/3 heads of 64, intermediate 1536,
vocab 49152, rope theta 1e5, tied embeddings) with seeded random weights, 16 prompts, run
twice: 32 greedy tokens each, and 2..32 tokens (the batch shrinks, so graph replays pad to
buckets). bf16 graphs vs eager is reported, not required to match (a bucket's GEMMs may round
differently from the unpadded batch's), with the batch-1 decode latency of each; so is bf16
batch-1 decode with the norms folded into the GEMVs against the norm kernels.
"""
from __future__ import annotations

import random
import time

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.gpu.random_model import QWEN3_SHAPE, SMOLLM2_SHAPE, compare, free, save_random_model

pytestmark = pytest.mark.cuda

LENGTHS = {"16x32": [32] * 16, "16x2..32": [2 + 2 * i for i in range(16)]}
CPU = dict(device="cpu", dtype="float32", kv_cache_memory=256 << 20)
GPU = dict(device="cuda", gpu_memory_utilization=0.3, max_num_seqs=64)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
RUNS = {
    "cpu fp32": CPU,
    "cuda fp32 eager": dict(GPU, dtype="float32", enforce_eager=True),
    "cuda fp32 graphs": dict(GPU, dtype="float32"),
    "cuda fp32 graphs sync": dict(GPU, dtype="float32", async_scheduling=False),
    "cuda fp32 graphs ngram": dict(GPU, dtype="float32", speculative_config=NGRAM),
}
PAIRS = [("cuda fp32 eager", "cpu fp32"), ("cuda fp32 graphs", "cpu fp32"),
         ("cuda fp32 graphs", "cuda fp32 eager"), ("cuda fp32 graphs", "cuda fp32 graphs sync"),
         ("cuda fp32 graphs ngram", "cuda fp32 graphs")]


def generate(folder: str, prompts, max_tokens: list[int], **engine) -> dict:
    llm = LLM(model=folder, seed=0, **engine)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    graphs = llm.engine.worker.runner.graphs
    result = {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "cumulative_logprob": [o.outputs[0].cumulative_logprob for o in outs],
        "graph_replays": graphs.num_replays if graphs is not None else 0,
        "spec_verified_rows": llm.engine.get_stats().spec_num_verified_rows,
    }
    del llm, outs
    free()
    return result


def decode_latency(folder: str, **engine) -> float:
    """Milliseconds per token for one sequence (128 tokens), after a warm-up."""
    llm = LLM(model=folder, seed=0, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate([[9, 10, 11, 12]], params, use_tqdm=False)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    del llm
    free()
    return 1000 * elapsed / 128


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, SMOLLM2_SHAPE["vocab_size"]) for _ in range(rng.randint(4, 64))]
            for _ in range(16)]


@pytest.fixture(scope="module")
def run(model_dir, prompts):
    """run(lengths label, run name): each run once per module."""
    done: dict[tuple[str, str], dict] = {}

    def get(label: str, name: str) -> dict:
        if (label, name) not in done:
            done[label, name] = generate(model_dir, prompts, LENGTHS[label], **RUNS[name])
        return done[label, name]

    return get


@pytest.mark.parametrize("label", LENGTHS)
@pytest.mark.parametrize("a,b", PAIRS, ids=[f"{a} == {b}" for a, b in PAIRS])
def test_greedy_tokens_match(run, label, a, b):
    row = compare(run(label, a), run(label, b))
    assert row["ok"], f"{label} {a} vs {b}: {row}"


@pytest.mark.parametrize("label", LENGTHS)
def test_speculative_run_verified_rows(run, label):
    assert run(label, "cuda fp32 graphs ngram")["spec_verified_rows"] > 0


@pytest.mark.parametrize("label", LENGTHS)
def test_graphs_replayed(run, label):
    assert run(label, "cuda fp32 graphs")["graph_replays"] > 0


def test_qwen3_qk_norms_cuda_vs_cpu(tmp_path, prompts):
    """A Qwen3-shaped random model (per-head q and k norms, folded into the rotary and cache
    write kernel on CUDA): fp32 greedy tokens on CUDA with graphs == the CPU's."""
    save_random_model(tmp_path, QWEN3_SHAPE, architecture="qwen3")
    lengths = LENGTHS["16x2..32"]
    cpu = generate(str(tmp_path), prompts, lengths, **CPU)
    cuda = generate(str(tmp_path), prompts, lengths, dtype="float32", **GPU)
    row = compare(cuda, cpu)
    print(f"qwen3-shaped, cuda fp32 graphs vs cpu fp32: {row}")
    assert row["ok"] and cuda["graph_replays"] > 0, row


def test_bf16_graphs_vs_eager(model_dir, prompts):
    """Reported (agreement, latency); required: the bf16 graphs are replayed."""
    varied = LENGTHS["16x2..32"]
    eager = generate(model_dir, prompts, varied, dtype="bfloat16", enforce_eager=True, **GPU)
    graphs = generate(model_dir, prompts, varied, dtype="bfloat16", **GPU)
    latency = {"eager": decode_latency(model_dir, dtype="bfloat16", enforce_eager=True, **GPU),
               "graphs": decode_latency(model_dir, dtype="bfloat16", **GPU)}
    print(f"16x2..32 cuda graphs vs eager (bf16, info): {compare(graphs, eager)}")
    print(f"batch-1 decode, bf16: eager {latency['eager']:.2f} ms/token, graphs "
          f"{latency['graphs']:.2f} ms/token ({latency['eager'] / latency['graphs']:.1f}x)")
    assert graphs["graph_replays"] > 0


def test_bf16_folded_norms_vs_kernels(model_dir, prompts, monkeypatch):
    """The fold (the default) against PAGEDLLM_FOLD_NORMS=0, one sequence at a time (the fold is a
    one-row path), bf16 with graphs: agreement and latency reported; required: the folded
    model replays its graphs and folds."""
    from pagedllm.layers import norm_fold

    def one_at_a_time(fold: bool) -> dict:
        monkeypatch.setattr(norm_fold, "ENABLED", fold)
        llm = LLM(model=model_dir, seed=0, dtype="bfloat16", **GPU)
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts[:8]]
        result = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                  "cumulative_logprob": [o.outputs[0].cumulative_logprob for o in outs],
                  "folds": llm.engine.worker.model.folds_norms,
                  "graph_replays": llm.engine.worker.runner.graphs.num_replays}
        del llm, outs
        free()
        return result

    kernels, folded = one_at_a_time(False), one_at_a_time(True)
    latency = {}
    for name, fold in (("kernels", False), ("folded", True)):
        monkeypatch.setattr(norm_fold, "ENABLED", fold)
        latency[name] = decode_latency(model_dir, dtype="bfloat16", **GPU)
    print(f"batch 1 folded norms vs norm kernels (bf16, info): {compare(folded, kernels)}")
    print(f"batch-1 decode, bf16 graphs: norm kernels {latency['kernels']:.2f} ms/token, "
          f"folded {latency['folded']:.2f} ms/token")
    assert folded["folds"] and not kernels["folds"]
    assert folded["graph_replays"] > 0
