"""Pure-torch paged-attention ops: the CPU path, and the oracle for every Triton kernel.

See pagedllm/layers/metadata.py for the cache layout and the meaning of the metadata.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pagedllm.layers.metadata import PagedAttentionInputMetadata


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens], -1 = skip
) -> None:
    """reshape_and_cache: store each token's K and V in its slot."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def gather_kv(kv_cache: torch.Tensor, block_tables: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    """The K and V of every sequence, padded: [2, num_seqs, max_seq_len, kv_heads, head_dim]."""
    _, total_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    num_seqs = block_tables.shape[0]
    num_blocks = math.ceil(max_seq_len / block_size)
    ids = block_tables[:, :num_blocks].reshape(-1).long()
    # index_select on a flat view is several times faster than advanced indexing here.
    kv = kv_cache.view(2, total_blocks, -1).index_select(1, ids)
    kv = kv.view(2, num_seqs, num_blocks * block_size, kv_heads, head_dim)
    return kv[:, :, :max_seq_len]


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi head slopes (Press et al.), as Bloom computes them."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest != num_heads:
        extra_base = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra_base ** (2 * i + 1) for i in range(num_heads - closest)]
    return torch.tensor(slopes, dtype=torch.float32)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,
    meta: PagedAttentionInputMetadata,
    scale: float,
    sliding_window: int | None = None,
    alibi: torch.Tensor | None = None,  # [num_heads] slopes
) -> torch.Tensor:
    """Causal attention of each query token over its sequence's cached context.

    Decoding sequences (one query token) are attended in one batched call; each prefill
    chunk on its own, so a long prompt never pads the decodes to its length.
    """
    out = torch.empty_like(query)
    starts = [0]
    for q_len in meta.query_lens_host:
        starts.append(starts[-1] + q_len)
    decodes = [i for i, q_len in enumerate(meta.query_lens_host) if q_len == 1]
    if decodes:
        rows = torch.tensor([starts[i] for i in decodes], device=query.device)
        out[rows] = _attend(
            query[rows].unsqueeze(1),
            kv_cache,
            meta.block_tables[decodes] if len(decodes) < meta.num_seqs else meta.block_tables,
            [1] * len(decodes),
            [meta.seq_lens_host[i] for i in decodes],
            scale, sliding_window, alibi,
        )[:, 0]
    for i, q_len in enumerate(meta.query_lens_host):
        if q_len > 1:
            s, e = starts[i], starts[i + 1]
            out[s:e] = _attend(
                query[s:e].unsqueeze(0), kv_cache, meta.block_tables[i: i + 1],
                [q_len], [meta.seq_lens_host[i]], scale, sliding_window, alibi,
            )[0]
    return out


def _attend(
    q: torch.Tensor,  # [seqs, max_q, heads, head_dim], the last max_q tokens of each context
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    scale: float,
    sliding_window: int | None,
    alibi: torch.Tensor | None,
) -> torch.Tensor:
    device = q.device
    num_heads = q.shape[2]
    max_q, max_kv = q.shape[1], max(seq_lens)
    k, v = gather_kv(kv_cache, block_tables, max_kv).to(q.dtype)
    q_lens = torch.tensor(query_lens, device=device)
    s_lens = torch.tensor(seq_lens, device=device)
    rows = torch.arange(max_q, device=device)
    q_pos = (s_lens - q_lens)[:, None] + rows[None, :]  # [seqs, max_q]
    k_pos = torch.arange(max_kv, device=device)
    allowed = k_pos[None, None, :] <= q_pos[:, :, None]
    if sliding_window is not None:
        allowed &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    mask = allowed[:, None]  # [seqs, 1, max_q, max_kv]
    if alibi is not None:
        rel = (k_pos[None, None, :] - q_pos[:, :, None]).to(torch.float32)
        bias = alibi.to(device)[None, :, None, None] * rel[:, None]
        mask = bias.masked_fill(~mask, float("-inf")).to(q.dtype)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),  # [seqs, heads, max_q, head_dim]
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        scale=scale,
        enable_gqa=num_heads != k.shape[2],
    )
    return out.transpose(1, 2)
