"""C kernels for the CPU (built by build.py): the KV cache write, decode attention read
straight from the paged cache, RMSNorm with the residual add, rotary embedding in place, and
the gated MLP activation. fp32 only.

The pure-torch code (kernels/reference.py) stays the oracle in tests and the path wherever
these do not apply (layers/dispatch.py chooses): other dtypes, no C compiler,
PAGEDLLM_CPU_KERNELS=0.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from pagedllm.kernels.cpu.build import load_library
from pagedllm.kernels.metadata import PagedAttentionInputMetadata

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p

_SIGNATURES = {
    "paged_attention_decode_f32":
        [_ptr] * 5 + [_i64, _ptr] + [_i64] * 5 + [_f32, _i64, _ptr, _i64, _i64],
    "write_kv_cache_f32": [_ptr, _ptr, _ptr, _i64, _ptr, _i64, _ptr, _i64, _i64],
    "rms_norm_f32": [_ptr] * 5 + [_i64, _i64, _f32, _i64],
    "silu_and_mul_f32": [_ptr, _ptr, _i64, _i64, _i64],
    "rotary_embedding_f32": [_ptr, _i64, _ptr, _i64] + [_ptr] * 3 + [_i64] * 5,
    "row_argmax_logsumexp_f32": [_ptr, _i64, _i64, _i64, _ptr, _ptr, _i64],
}


@functools.cache
def _kernel(name: str):
    lib = load_library()
    if lib is None:
        return None
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = _SIGNATURES[name], None
    return fn


def available() -> bool:
    """The library is built (or was already): the C kernels can run."""
    return load_library() is not None


def _ptr_or_none(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


def rows_contiguous(*tensors: torch.Tensor) -> bool:
    """Each [T, heads, head_dim] has its heads back to back within each token (a token's row
    may be a slice of a wider one, as q, k and v are of the fused qkv projection)."""
    return all(x.dim() == 3 and x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]
               for x in tensors)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """What reference.write_kv_cache does: each token's K and V into its slot (-1: skip)."""
    if not (rows_contiguous(key, value) and kv_cache.is_contiguous()):
        raise ValueError("write_kv_cache needs each token's heads contiguous and a contiguous cache")
    slots = slot_mapping.contiguous()
    row = key.shape[1] * key.shape[2]
    _kernel("write_kv_cache_f32")(
        kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), key.data_ptr(), key.stride(0),
        value.data_ptr(), value.stride(0), slots.data_ptr(), key.shape[0], row,
    )


def row_argmax_logsumexp(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [rows, vocab] fp32 -> (first index of each row's maximum [rows] int64,
    logsumexp [rows, 1] fp32): logits.max(-1).indices and logits.logsumexp(-1, keepdim=True)
    in one call (sampling.c), as kernels/triton_sampling.py's of the same name on CUDA."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ValueError("row_argmax_logsumexp takes fp32 [rows, vocab] rows, contiguous")
    rows, vocab = logits.shape
    if vocab == 0:
        raise ValueError("row_argmax_logsumexp takes a non-empty vocabulary")
    idx = torch.empty(rows, dtype=torch.int64)
    lse = torch.empty(rows, 1)
    _kernel("row_argmax_logsumexp_f32")(logits.data_ptr(), rows, vocab, logits.stride(0),
                                        idx.data_ptr(), lse.data_ptr(),
                                        torch.get_num_threads())
    return idx, lse


def is_decode_step(query: torch.Tensor, meta: PagedAttentionInputMetadata) -> bool:
    """Every sequence of the step has exactly one query token."""
    return meta.is_decode_only and query.shape[0] == meta.num_seqs


def paged_attention_decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim], one token per sequence
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    meta: PagedAttentionInputMetadata,
    scale: float,
    sliding_window: int | None = None,
    alibi: torch.Tensor | None = None,  # [num_heads] slopes
) -> torch.Tensor:
    """What reference.paged_attention computes for a decode-only step."""
    if not is_decode_step(query, meta):
        raise ValueError("paged_attention_decode takes decode-only steps (one query per sequence)")
    query, kv_cache = query.contiguous(), kv_cache.contiguous()
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_seqs, num_heads, _ = query.shape
    tables, seq_lens = meta.block_tables.contiguous(), meta.seq_lens.contiguous()
    alibi = alibi.float().contiguous() if alibi is not None else None
    out = torch.empty_like(query)
    _kernel("paged_attention_decode_f32")(
        out.data_ptr(), query.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
        tables.data_ptr(), tables.shape[1], seq_lens.data_ptr(), num_seqs, num_heads,
        num_kv_heads, head_dim, block_size, scale, sliding_window or 0, _ptr_or_none(alibi),
        meta.max_seq_len, torch.get_num_threads(),
    )
    return out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm.forward: norm(x), or (norm(x + residual), x + residual)."""
    x, weight = x.contiguous(), weight.contiguous()
    dim = x.shape[-1]
    out = torch.empty_like(x)
    residual_out = None
    if residual is not None:
        residual = residual.contiguous()
        residual_out = torch.empty_like(x)
    _kernel("rms_norm_f32")(
        out.data_ptr(), _ptr_or_none(residual_out), x.data_ptr(), _ptr_or_none(residual),
        weight.data_ptr(), x.numel() // dim if dim else 0, dim, eps, torch.get_num_threads(),
    )
    return out if residual is None else (out, residual_out)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * d] -> [..., d]: silu(gate) * up of a fused [gate | up] projection."""
    x = x.contiguous()
    dim = x.shape[-1] // 2
    out = x.new_empty(*x.shape[:-1], dim)
    _kernel("silu_and_mul_f32")(out.data_ptr(), x.data_ptr(), x.numel() // (2 * dim) if dim else 0,
                                dim, torch.get_num_threads())
    return out


def rotary_embedding_(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, heads, head_dim], heads contiguous within a token
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    cos: torch.Tensor,  # [max_position, head_dim]
    sin: torch.Tensor,
) -> None:
    """Rotate q and k in place (rotate-half layout)."""
    if not rows_contiguous(q, k):
        raise ValueError("rotary_embedding_ needs each token's heads contiguous")
    positions = positions.contiguous()
    _kernel("rotary_embedding_f32")(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), positions.data_ptr(),
        cos.data_ptr(), sin.data_ptr(), q.shape[0], q.shape[1], k.shape[1], q.shape[2],
        torch.get_num_threads(),
    )
