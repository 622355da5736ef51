"""The quality rule of 8-bit activations (--cpu-activations int8) on the default GGUF: the
perplexity of a fixed real public-domain text (the Declaration of Independence and the
Gettysburg Address, 2,045 tokens) within +1.0% of the fp32-activation path's, with the
prompt run in chunks of 64 tokens so that both modes' projections take the packed matmul
(int8 runs longer batches 64 rows at a time; fp32 activations take BLAS above 64 rows).
Greedy agreement is printed beside it."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.kernels.cpu import build
from tests.prompts import OPENINGS

pytestmark = pytest.mark.skipif(build.load_library() is None, reason="no CPU kernels")
TEXT = (Path(__file__).parent / "data" / "declaration_gettysburg.txt").read_text()


def engine(activations: str) -> LLM:
    return LLM(quantization="gguf", cpu_activations=activations, kv_cache_memory=128 << 20,
               max_num_batched_tokens=64, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def engines():
    return engine("fp32"), engine("int8")


def perplexity(llm: LLM, text: str) -> tuple[float, int]:
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate(text, params, use_tqdm=False)[0]
    logprobs = [entry[token].logprob for entry, token
                in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
    return math.exp(-sum(logprobs) / len(logprobs)), len(out.prompt_token_ids)


def test_int8_runs_the_int8_kernel(engines):
    fp32, int8 = engines
    layers = int8.engine.worker.model.layers
    assert all(layer.mlp.down_proj.int8_activations for layer in layers)
    assert not fp32.engine.worker.model.layers[0].mlp.down_proj.int8_activations


def test_perplexity_of_int8_within_one_percent(engines):
    fp32, int8 = engines
    want, tokens = perplexity(fp32, TEXT)
    got, _ = perplexity(int8, TEXT)
    print(f"perplexity over {tokens} tokens: fp32 {want:.4f}, int8 {got:.4f}, "
          f"ratio {got / want:.5f}")
    assert tokens >= 2000
    assert got / want <= 1.01


def test_greedy_agreement_is_reported(engines):
    fp32, int8 = engines
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = OPENINGS[:8]
    a, b = (llm.generate(prompts, params, use_tqdm=False) for llm in (fp32, int8))
    agree = 0
    for x, y in zip(a, b):
        tx, ty = x.outputs[0].token_ids, y.outputs[0].token_ids
        agree += next((i for i, (p, q) in enumerate(zip(tx, ty)) if p != q), len(tx))
    print(f"greedy agreement int8 vs fp32: {agree}/{32 * len(prompts)} tokens before the "
          "first divergence")
    assert all(len(y.outputs[0].token_ids) == 32 for y in b)
