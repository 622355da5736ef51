"""LoRA on CUDA as a kernel pair over the flat batch, rows grouped by adapter slot on the
device (Punica's SGMV: segmented shrink and expand):

    shrink:  y[t, p*BR:(p+1)*BR]  = x[t, :] . A[s, p*R:(p+1)*R]^T     for every part p
    expand:  out[t, n]           += y[t, part(n)*BR:...] . B[s, n]^T   over all parts' columns

with s the slot of row t. One shrink and one expand per projection cover all its fused
parts (q|k|v share x): A is the parts' A stacked [slots, parts*R, K], B their B stacked
[slots, N, R] with part p owning columns [ends[p-1], ends[p]).

The rows come as segments: `perm` holds the row indices sorted by slot and slot s's rows
are perm[starts[s]:starts[s+1]] (layers/lora.segments); base-model rows are in no segment
and are left alone. A program takes BLOCK_M rows of one segment, so A/B tiles are read
once per BLOCK_M rows (tl.dot), and the grid (slots, cdiv(rows, BLOCK_M), ...) depends on
the row count only: programs past their segment's end do nothing. Nothing is decided on
the host from the slot values, which is what a CUDA graph needs (perm and starts live in
static buffers there). The shrink splits K over programs (fp32 atomics into a zeroed y)
so a batch of one row still fills the GPU.

A single row can skip the shrink: the projection's base GEMV also multiplies every slot's A
(stacked under the base weight, layers/lora.py's joint weight), and the expand then reads
the row's own slot's ranks out of those extra columns (`y_per_slot`).

Ranks are the pool's padded rank R (zero past an adapter's own). Runs under
TRITON_INTERPRET=1 on the CPU for the tests; layers/lora.py holds the torch oracle.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_PARTS = 3  # q|k|v
BLOCK_K = 64
K_PER_PROGRAM = 512  # the shrink's split of K


@triton.jit
def _segment_rows(perm_ptr, starts_ptr, BLOCK_M: tl.constexpr):
    """This program's slot (program_id(0)) and rows: BLOCK_M positions of the slot's
    segment (row indices, which are valid, and whether the tile has any)."""
    s = tl.program_id(0)
    begin = tl.load(starts_ptr + s) + tl.program_id(1) * BLOCK_M
    end = tl.load(starts_ptr + s + 1)
    rm = begin + tl.arange(0, BLOCK_M)
    valid = rm < end
    rows = tl.load(perm_ptr + rm, mask=valid, other=0).to(tl.int64)
    return s.to(tl.int64), rows, valid, begin < end


@triton.jit
def _shrink_kernel(y_ptr, x_ptr, a_ptr, perm_ptr, starts_ptr, K, k_per_program, stride_x,
                   stride_y, stride_as, stride_ar, R: tl.constexpr, SPLIT_K: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr):
    s, rows, valid, any_rows = _segment_rows(perm_ptr, starts_ptr, BLOCK_M)
    if any_rows:
        part = tl.program_id(2) // SPLIT_K
        k_begin = (tl.program_id(2) % SPLIT_K) * k_per_program
        rr = tl.arange(0, BLOCK_R)
        a_cols = a_ptr + s * stride_as + (part * R + rr)[None, :] * stride_ar  # [1, BR]
        x_rows = x_ptr + rows[:, None] * stride_x  # [BM, 1]
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(k_begin, k_begin + k_per_program, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < K
            x = tl.load(x_rows + rk[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
            a = tl.load(a_cols + rk[:, None], mask=k_ok[:, None] & (rr[None, :] < R),
                        other=0.0)
            acc = tl.dot(x, a, acc, input_precision=PRECISION)
        y_ptrs = y_ptr + rows[:, None] * stride_y + part * BLOCK_R + rr[None, :]
        if SPLIT_K == 1:
            tl.store(y_ptrs, acc, mask=valid[:, None])
        else:
            tl.atomic_add(y_ptrs, acc, mask=valid[:, None], sem="relaxed")


@triton.jit
def _expand_kernel(out_ptr, y_ptr, b_ptr, perm_ptr, starts_ptr, N, end0, end1, stride_o,
                   stride_y, stride_ys, stride_yp, stride_bs, stride_bn, R: tl.constexpr,
                   PARTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_R: tl.constexpr, PRECISION: tl.constexpr):
    s, rows, valid, any_rows = _segment_rows(perm_ptr, starts_ptr, BLOCK_M)
    if any_rows:
        rn = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        rr = tl.arange(0, BLOCK_R)
        part = (rn >= end0).to(tl.int32) + (rn >= end1).to(tl.int32)  # [BN]
        b_ptrs = b_ptr + s * stride_bs + rn[None, :] * stride_bn + rr[:, None]  # [BR, BN]
        b_ok = (rn[None, :] < N) & (rr[:, None] < R)
        y_rows = y_ptr + rows[:, None] * stride_y + s * stride_ys + rr[None, :]  # [BM, BR]
        y_ok = valid[:, None] & (rr[None, :] < R)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for p in tl.static_range(PARTS):
            # each column takes its own part's ranks: B is zero outside part p here
            b = tl.load(b_ptrs, mask=b_ok & (part[None, :] == p), other=0.0)
            y = tl.load(y_rows + p * stride_yp, mask=y_ok, other=0.0)
            acc = tl.dot(y.to(b.dtype), b, acc, input_precision=PRECISION)
        o_ptrs = out_ptr + rows[:, None] * stride_o + rn[None, :]
        o_ok = valid[:, None] & (rn[None, :] < N)
        o = tl.load(o_ptrs, mask=o_ok, other=0.0)
        tl.store(o_ptrs, (o.to(tl.float32) + acc).to(o.dtype), mask=o_ok)


def _block_m(num_rows: int) -> int:
    return 16 if num_rows <= 32 else 64


def _block_r(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))  # tl.dot's smallest


def _precision(dtype: torch.dtype) -> str | None:
    return "ieee" if dtype == torch.float32 else None  # fp32 stays fp32 (the oracle's)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, perm: torch.Tensor,
                starts: torch.Tensor, num_parts: int) -> torch.Tensor:
    """x [T, K] (rows contiguous), lora_a [slots, parts*R, K] contiguous, perm [T] and
    starts [slots + 1] int64 -> y [T, parts*BR] fp32, BR = R padded to a power of two >= 16
    (columns past R are zero; rows in no segment are zero)."""
    num_tokens, k = x.shape
    rank = lora_a.shape[1] // num_parts
    block_r, block_m = _block_r(rank), _block_m(num_tokens)
    split_k = triton.cdiv(k, K_PER_PROGRAM)
    y = torch.zeros(num_tokens, num_parts * block_r, dtype=torch.float32, device=x.device)
    if num_tokens:
        grid = (lora_a.shape[0], triton.cdiv(num_tokens, block_m), num_parts * split_k)
        _shrink_kernel[grid](
            y, x, lora_a, perm, starts, k, K_PER_PROGRAM, x.stride(0), y.stride(0),
            lora_a.stride(0), lora_a.stride(1), R=rank, SPLIT_K=split_k, BLOCK_M=block_m,
            BLOCK_R=block_r, BLOCK_K=BLOCK_K, PRECISION=_precision(x.dtype))
    return y


def lora_expand(out: torch.Tensor, y: torch.Tensor, lora_b: torch.Tensor, perm: torch.Tensor,
                starts: torch.Tensor, part_ends: list[int], y_per_slot: bool = False) -> None:
    """out[t] += y[t] . lora_b[slot(t)]^T in place for every row in a segment; lora_b
    [slots, N, R] contiguous, its columns split into parts ending at `part_ends` (the
    last is N), part p reading y's p-th block of ranks: y is lora_shrink's [T, parts*BR],
    or with `y_per_slot` every slot's ranks [T, slots*parts*R] (slot-major, then part),
    of which a row reads its own slot's. out and y: unit column stride, any row stride."""
    num_tokens, n = out.shape[0], lora_b.shape[1]
    slots, parts, rank = lora_b.shape[0], len(part_ends), lora_b.shape[2]
    if not 1 <= parts <= MAX_PARTS or part_ends[-1] != n:
        raise ValueError(f"part ends {part_ends} do not split {n} columns into 1..{MAX_PARTS}")
    if y_per_slot:
        if y.shape[1] != slots * parts * rank:
            raise ValueError(f"y has {y.shape[1]} columns, not {slots} slots x {parts} parts "
                             f"x rank {rank}")
        y_slot, y_part, block_r = parts * rank, rank, _block_r(rank)
    else:
        y_slot, y_part, block_r = 0, y.shape[1] // parts, y.shape[1] // parts
    ends = list(part_ends[:-1]) + [n] * (MAX_PARTS - parts + 1)
    block_m = _block_m(num_tokens)
    block_n = 128 if block_m == 16 else 64
    if num_tokens:
        grid = (lora_b.shape[0], triton.cdiv(num_tokens, block_m), triton.cdiv(n, block_n))
        _expand_kernel[grid](
            out, y, lora_b, perm, starts, n, ends[0], ends[1], out.stride(0), y.stride(0),
            y_slot, y_part, lora_b.stride(0), lora_b.stride(1), R=rank, PARTS=parts,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
            PRECISION=_precision(lora_b.dtype))
