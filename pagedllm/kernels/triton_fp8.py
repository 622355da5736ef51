"""Per-row dynamic FP8 E4M3 quantization on CUDA (layers/fp8_linear.py): the scales and the
FP8 rows of the activations for torch._scaled_mm, in one pass over x instead of six torch
ops. (Small batches multiply the FP8 weight directly: kernels/triton_gemv.py.) The RMSNorm
and SiLU-and-mul kernels quantize their own output rows the same way (e4m3_bits) when an
FP8 linear alone reads them (kernels/triton_ops.py), saving this kernel's pass.

It runs under TRITON_INTERPRET=1 on the CPU for the tests. The interpreter's fp32 -> fp8
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
def row_scale(amax):
    """The scale of a row whose largest |value| is amax: amax / 448, never 0."""
    return tl.maximum(amax / 448.0, 1e-12)


@triton.jit
def e4m3_bits(v, scale):
    """v / scale (fp32) clamped to +-448 and rounded to E4M3, as uint8 bits (stored into a
    uint8 view of the float8_e4m3fn tensor)."""
    q = tl.minimum(tl.maximum(v / scale, -448.0), 448.0)
    return _round_to_e4m3(q).to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def _quantize_rows_kernel(out_ptr, scale_ptr, x_ptr, K, stride_x, stride_o,
                          BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        v = tl.load(x_ptr + row * stride_x + k0 + rk, mask=k0 + rk < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(v.to(tl.float32)))
    scale = row_scale(tl.max(amax, 0))
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        v = tl.load(x_ptr + row * stride_x + k0 + rk, mask=k0 + rk < K, other=0.0)
        tl.store(out_ptr + row * stride_o + k0 + rk, e4m3_bits(v.to(tl.float32), scale),
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
