"""reshape_and_cache in Triton: write this step's keys and values into their cache slots.

One program per token copies the token's K and V rows (all KV heads) into slot
slot_mapping[t] of the paged cache; a slot of -1 (a padding token) is skipped.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_c_kv,  # kv_cache strides: K/V, block, offset in block, head (head_dim is 1)
    stride_c_block,
    stride_c_offset,
    stride_c_head,
    block_size,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // block_size
    offset = slot % block_size

    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_DIM)[None, :]
    mask = heads < NUM_KV_HEADS
    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)

    dst = cache_ptr + block * stride_c_block + offset * stride_c_offset + heads * stride_c_head + dims
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_c_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def triton_write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens], -1 = skip
) -> None:
    """reshape_and_cache: store each token's K and V in its slot (same contract as the reference)."""
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
    if num_tokens == 0:
        return
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()

    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_size,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
    )
