"""Small fused elementwise kernels for the CUDA path: RMSNorm (+ residual add), SiLU-and-mul,
neox-style rotary embedding.

Each computes in fp32 and rounds to the input dtype where the Hugging Face modules round, so
bf16 results match a torch forward of the same model.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from pagedllm.kernels import triton_fp8, triton_pdl


# --------------------------------------------------------------------------------------
# RMSNorm, optionally fused with the residual add that precedes it
# --------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(
    out_ptr, scale_ptr, residual_out_ptr, x_ptr, residual_ptr, weight_ptr,
    stride_x, stride_xh, heads, stride_r, stride_o, stride_ro, n_cols, eps,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, FP8_OUT: tl.constexpr, PDL: tl.constexpr,
):
    """Row `row` of x is (row // heads, row % heads) of a [tokens, heads, n_cols] view
    (heads = 1: plain rows): per-head norms read q and k in place inside the fused qkv.
    FP8_OUT: the output row (rounded to x's dtype first) is stored quantized to E4M3 bits
    with its scale, as kernels/triton_fp8.quantize_rows would quantize it."""
    if PDL:  # before any read of an earlier kernel's output, any write (kernels/triton_pdl.py)
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + (row // heads) * stride_x + (row % heads) * stride_xh + cols, mask=mask,
                other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    x = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
    normed = (x * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = (normed * w).to(x_ptr.dtype.element_ty)
    if FP8_OUT:  # masked columns are 0: they leave the row's max alone
        out = out.to(tl.float32)
        scale = triton_fp8.row_scale(tl.max(tl.abs(out), 0))
        tl.store(scale_ptr + row, scale)
        out = triton_fp8.e4m3_bits(out, scale)
    tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """x viewed as 2-D rows of its last dimension, contiguous along it."""
    if x.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension")
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def triton_rms_norm(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # same shape as x
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm(x) * weight; with `residual`, first x = x + residual and return (normed, x)."""
    out, _, residual_out = _rms_norm(x, weight, eps, residual, fp8_out=False)
    return out if residual is None else (out, residual_out)


def triton_rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """triton_rms_norm with its output quantized per row for an FP8 linear: (float8_e4m3fn
    [rows, hidden], fp32 scales [rows, 1], x + residual or None)."""
    return _rms_norm(x, weight, eps, residual, fp8_out=True)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
              residual: torch.Tensor | None, fp8_out: bool):
    """(out, fp8 scales or None, residual out or None)."""
    hidden = x.shape[-1] if x.dim() else 0
    if tuple(weight.shape) != (hidden,):
        raise ValueError(f"weight must have shape ({hidden},), got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} does not match x shape {tuple(x.shape)}")
    if x.dim() == 3 and x.stride(-1) == 1 and residual is None and not fp8_out:
        x2, strides = x, (x.stride(0), x.stride(1), x.shape[1])  # no copy of a strided view
    else:
        x2 = _rows(x, "x")
        strides = (x2.stride(0), 0, 1)
    rows = x.numel() // hidden if hidden else 0
    if fp8_out:
        out2 = torch.empty(rows, hidden, dtype=torch.uint8, device=x.device)
        scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    else:
        out2, scale = torch.empty(x.shape, dtype=x.dtype, device=x.device), None
    if residual is not None:
        r2 = _rows(residual.to(x.dtype), "residual")
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        ro2 = residual_out.view(-1, hidden)
    else:
        r2 = ro2 = x2  # unused
        residual_out = None
    if rows:
        out_rows = out2.view(-1, hidden)
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows,)](
            out_rows, out_rows if scale is None else scale, ro2, x2, r2, weight,
            *strides, r2.stride(0), out_rows.stride(0), ro2.stride(0), hidden, eps,
            BLOCK=block, HAS_RESIDUAL=residual is not None, FP8_OUT=fp8_out,
            num_warps=min(16, max(1, block // 256)), **triton_pdl.launch_kwargs(x.device),
        )
    if fp8_out:
        out2 = out2.view(torch.float8_e4m3fn)
    return out2, scale, residual_out


# --------------------------------------------------------------------------------------
# SiLU-and-mul: the gated MLP activation, silu(gate) * up on a fused [gate | up] projection
# --------------------------------------------------------------------------------------


@triton.jit
def _silu_mul(x_ptr, row, stride_x, d, cols, mask):
    """silu(gate) * up at columns cols of one row, rounded to x's dtype."""
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(x_ptr.dtype.element_ty).to(tl.float32)
    return (act * up).to(x_ptr.dtype.element_ty)


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, stride_x, stride_o, d, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    if PDL:  # before any read of an earlier kernel's output, any write (kernels/triton_pdl.py)
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    tl.store(out_ptr + row * stride_o + cols, _silu_mul(x_ptr, row, stride_x, d, cols, mask),
             mask=mask)


@triton.jit
def _silu_and_mul_fp8_kernel(out_ptr, scale_ptr, x_ptr, stride_x, stride_o, d,
                             BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One program per row, quantized as kernels/triton_fp8.quantize_rows would quantize
    the plain kernel's output. ONE_BLOCK (the row fits in BLOCK): one pass, the row held in
    registers; else a pass for the row's max and a second to store, which reads the
    inputs again (a first version did so at every width: as slow as the two kernels it
    replaced)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    if ONE_BLOCK:
        _silu_fp8_row(out_ptr, scale_ptr, x_ptr, row, stride_x, stride_o, d, BLOCK)
    else:
        _silu_fp8_row_in_blocks(out_ptr, scale_ptr, x_ptr, row, stride_x, stride_o, d, BLOCK)


@triton.jit
def _silu_fp8_row(out_ptr, scale_ptr, x_ptr, row, stride_x, stride_o, d, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    v = _silu_mul(x_ptr, row, stride_x, d, cols, cols < d).to(tl.float32)
    scale = triton_fp8.row_scale(tl.max(tl.abs(v), 0))
    tl.store(scale_ptr + row, scale)
    tl.store(out_ptr + row * stride_o + cols, triton_fp8.e4m3_bits(v, scale), mask=cols < d)


@triton.jit
def _silu_fp8_row_in_blocks(out_ptr, scale_ptr, x_ptr, row, stride_x, stride_o, d,
                            BLOCK: tl.constexpr):
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, d, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        v = _silu_mul(x_ptr, row, stride_x, d, cols, cols < d).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    scale = triton_fp8.row_scale(tl.max(amax, 0))
    tl.store(scale_ptr + row, scale)
    for c0 in range(0, d, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        v = _silu_mul(x_ptr, row, stride_x, d, cols, cols < d).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, triton_fp8.e4m3_bits(v, scale),
                 mask=cols < d)


def _gated_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """[..., 2 * d] as 2-D rows, and d."""
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dimension, got shape {tuple(x.shape)}")
    return _rows(x, "x"), x.shape[-1] // 2


def triton_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * d] -> [..., d]: silu(x[..., :d]) * x[..., d:]."""
    x2, d = _gated_rows(x)
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, d)
    if x2.shape[0] and d:
        block = min(1024, triton.next_power_of_2(d))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            out2, x2, x2.stride(0), out2.stride(0), d, BLOCK=block, num_warps=4,
            **triton_pdl.launch_kwargs(x.device),
        )
    return out


# The widest row the FP8 SiLU-and-mul quantizes in one pass, held in registers; wider rows
# take two passes (the row's max, then the quantization) of blocks this wide. Llama-3-8B's
# 14,336 take one pass at the default (102 registers a thread in 16 warps, no spills): the
# FP8 mix measured faster so than with two passes of 4,096 (PAGEDLLM_FP8_ROW_BLOCK=4096,
# gpu-check's sharegpt-fp8-twopass, is the A/B).
FP8_ROW_BLOCK = int(os.environ.get("PAGEDLLM_FP8_ROW_BLOCK", "16384"))
if FP8_ROW_BLOCK not in (1024, 2048, 4096, 8192, 16384):
    raise ValueError("PAGEDLLM_FP8_ROW_BLOCK must be a power of two from 1024 to 16384, "
                     f"got {FP8_ROW_BLOCK}")


def triton_silu_and_mul_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """triton_silu_and_mul with its output quantized per row for an FP8 linear:
    (float8_e4m3fn [rows, d], fp32 scales [rows, 1])."""
    x2, d = _gated_rows(x)
    out = torch.empty(x2.shape[0], d, dtype=torch.uint8, device=x.device)
    scale = torch.empty(x2.shape[0], 1, dtype=torch.float32, device=x.device)
    if x2.shape[0] and d:
        block = min(FP8_ROW_BLOCK, triton.next_power_of_2(d))
        _silu_and_mul_fp8_kernel[(x2.shape[0],)](
            out, scale, x2, x2.stride(0), out.stride(0), d, BLOCK=block, ONE_BLOCK=block >= d,
            num_warps=max(8, block // 1024), **triton_pdl.launch_kwargs(x.device),
        )
    return out.view(torch.float8_e4m3fn), scale


# --------------------------------------------------------------------------------------
# Rotary embedding, neox style (rotate halves), in place on query and key
# --------------------------------------------------------------------------------------


@triton.jit
def rotate_heads(ptr, token, stride_t, stride_h, num_heads, cos, sin, half,
                 HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
                 norm_ptr=None, eps=0.0, NORM: tl.constexpr = False):
    """One token's heads rotated in place. NORM (full rotary: the halves are the whole
    head): each head first RMS-normed with the weight at norm_ptr ([2 * half]), rounded
    where the unfused norm kernel rounds (_rms_norm_kernel)."""
    heads = tl.arange(0, HEADS_PAD)[:, None]
    cols = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < num_heads) & (cols < half)
    first = ptr + token * stride_t + heads * stride_h + cols
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        dtype = ptr.dtype.element_ty
        inv_rms = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * half) + eps)[:, None]
        w1 = tl.load(norm_ptr + cols, mask=cols < half, other=0.0).to(tl.float32)
        w2 = tl.load(norm_ptr + half + cols, mask=cols < half, other=0.0).to(tl.float32)
        x1 = ((x1 * inv_rms).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * inv_rms).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(ptr.dtype.element_ty), mask=mask)
    tl.store(first + half, (x2 * cos + x1 * sin).to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def rotate_token(q_ptr, k_ptr, token, positions_ptr, cos_sin_ptr,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
                 num_heads, num_kv_heads, half,
                 Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
                 q_norm_ptr=None, k_norm_ptr=None, eps=0.0, NORM: tl.constexpr = False):
    """Token `token`'s query and key heads rotated in place at its position (NORM: each
    head RMS-normed first, Qwen3's q_norm and k_norm; see rotate_heads)."""
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cols = tl.arange(0, HALF_PAD)
    cmask = cols < half
    cos = tl.load(cos_sin_ptr + pos * stride_cs + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + half + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    rotate_heads(q_ptr, token, stride_qt, stride_qh, num_heads, cos, sin, half, Q_HEADS_PAD,
                 HALF_PAD, q_norm_ptr, eps, NORM)
    rotate_heads(k_ptr, token, stride_kt, stride_kh, num_kv_heads, cos, sin, half, K_HEADS_PAD,
                 HALF_PAD, k_norm_ptr, eps, NORM)


@triton.jit
def _rotary_neox_kernel(
    q_ptr, k_ptr, positions_ptr, cos_sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    num_heads, num_kv_heads, half,
    Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
):
    rotate_token(q_ptr, k_ptr, tl.program_id(0).to(tl.int64), positions_ptr, cos_sin_ptr,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_cs, num_heads, num_kv_heads,
                 half, Q_HEADS_PAD, K_HEADS_PAD, HALF_PAD)


def triton_rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim]: cos | sin, rotary_dim <= head_dim
) -> None:
    """Neox-style RoPE on the first rotary_dim dims of every head (the rest pass through)."""
    check_rotary_inputs(positions, query, key, cos_sin_cache)
    num_tokens, num_heads, head_dim = query.shape
    if num_tokens == 0:
        return
    half = cos_sin_cache.shape[-1] // 2
    _rotary_neox_kernel[(num_tokens,)](
        query, key, positions, cos_sin_cache,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos_sin_cache.stride(0),
        num_heads, key.shape[1], half,
        Q_HEADS_PAD=triton.next_power_of_2(num_heads),
        K_HEADS_PAD=triton.next_power_of_2(key.shape[1]),
        HALF_PAD=triton.next_power_of_2(half),
        num_warps=4,
    )


def check_rotary_inputs(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                        cos_sin_cache: torch.Tensor) -> None:
    if query.dim() != 3 or key.dim() != 3:
        raise ValueError(
            f"query and key must be [num_tokens, heads, head_dim], got {tuple(query.shape)} and {tuple(key.shape)}"
        )
    num_tokens, num_heads, head_dim = query.shape
    if key.shape[0] != num_tokens or key.shape[2] != head_dim:
        raise ValueError(f"key shape {tuple(key.shape)} does not match query shape {tuple(query.shape)}")
    if tuple(positions.shape) != (num_tokens,):
        raise ValueError(f"positions must have shape ({num_tokens},), got {tuple(positions.shape)}")
    rotary_dim = cos_sin_cache.shape[-1]
    if cos_sin_cache.dim() != 2 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(
            f"cos_sin_cache must be [max_position, rotary_dim] with an even rotary_dim <= head_dim {head_dim}, "
            f"got {tuple(cos_sin_cache.shape)}"
        )
    if query.stride(-1) != 1 or key.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("query, key and cos_sin_cache must be contiguous in their last dimension")
