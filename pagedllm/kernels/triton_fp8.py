"""Triton kernels for FP8 E4M3 weights on CUDA (layers/fp8_linear.py).

    w8a16_matmul    small batches (decode): y = x . (q * scale)^T straight from the FP8
                    weight, bf16 activations as they are. Each program owns a block of
                    output features and a slice of K (split-K, so that a GEMV's few
                    output blocks still fill every SM) and streams those weight bytes once
                    for every row of x; the matmul reads half the bytes of a bf16 weight,
                    which is what a decode step is bound by.
    quantize_rows   larger batches: per-row dynamic scales and the FP8 rows for
                    torch._scaled_mm, in one pass over x instead of six torch ops.

Both run under TRITON_INTERPRET=1 on the CPU for the tests. The interpreter's fp32 -> fp8
conversion mis-rounds values just below a power of two, so quantize_rows rounds to the E4M3
grid itself (round to nearest even) and only then converts, which is exact everywhere.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0
MIN_SCALE = 1e-12


@triton.jit
def _w8a16_kernel(out_ptr, x_ptr, w_ptr, scale_ptr, M, N, K, k_per_split, stride_xm,
                  stride_os, stride_om,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (n, s): output features [n * BLOCK_N, +BLOCK_N) over the K slice
    [s * k_per_split, +k_per_split); out[s] gets that slice's partial sums (split-K)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + ks[None, :],
                    mask=(rm[:, None] < M) & (ks[None, :] < k_end), other=0.0)
        w = tl.load(w_rows + ks[None, :], mask=(rn[:, None] < N) & (ks[None, :] < k_end),
                    other=0)
        # uint8 bytes -> e4m3 -> fp32 -> the activations' dtype (exact: e4m3 fits in bf16)
        w = w.to(tl.float8e4nv, bitcast=True).to(tl.float32).to(x.dtype)
        acc += tl.dot(x, tl.trans(w))
    scale = tl.load(scale_ptr + rn, mask=rn < N, other=0.0)
    acc = acc * scale[None, :]
    tl.store(out_ptr + pid_k * stride_os + rm[:, None] * stride_om + rn[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


W8A16_MAX_ROWS = 16  # one BLOCK_M of the kernel
W8A16_BLOCK_N, W8A16_BLOCK_K = 64, 256
# Split K until the grid has about this many programs per SM: a decode GEMV has too few
# output blocks (N / 64) to keep every SM streaming weights otherwise.
W8A16_PROGRAMS_PER_SM = 4


def w8a16_split_k(n: int, k: int, device: torch.device) -> int:
    """How many K slices: enough programs for the device's SMs, each slice at least two
    BLOCK_K steps long."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    blocks_n = triton.cdiv(n, W8A16_BLOCK_N)
    wanted = triton.cdiv(W8A16_PROGRAMS_PER_SM * sms, blocks_n)
    return max(1, min(wanted, k // (2 * W8A16_BLOCK_K)))


def w8a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                 split_k: int | None = None) -> torch.Tensor:
    """x [M, K] (M <= 16) bf16/fp16 . (qweight [N, K] float8_e4m3fn * scale [N])^T -> [M, N]
    in x's dtype, accumulated in fp32. split_k > 1: K in slices, partial sums in fp32 added
    after (default: w8a16_split_k)."""
    M, K = x.shape
    N = qweight.shape[0]
    if M > W8A16_MAX_ROWS:
        raise ValueError(f"w8a16_matmul takes at most {W8A16_MAX_ROWS} rows, got {M}")
    if qweight.shape[1] != K or not qweight.is_contiguous():
        raise ValueError("qweight must be a contiguous [N, K] matrix matching x")
    x = x if x.stride(-1) == 1 else x.contiguous()
    split = split_k or w8a16_split_k(N, K, x.device)
    k_per_split = triton.cdiv(triton.cdiv(K, split), W8A16_BLOCK_K) * W8A16_BLOCK_K
    split = triton.cdiv(K, k_per_split)
    if split == 1:
        out = torch.empty(1, M, N, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    _w8a16_kernel[(triton.cdiv(N, W8A16_BLOCK_N), split)](
        out, x, qweight.view(torch.uint8), scale.reshape(-1), M, N, K, k_per_split,
        x.stride(0), out.stride(0), out.stride(1), BLOCK_M=16, BLOCK_N=W8A16_BLOCK_N,
        BLOCK_K=W8A16_BLOCK_K, num_warps=4, num_stages=3,
    )
    return out[0] if split == 1 else out.sum(0).to(x.dtype)


@triton.jit
def _round_to_e4m3(v):
    """v (fp32, |v| <= 448) rounded to the nearest E4M3 value, ties to even."""
    bits = v.to(tl.int32, bitcast=True)
    # normal range: keep 3 of fp32's 23 mantissa bits
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & -1048576).to(tl.float32, bitcast=True)  # ~0xFFFFF
    # subnormals (|v| < 2^-6): multiples of 2^-9, by the 1.5 * 2^23 rounding trick on |v|
    # (the sign put back after, so that tiny negatives give -0 as a cast does)
    big = 12582912.0
    sub = ((tl.abs(v) * 512.0 + big) - big) / 512.0
    sub = tl.where(v < 0, -sub, sub)
    return tl.where(tl.abs(v) < 0.015625, sub, normal)


@triton.jit
def _quantize_rows_kernel(out_ptr, scale_ptr, x_ptr, K, stride_x, stride_o,
                          BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        v = tl.load(x_ptr + row * stride_x + k0 + rk, mask=k0 + rk < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(v.to(tl.float32)))
    scale = tl.maximum(tl.max(amax, 0) / 448.0, 1e-12)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        v = tl.load(x_ptr + row * stride_x + k0 + rk, mask=k0 + rk < K, other=0.0)
        q = tl.minimum(tl.maximum(v.to(tl.float32) / scale, -448.0), 448.0)
        q = _round_to_e4m3(q).to(tl.float8e4nv)
        tl.store(out_ptr + row * stride_o + k0 + rk, q.to(tl.uint8, bitcast=True),
                 mask=k0 + rk < K)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], fp32 scales [M, 1]): x ~= q * scale per row, the
    scale max|x_row| / 448 (what layers/fp8_linear.quantize_rows computes in torch ops)."""
    M, K = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(M, K, dtype=torch.uint8, device=x.device)
    scale = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    if M:
        _quantize_rows_kernel[(M,)](out, scale, x, K, x.stride(0), out.stride(0),
                                    BLOCK_K=min(4096, triton.next_power_of_2(K)), num_warps=8)
    return out.view(torch.float8_e4m3fn), scale
