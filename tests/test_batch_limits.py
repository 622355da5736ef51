"""The batch limits when the user sets neither max_num_seqs nor max_num_batched_tokens:
sized by the GPU as vLLM v1's defaults, the CPU's unchanged, never past the KV cache."""
from __future__ import annotations

from pagedllm.config import bound_by_cache, default_batch_limits

GIB = 1 << 30


def test_a_large_gpu_gets_larger_batches():
    assert default_batch_limits("cuda", 141 * GIB) == (1024, 16384)  # an H200
    assert default_batch_limits("cuda", 80 * GIB) == (1024, 16384)
    assert default_batch_limits("cuda", 70 * GIB) == (1024, 16384)
    assert default_batch_limits("cuda", 24 * GIB) == (256, 8192)
    assert default_batch_limits("cuda", None) == (256, 8192)  # the user set one of them


def test_the_cpu_defaults_are_unchanged():
    assert default_batch_limits("cpu", None) == (256, 2048)
    assert default_batch_limits("cpu", 512 * GIB) == (256, 2048)


def test_the_kv_cache_bounds_them():
    assert bound_by_cache(1024, 16384, num_blocks=100_000, block_size=16,
                          floor_tokens=0) == (1024, 16384)
    # a cache of 500 blocks: 500 sequences at most, 8000 tokens a step
    assert bound_by_cache(1024, 16384, num_blocks=500, block_size=16,
                          floor_tokens=0) == (500, 8000)
    # without chunked prefill a step must take a whole context
    assert bound_by_cache(1024, 16384, num_blocks=500, block_size=16,
                          floor_tokens=8192) == (500, 8192)
