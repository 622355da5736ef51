"""The sampler's per-row reductions on CUDA in one pass: the first index of each row's
maximum (greedy's token) and the row's logsumexp (every sampled token's logprob).

torch runs each as its own reduction, and for few rows reduces a 128k-entry row in a few
blocks: ~55 us of a Llama-3-8B batch-1 decode step. Here a row is cut into chunks, one
program each (max, its first index, the sum of exp(v - max)), and the last chunk to finish
merges the row's chunks (triton_counters), in chunk order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.triton_counters import counters

CHUNK = 4096


@triton.jit
def _row_stats_kernel(logits_ptr, idx_ptr, lse_ptr, part_m_ptr, part_s_ptr, part_i_ptr,
                      count_ptr, V, stride, CHUNKS: tl.constexpr, CHUNKS_PAD: tl.constexpr,
                      BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(logits_ptr + row * stride + cols, mask=cols < V,
                other=float("-inf")).to(tl.float32)
    m = tl.max(v, 0)
    first = tl.min(tl.where(v == m, cols, V), 0)
    s = tl.sum(tl.where(v == float("-inf"), 0.0, tl.exp(v - m)), 0)
    if CHUNKS == 1:
        tl.store(idx_ptr + row, first.to(tl.int64))
        tl.store(lse_ptr + row, m + tl.log(s))
    else:
        part = row * CHUNKS + chunk
        tl.store(part_m_ptr + part, m)
        tl.store(part_s_ptr + part, s)
        tl.store(part_i_ptr + part, first)
        tl.debug_barrier()
        done = tl.atomic_add(count_ptr + row, 1, sem="acq_rel")
        if done == CHUNKS - 1:
            c = tl.arange(0, CHUNKS_PAD)
            valid = c < CHUNKS
            ms = tl.load(part_m_ptr + row * CHUNKS + c, mask=valid, other=float("-inf"),
                         cache_modifier=".cg")
            ss = tl.load(part_s_ptr + row * CHUNKS + c, mask=valid, other=0.0,
                         cache_modifier=".cg")
            ids = tl.load(part_i_ptr + row * CHUNKS + c, mask=valid, other=V,
                          cache_modifier=".cg")
            top = tl.max(ms, 0)
            # chunks hold increasing columns: the first maximal column is the smallest index
            # among the chunks whose maximum is the row's
            tl.store(idx_ptr + row, tl.min(tl.where(ms == top, ids, V), 0).to(tl.int64))
            total = tl.sum(tl.where(ms == float("-inf"), 0.0, ss * tl.exp(ms - top)), 0)
            tl.store(lse_ptr + row, top + tl.log(total))
            tl.atomic_xchg(count_ptr + row, 0)


def row_argmax_logsumexp(logits: torch.Tensor, block: int = CHUNK
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [rows, vocab] -> (first index of each row's maximum [rows] int64, logsumexp
    [rows, 1] fp32): logits.max(-1).indices and logits.float().logsumexp(-1, keepdim=True)."""
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    idx = torch.empty(rows, dtype=torch.long, device=logits.device)
    lse = torch.empty(rows, 1, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return idx, lse
    chunks = triton.cdiv(vocab, block)
    part_m = torch.empty(rows * chunks, dtype=torch.float32, device=logits.device)
    part_s = torch.empty_like(part_m)
    part_i = torch.empty(rows * chunks, dtype=torch.int32, device=logits.device)
    _row_stats_kernel[(rows, chunks)](
        logits, idx, lse, part_m, part_s, part_i,
        counters("row_argmax_logsumexp", logits.device, rows), vocab, logits.stride(0),
        CHUNKS=chunks, CHUNKS_PAD=triton.next_power_of_2(chunks), BLOCK=block, num_warps=8,
    )
    return idx, lse
