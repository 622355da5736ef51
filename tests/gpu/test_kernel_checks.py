"""The Triton kernels on CUDA at Llama-3-8B shapes (bf16, head_dim 128, 32 query / 8 KV
heads, block sizes 16 and 32, contexts up to 8k in shuffled blocks with NaN in every unused
slot) against the torch reference in fp32: decode, prefill, chunked prefill, mixed batches,
sliding window, ALiBi, reshape_and_cache with padding slots, the RMSNorm / SiLU-and-mul /
rotary kernels, and a decode replayed from a CUDA graph. The checks are `pagedllm bench
kernels`' (which also times them)."""
from __future__ import annotations

import pytest

from pagedllm.benchmarks import kernel_bench

pytestmark = pytest.mark.cuda

CHECKS = {
    "write_kv_cache": lambda: kernel_bench.check_write_kv_cache("cuda", 1),
    "attention": lambda: kernel_bench.check_attention("cuda", 1, 128),
    "ops": lambda: kernel_bench.check_ops("cuda", 1),
    "cuda_graph": lambda: kernel_bench.check_cuda_graph("cuda"),
}


@pytest.mark.parametrize("name", CHECKS)
def test_kernels_match_the_reference_on_cuda(name):
    kernel_bench.RESULTS.clear()
    CHECKS[name]()
    failed = [check for check, ok in kernel_bench.RESULTS if not ok]
    assert kernel_bench.RESULTS and not failed, f"failed: {failed}"
