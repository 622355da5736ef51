"""Greedy LLM.generate on the default model is token-for-token transformers' generate,
in every scheduling configuration (acceptance of the engine-core issue)."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.paged_helpers import NEAR_TIE_VS_TRANSFORMERS, assert_same_greedy, hf_greedy_reference
from tests.prompts import mixed_prompts

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts()


@pytest.fixture(scope="module")
def reference(hf_reference, prompts):
    """transformers' greedy continuations (token ids, EOS included when reached) with each
    step's top log-probabilities, generated as one left-padded batch (transformers' fp32
    logits do not depend on the batch shape)."""
    model, tokenizer = hf_reference
    return hf_greedy_reference(model, tokenizer, prompts, MAX_TOKENS)


CONFIGS = {
    "default": dict(),
    # 40 blocks x 16 tokens: far less than 32 requests need at once.
    "preempt-recompute": dict(num_gpu_blocks_override=40, preemption_mode="recompute",
                              enable_prefix_caching=False),
    "preempt-swap": dict(num_gpu_blocks_override=40, preemption_mode="swap",
                         enable_prefix_caching=False),
    "prefix-caching": dict(enable_prefix_caching=True),
    "chunked-prefill-32": dict(max_num_batched_tokens=32, enable_prefix_caching=False),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_transformers(name, prompts, reference):
    llm = LLM(kv_cache_memory=256 << 20, dtype="float32", **CONFIGS[name])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    if name == "prefix-caching":
        # Warm the cache with one request that carries the shared prefix.
        llm.generate(prompts[16], params, use_tqdm=False)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i, (out, (ref, ref_logprobs)) in enumerate(zip(outs, reference)):
        assert_same_greedy(out.outputs[0].token_ids, ref, ref_logprobs,
                           NEAR_TIE_VS_TRANSFORMERS, f"prompt {i}, config {name}:")
    scheduler = llm.engine.scheduler
    if name.startswith("preempt"):
        stats = scheduler.stats
        done = stats.num_preemptions_swap if name.endswith("swap") else stats.num_preemptions_recompute
        assert done > 0, "the tiny cache should have forced preemption"
    if name == "prefix-caching":
        assert all(o.num_cached_tokens >= 48 for o in outs[16:])
        assert scheduler.block_manager.prefix_cache_hit_rate() > 0
    # Nothing leaked: every block is free again (cached blocks stay evictable).
    bm = scheduler.block_manager
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks
