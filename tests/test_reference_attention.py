"""The CPU paged attention (pagedllm/kernels/reference.py: one padded decode batch reading
only each sequence's blocks, prompts attending to their own fresh K/V, a plan shared by the
layers of a step) against plain float64 attention computed one sequence at a time."""
from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.reference import alibi_slopes, paged_attention, write_kv_cache
from tests.paged_helpers import naive_attention, random_step

def run_layer(cache, meta, query, key, value, **kwargs):
    """What PagedAttention does on the CPU: write this step's K/V, then attend."""
    write_kv_cache(key, value, cache, meta.slot_mapping)
    return paged_attention(query, cache, meta, query.shape[-1] ** -0.5, key=key, value=value, **kwargs)


CASES = {
    # Decodes of many lengths: one token, partial blocks, exactly full blocks, long ones.
    "decode": ([1, 5, 8, 13, 40, 37, 2, 64], [1] * 8),
    "decode-equal-lengths": ([12, 12, 12], [1, 1, 1]),
    "prefill": ([9, 23, 4], [9, 23, 4]),
    "chunked-prefill-with-context": ([30, 17], [11, 5]),
    "mixed": ([33, 20, 7, 45, 1], [1, 20, 1, 12, 1]),
    "sequence-without-query-tokens": ([30, 12, 50], [1, 0, 1]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("variant", ["plain", "sliding_window", "alibi", "mha"])
def test_matches_naive_attention(case, variant):
    seq_lens, query_lens = CASES[case]
    heads, kv_heads = (4, 4) if variant == "mha" else (6, 2)
    cache, meta, query, key, value, keys, values = random_step(
        seq_lens, query_lens, heads=heads, kv_heads=kv_heads, seed=len(case))
    window = 6 if variant == "sliding_window" else None
    slopes = alibi_slopes(heads) if variant == "alibi" else None
    out = run_layer(cache, meta, query, key, value, sliding_window=window, alibi=slopes)
    assert not out.isnan().any(), "read a slot the sequence does not own"
    start = 0
    for s, q, k, v in zip(seq_lens, query_lens, keys, values):
        want = naive_attention(query[start: start + q], k, v, s, query.shape[-1] ** -0.5, window, slopes)
        torch.testing.assert_close(out[start: start + q].double(), want, atol=1e-5, rtol=1e-5)
        start += q


def test_fresh_key_value_equal_reading_the_cache():
    """A prompt without cached context attends to this step's K/V, not the cache: same result
    as the path that gathers them back (given no key/value)."""
    seq_lens, query_lens = CASES["mixed"]
    cache, meta, query, key, value, _, _ = random_step(seq_lens, query_lens, seed=3)
    fresh = run_layer(cache, meta, query, key, value)
    gathered = paged_attention(query, cache, meta.to("cpu"), query.shape[-1] ** -0.5)  # new plan
    torch.testing.assert_close(fresh, gathered, atol=1e-6, rtol=1e-5)


def test_plan_is_made_once_per_step_and_shared_by_layers():
    cache, meta, query, key, value, _, _ = random_step([10, 3, 25], [1, 1, 1], seed=4)
    first = run_layer(cache, meta, query, key, value)
    (plan,) = [v for k, v in meta._step_cache.items() if k[0] == "attention"]
    second = run_layer(cache, meta, query, key, value)  # the next layer (same cache here)
    assert [v for k, v in meta._step_cache.items() if k[0] == "attention"] == [plan]
    torch.testing.assert_close(first, second)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    seq_lens, query_lens = CASES["mixed"]
    cache, meta, query, key, value, keys, values = random_step(seq_lens, query_lens, seed=5, dtype=dtype)
    out = run_layer(cache, meta, query, key, value)
    start = 0
    for s, q, k, v in zip(seq_lens, query_lens, keys, values):
        want = naive_attention(query[start: start + q], k, v, s, query.shape[-1] ** -0.5)
        torch.testing.assert_close(out[start: start + q].double(), want, atol=3e-2, rtol=3e-2)
        start += q
