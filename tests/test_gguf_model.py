"""Models with GGUF weights kept packed (--quantization gguf) against the same file
dequantized (--dtype float32, the oracle): a tiny GGUF of every supported type, and the
default model's acceptance (greedy agreement, perplexity, weight bytes)."""
from __future__ import annotations

import itertools
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.workloads import PASSAGES
from pagedllm.kernels.cpu import build
from pagedllm.layers.gguf_linear import GGUFEmbedding, GGUFLinear, PackedMatrix
from tests.paged_helpers import PagedRunner, greedy_agreement
from tests.prompts import OPENINGS, QUESTIONS
from tests.quant_helpers import QT, random_packed

pytestmark = pytest.mark.skipif(build.load_library() is None,
                                reason="no C compiler: GGUF weights cannot stay packed")

# vocab: the benchmarks draw random prompt ids below 10,000
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, LAYERS = 256, 4, 2, 64, 512, 10240, 2
# One type per tensor, every supported type somewhere (K-quants need rows of 256 values).
TYPES = {"attn_q": QT.Q4_K, "attn_k": QT.Q6_K, "attn_v": QT.Q4_0, "attn_output": QT.Q4_1,
         "ffn_gate": QT.Q8_0, "ffn_up": QT.Q4_K, "ffn_down": QT.Q6_K, "output": QT.Q6_K}


def write_mixed_gguf(path: Path, arch: str, tied: bool) -> None:
    """A tiny model whose 2-D tensors are random blocks of mixed types."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_eos_token_id(2)

    seeds = itertools.count()

    def packed(name: str, qtype, rows: int, cols: int) -> None:
        w.add_tensor(name, random_packed(qtype, rows, cols, seed=next(seeds)), raw_dtype=qtype)

    packed("token_embd.weight", QT.Q4_K if tied else QT.Q8_0, VOCAB, HIDDEN)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    if not tied:
        packed("output.weight", TYPES["output"], VOCAB, HIDDEN)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i in range(LAYERS):
        for part, rows, cols in [("attn_q", q, HIDDEN), ("attn_k", kv, HIDDEN),
                                 ("attn_v", kv, HIDDEN), ("attn_output", HIDDEN, q),
                                 ("ffn_gate", FFN, HIDDEN), ("ffn_up", FFN, HIDDEN),
                                 ("ffn_down", HIDDEN, FFN)]:
            packed(f"blk.{i}.{part}.weight", TYPES[part], rows, cols)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight",
                         (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        if arch == "qwen2":
            for part, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
                w.add_tensor(f"blk.{i}.{part}.bias", rng.standard_normal(rows).astype(np.float32))
        if arch == "qwen3":  # per-head q/k RMSNorm
            for norm in ("attn_q_norm", "attn_k_norm"):
                w.add_tensor(f"blk.{i}.{norm}.weight",
                             (1 + 0.1 * rng.standard_normal(HEAD_DIM)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch, tied", [("llama", False), ("qwen2", True)])
def test_tiny_mixed_model_matches_its_dequantized_self(tmp_path, arch, tied):
    path = tmp_path / "mixed.gguf"
    write_mixed_gguf(path, arch, tied)
    common = dict(model=str(path), kv_cache_memory=16 << 20, max_num_batched_tokens=256)
    packed = LLM(quantization="gguf", **common).engine.worker.model
    dense = LLM(dtype="float32", **common).engine.worker.model
    # Every linear and the embedding stayed packed, and holds exactly the oracle's weights
    # (llama's q/k rows un-permuted, q|k|v and gate|up fused in order, mixed types).
    modules = {n: m for n, m in packed.named_modules() if isinstance(m, PackedMatrix)}
    assert len(modules) == LAYERS * 4 + 1 + (not tied)
    assert isinstance(packed.embed_tokens, GGUFEmbedding)
    assert isinstance(packed.layers[0].self_attn.qkv_proj, GGUFLinear)
    assert [s.qtype for s in packed.layers[0].self_attn.qkv_proj.parts] == [
        QT.Q4_K, QT.Q6_K, QT.Q4_0]
    for name, m in modules.items():
        assert torch.equal(m.dequantize(), dense.get_submodule(name).weight), name
    # Logits through every matmul path: 43 prompt rows (BLAS), 2 decode rows (integer
    # kernel), 12 rows (tiled kernel).
    runs = [PagedRunner(m, m.config, num_blocks=32, block_size=16) for m in (packed, dense)]
    rng = np.random.default_rng(1)
    for chunks in [{0: 40, 1: 3}, {0: 1, 1: 1}, {0: 1, 1: 1}, {0: 12}]:
        ids = {s: rng.integers(0, VOCAB, n).tolist() for s, n in chunks.items()}
        ours, want = (r.step(ids) for r in runs)
        # Random weights amplify rounding: fp32 in another order (the tiled kernel) already
        # moves logits by ~6e-5 of their range, 16-bit activations by ~2.5e-4.
        assert (ours - want).abs().max().item() <= 1e-3 * want.abs().max().item()


def test_gguf_needs_a_gguf_file_the_cpu_and_float32():
    with pytest.raises(ValueError, match="--quantization gguf keeps a GGUF file's blocks; this "
                       "model's weights are dummy"):
        LLM(model="smollm2-135m", load_format="dummy", quantization="gguf")
    with pytest.raises(ValueError, match="--quantization gguf computes in float32, not bfloat16"):
        LLM(quantization="gguf", dtype="bfloat16")
    with pytest.raises(ValueError, match="--quantization fp8 runs on CUDA only"):
        LLM(model="smollm2-135m", load_format="dummy", quantization="fp8", device="cpu")
    with pytest.raises(ValueError, match="quantization must be one of gguf, fp8, got 'int3'"):
        LLM(quantization="int3")


# ----------------------------------------------------------------------------- default model


@pytest.fixture(scope="module")
def gguf_llm():
    # At most four sequences at a time: every decode step runs the integer kernel.
    return LLM(quantization="gguf", kv_cache_memory=256 << 20, max_num_seqs=4)


def test_default_model_stays_packed(gguf_llm, default_llm, default_gguf):
    ours, dense = gguf_llm.engine.worker, default_llm.engine.worker
    assert all(isinstance(m, GGUFLinear) for name, m in ours.model.named_modules()
               if name.endswith("_proj"))
    # The file's 2-D tensors as stored (Q4_1 layers, the Q8_0 embedding doubling as the
    # head), plus fp32 norms: under a fifth of the dequantized model.
    file_bytes = Path(default_gguf).stat().st_size
    assert 0.9 * file_bytes < ours.weight_bytes < file_bytes
    assert ours.weight_bytes < dense.weight_bytes / 5


def test_greedy_agreement_with_the_float32_path(gguf_llm, default_llm):
    """Issue 16's acceptance: >= 90% of 16 prompts x 32 greedy tokens agree (measured: all
    512, the chosen tokens' logprobs within 2e-3)."""
    prompts = OPENINGS[:8] + QUESTIONS[:8]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=0)
    want = default_llm.generate(prompts, params, use_tqdm=False)
    ours = gguf_llm.generate(prompts, params, use_tqdm=False)
    agree, worst = greedy_agreement(ours, want)
    print(f"greedy agreement {agree}/512, max logprob difference {worst:.5f}")
    assert agree >= 0.9 * 512
    assert worst < 0.05


def perplexity(llm: LLM, text: str) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate(text, params, use_tqdm=False)[0]
    logprobs = [entry[token].logprob for entry, token
                in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
    return math.exp(-sum(logprobs) / len(logprobs))


def test_perplexity_within_one_percent(gguf_llm, default_llm):
    """On a fixed real text (four passages, 225 tokens): the prompt as one batch
    (dequantize + BLAS) and in chunks of 4 tokens (the integer kernel)."""
    text = "\n\n".join(PASSAGES[:4])
    want = perplexity(default_llm, text)
    chunked = LLM(quantization="gguf", kv_cache_memory=64 << 20, max_num_batched_tokens=4,
                  enable_prefix_caching=False)
    for llm in (gguf_llm, chunked):
        ratio = perplexity(llm, text) / want
        print(f"perplexity ratio {ratio:.5f}")
        assert abs(ratio - 1) < 0.01


def test_bench_cpu_target_rows(tmp_path):
    """`bench cpu`'s issue-16/34 rows, shrunk, on a tiny GGUF: packed (int8 and fp32
    activations) and dequantized engines on 1 stream, several streams and a prefill;
    llama.cpp (its batched decode too) only when importable."""
    import importlib.util
    import json

    from pagedllm.benchmarks import workloads

    path = tmp_path / "mixed.gguf"
    write_mixed_gguf(path, "llama", tied=False)
    out = tmp_path / "cpu.json"
    argv = ["cpu", "--model", str(path), "--num-requests", "2", "--max-tokens", "3",
            "--max-input-len", "20", "--no-peer", "--repeats", "1", "--kv-cache-memory", "5e7",
            "--target-tokens", "4", "--target-streams", "3", "--prefill-len", "40",
            "--out", str(out)]
    assert workloads.main(argv) == 0
    data = json.loads(out.read_text())
    rows = {r["name"]: r for r in data["runs"]}
    summary = data["summary"]
    # llama.cpp, where importable, declines this tiny file (no tokenizer): a note, no rows
    has_llama_cpp = "no llama.cpp rows" not in summary["llama.cpp"]
    if importlib.util.find_spec("llama_cpp") is None:
        assert "not installed" in summary["llama.cpp"]
    engines = ["gguf int8", "gguf", "fp32"] + ["llama.cpp"] * has_llama_cpp
    expected = {"pagedllm"} | {f"{e} {w}" for e in engines
                               for w in ("1 stream", "3 streams", "prefill 40")}
    assert set(rows) == expected
    assert rows["gguf 3 streams"]["output_tokens"] == 3 * 4
    assert rows["gguf prefill 40"]["rate"] == pytest.approx(40 / rows["gguf prefill 40"]["elapsed_s"])
    assert summary["pagedllm_weights"] == "gguf"  # the default for a GGUF on the CPU
    assert "gguf / fp32 prefill 40" in summary and "gguf 1 stream target 60 tok/s met" in summary
    assert "gguf int8 / gguf 3 streams" in summary
    assert ("gguf int8 / llama.cpp 3 streams target 2.5x met" in summary) == has_llama_cpp
