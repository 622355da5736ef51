"""LoRA on CUDA as a kernel pair over the flat batch, each token row reading its own
adapter slot (Punica/S-LoRA's shrink and expand, one row a program):

    shrink:  y[t, :]        = x[t, :] . A[slot[t]]^T          y [tokens, R] fp32
    expand:  out[t, cols]  += y[t, :] . B[slot[t]]^T          into a column range of out

slot[t] < 0 (a base-model row) skips the row. The slots live on the device, so the pair
needs no host-side grouping and keeps the same launch shape for any mix of adapters (what
a CUDA graph needs). Rows of one adapter read the same A/B slot, which stays in L2 across
them. Ranks are the pool's padded rank R (zero past an adapter's own). Runs under
TRITON_INTERPRET=1 on the CPU for the tests; layers/lora.py holds the torch oracle.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(y_ptr, x_ptr, a_ptr, slot_ptr, K, stride_x, stride_as, stride_ar,
                   R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    rr = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if slot >= 0:
        a_rows = a_ptr + slot.to(tl.int64) * stride_as + rr[:, None] * stride_ar
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + t.to(tl.int64) * stride_x + rk, mask=rk < K, other=0.0)
            a = tl.load(a_rows + rk[None, :], mask=(rr[:, None] < R) & (rk[None, :] < K),
                        other=0.0)
            acc += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(y_ptr + t * BLOCK_R + rr, acc)


@triton.jit
def _expand_kernel(out_ptr, y_ptr, b_ptr, slot_ptr, N, col0, stride_o, stride_bs, stride_bn,
                   R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rr = tl.arange(0, BLOCK_R)
        y = tl.load(y_ptr + t * BLOCK_R + rr)
        b = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + rn[:, None] * stride_bn
                    + rr[None, :], mask=(rn[:, None] < N) & (rr[None, :] < R), other=0.0)
        delta = tl.sum(b.to(tl.float32) * y[None, :], axis=1)
        o_ptrs = out_ptr + t.to(tl.int64) * stride_o + col0 + rn
        o = tl.load(o_ptrs, mask=rn < N, other=0.0)
        tl.store(o_ptrs, (o.to(tl.float32) + delta).to(o.dtype), mask=rn < N)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x [T, K], lora_a [slots, R, K], slots [T] int64 -> y [T, BLOCK_R] fp32 (the ranks
    past R are zero; rows of slot -1 are zero)."""
    num_tokens, k = x.shape
    rank = lora_a.shape[1]
    block_r = triton.next_power_of_2(rank)
    y = torch.empty(num_tokens, block_r, dtype=torch.float32, device=x.device)
    if num_tokens:
        _shrink_kernel[(num_tokens,)](y, x, lora_a, slots, k, x.stride(0), lora_a.stride(0),
                                      lora_a.stride(1), R=rank, BLOCK_R=block_r,
                                      BLOCK_K=min(256, triton.next_power_of_2(k)))
    return y


def lora_expand(out: torch.Tensor, y: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor,
                col0: int = 0) -> None:
    """out[:, col0:col0 + N] += y . lora_b[slot]^T in place; lora_b [slots, N, R]."""
    num_tokens = out.shape[0]
    n, rank = lora_b.shape[1], lora_b.shape[2]
    block_n = min(128, triton.next_power_of_2(n))
    if num_tokens:
        _expand_kernel[(num_tokens, triton.cdiv(n, block_n))](
            out, y, lora_b, slots, n, col0, out.stride(0), lora_b.stride(0), lora_b.stride(1),
            R=rank, BLOCK_R=y.shape[1], BLOCK_N=block_n)
