"""reshape_and_cache in Triton: write this step's keys and values into their cache slots.

One program per token copies the token's K and V rows (all KV heads) into slot
slot_mapping[t] of the paged cache; a slot of -1 (a padding token) is skipped. A variant
applies the rotary embedding to the token's query and key first (one launch instead of
two per layer: ~1.5 us each of a batch-1 decode step's layers), and with it Qwen3's
per-head q and k norms (one launch instead of three).

An FP8 cache (float8_e4m3fn, --kv-cache-dtype fp8) stores K and V with a scale of 1.0,
vLLM's default when a checkpoint carries no KV scales: the values are clamped to E4M3's
range (+-448) and rounded; the attention kernels read them back as they are.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from pagedllm.kernels import triton_pdl
from pagedllm.kernels.triton_ops import check_rotary_inputs, rotate_token


@triton.jit
def _cache_token(key_ptr, value_ptr, cache_ptr, token, slot, stride_kt, stride_kh, stride_vt,
                 stride_vh, stride_c_kv, stride_c_block, stride_c_offset, stride_c_head,
                 block_size, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 HEADS_PAD: tl.constexpr, FP8_MAX: tl.constexpr):
    """Token `token`'s K and V rows (all KV heads) into cache slot `slot` (>= 0); FP8_MAX > 0:
    an FP8 cache, values clamped to +-FP8_MAX first (E4M3 has no infinity)."""
    block = slot // block_size
    offset = slot % block_size
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_DIM)[None, :]
    mask = heads < NUM_KV_HEADS
    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    dst = cache_ptr + block * stride_c_block + offset * stride_c_offset + heads * stride_c_head + dims
    if FP8_MAX > 0:
        k = tl.minimum(tl.maximum(k.to(tl.float32), -FP8_MAX), FP8_MAX)
        v = tl.minimum(tl.maximum(v.to(tl.float32), -FP8_MAX), FP8_MAX)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_c_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_c_kv,  # kv_cache strides: K/V, block, offset in block, head (head_dim is 1)
    stride_c_block, stride_c_offset, stride_c_head, block_size,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        _cache_token(key_ptr, value_ptr, cache_ptr, token, slot, stride_kt, stride_kh,
                     stride_vt, stride_vh, stride_c_kv, stride_c_block, stride_c_offset,
                     stride_c_head, block_size, NUM_KV_HEADS, HEAD_DIM, HEADS_PAD, FP8_MAX)


@triton.jit
def _rotary_and_cache_kernel(
    q_ptr, key_ptr, value_ptr, cache_ptr, slot_mapping_ptr, positions_ptr, cos_sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    stride_c_kv, stride_c_block, stride_c_offset, stride_c_head, block_size, num_heads, half,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr, FP8_MAX: tl.constexpr,
    PDL: tl.constexpr, q_norm_ptr, k_norm_ptr, eps, NORM: tl.constexpr,
):
    """The rotary embedding of one token's query and key (in place; NORM: each head
    RMS-normed first), then its K and V into the cache: triton_ops' norm and rotary kernels
    and the one above in one launch."""
    if PDL:  # before any read of an earlier kernel's output, any write (kernels/triton_pdl.py)
        gdc_wait()
        gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    rotate_token(q_ptr, key_ptr, token, positions_ptr, cos_sin_ptr, stride_qt, stride_qh,
                 stride_kt, stride_kh, stride_cs, num_heads, NUM_KV_HEADS, half, Q_HEADS_PAD,
                 HEADS_PAD, HALF_PAD, q_norm_ptr, k_norm_ptr, eps, NORM)
    tl.debug_barrier()  # the rotated key, stored by other threads, is read back below
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        _cache_token(key_ptr, value_ptr, cache_ptr, token, slot, stride_kt, stride_kh,
                     stride_vt, stride_vh, stride_c_kv, stride_c_block, stride_c_offset,
                     stride_c_head, block_size, NUM_KV_HEADS, HEAD_DIM, HEADS_PAD, FP8_MAX)


FP8_DTYPES = (torch.float8_e4m3fn,)


def fp8_max(kv_cache: torch.Tensor) -> float:
    """E4M3's largest finite value for an FP8 cache; 0.0 (no clamp) for any other dtype."""
    return float(torch.finfo(kv_cache.dtype).max) if kv_cache.dtype in FP8_DTYPES else 0.0


def _check_cache_inputs(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            "kv_cache must have shape [2, num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(kv_cache.shape)}"
        )
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_tokens = key.shape[0]
    expected = (num_tokens, num_kv_heads, head_dim)
    if tuple(key.shape) != expected or tuple(value.shape) != expected:
        raise ValueError(
            f"key and value must have shape {expected} to match kv_cache, "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if tuple(slot_mapping.shape) != (num_tokens,):
        raise ValueError(f"slot_mapping must have shape ({num_tokens},), got {tuple(slot_mapping.shape)}")
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two, got {head_dim}")
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in its last (head_dim) dimension")


def triton_write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens], -1 = skip
) -> None:
    """reshape_and_cache: store each token's K and V in its slot (same contract as the reference)."""
    _check_cache_inputs(key, value, kv_cache, slot_mapping)
    if key.shape[0] == 0:
        return
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    num_kv_heads, head_dim = kv_cache.shape[3:]
    _reshape_and_cache_kernel[(key.shape[0],)](
        key, value, kv_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *kv_cache.stride()[:4], kv_cache.shape[2],
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), FP8_MAX=fp8_max(kv_cache),
    )


def triton_rotary_write_kv_cache(
    positions: torch.Tensor,  # [num_tokens] int
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim]: cos | sin
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> None:
    """triton_rotary_embedding(positions, query, key, cos_sin_cache), then
    triton_write_kv_cache(key, value, kv_cache, slot_mapping), in one kernel. qk_norm
    (q weight [head_dim], k weight, eps): each query and key head RMS-normed before its
    rotation (Qwen3's q_norm and k_norm; full rotary only)."""
    check_rotary_inputs(positions, query, key, cos_sin_cache)
    _check_cache_inputs(key, value, kv_cache, slot_mapping)
    if value.stride(-1) != 1:
        raise ValueError("value must be contiguous in its last dimension")
    num_tokens, num_heads, _ = query.shape
    num_kv_heads, head_dim = kv_cache.shape[3:]
    if qk_norm is not None and (cos_sin_cache.shape[-1] != head_dim or any(
            tuple(w.shape) != (head_dim,) for w in qk_norm[:2])):
        raise ValueError(f"a folded q/k norm takes full rotary ({head_dim} dims) and weights "
                         f"of ({head_dim},), got rotary_dim {cos_sin_cache.shape[-1]} and "
                         f"{[tuple(w.shape) for w in qk_norm[:2]]}")
    if num_tokens == 0:
        return
    half = cos_sin_cache.shape[-1] // 2
    q_norm, k_norm, eps = qk_norm if qk_norm is not None else (query, query, 0.0)
    _rotary_and_cache_kernel[(num_tokens,)](
        query, key, value, kv_cache, slot_mapping, positions, cos_sin_cache,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        value.stride(0), value.stride(1), cos_sin_cache.stride(0),
        *kv_cache.stride()[:4], kv_cache.shape[2], num_heads, half,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        Q_HEADS_PAD=triton.next_power_of_2(num_heads), HALF_PAD=triton.next_power_of_2(half),
        FP8_MAX=fp8_max(kv_cache), num_warps=4, **triton_pdl.launch_kwargs(query.device),
        q_norm_ptr=q_norm, k_norm_ptr=k_norm, eps=eps, NORM=qk_norm is not None,
    )
