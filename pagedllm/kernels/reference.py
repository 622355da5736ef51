"""Pure-torch kernels: paged attention, RMSNorm, SiLU-and-mul, the rotary rotation. The path
wherever no faster kernel applies (layers/dispatch.py), and the oracle of the Triton and C
kernels in tests.

See pagedllm/kernels/metadata.py for the cache layout and the meaning of the metadata.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm.kernels.metadata import PagedAttentionInputMetadata


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x), or with a residual (norm(x + residual), x + residual); computed in float32."""
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    normed = x.float()
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * normed.to(dtype)
    return out if residual is None else (out, x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * d] -> [..., d]: silu(gate) * up of a fused [gate | up] projection."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the rotate-half layout: x * cos + rotate_half(x) * sin, with
    rotate_half(x) * sin = [x2, x1] * [-sin, sin] (exactly the same products: negating a
    factor is exact). cos and signed_sin: [T, 1, head_dim], the rows of x's positions."""
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # [x2, x1]
    return x * cos + swapped * signed_sin


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
    kv = kv_cache.view(2 * total_blocks, -1).index_select(
        0, kv_rows(block_tables[:, :num_blocks], total_blocks))
    kv = kv.view(2, num_seqs, num_blocks * block_size, kv_heads, head_dim)
    return kv[:, :, :max_seq_len]


def kv_rows(block_ids: torch.Tensor, total_blocks: int) -> torch.Tensor:
    """Rows of the cache viewed as [2 * total_blocks, block] holding the keys, then the values,
    of these blocks. One index_select along dim 0 of that 2-D view is about twice as fast as
    one along dim 1 of a [2, total_blocks, block] view."""
    ids = block_ids.reshape(-1).long()
    return torch.cat((ids, ids + total_blocks))


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
    key: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_dim], already cached
    value: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each query token over its sequence's cached context.

    Decoding sequences (one query token) are attended in one padded batch; each prompt chunk
    on its own, so a long prompt never pads the decodes to its length. Each sequence reads
    only its own blocks. Given this step's key and value, a prompt without cached context
    attends to them directly instead of reading them back from the cache. The plan of the
    step (the cache rows each batch reads, its mask) is made once and shared by all layers.
    """
    fresh = key is not None and value is not None and key.dtype == kv_cache.dtype
    shape = tuple(kv_cache.shape[1:3])  # total blocks, block size
    groups = meta.step_cache(
        ("attention", shape, sliding_window, alibi is not None, fresh, query.device),
        lambda: plan_attention(meta, *shape, sliding_window, alibi is not None, fresh,
                               query.device),
    )
    if len(groups) == 1 and groups[0].rows is None:  # one batch holding every token in order
        return _attend(groups[0], query, kv_cache, key, value, scale, alibi)[:, 0]
    out = torch.empty_like(query)
    for g in groups:
        if isinstance(g.rows, slice):
            out[g.rows] = _attend(g, query, kv_cache, key, value, scale, alibi)[0]
        else:
            out.index_copy_(0, g.rows, _attend(g, query, kv_cache, key, value, scale, alibi)[:, 0])
    return out


@dataclass
class AttentionGroup:
    """Sequences attended in one padded scaled_dot_product_attention call: several decodes
    (one query token each), or one prompt chunk."""

    rows: torch.Tensor | slice | None  # their query tokens in the step; None: all, in order
    max_kv: int
    kv_rows: torch.Tensor | None  # cache rows to gather (see kv_rows); None: this step's K/V
    mask: torch.Tensor | None  # [seqs, 1, max_q, max_kv] bool; None: all keys, or causal
    rel: torch.Tensor | None  # [seqs, max_q, max_kv] key minus query position, for ALiBi
    causal: bool = False  # a prompt without cached context and without extra masking


def plan_attention(
    meta: PagedAttentionInputMetadata,
    total_blocks: int,
    block_size: int,
    sliding_window: int | None,
    alibi: bool,
    fresh: bool,
    device: torch.device,
) -> list[AttentionGroup]:
    """The attention batches of one step (see paged_attention)."""
    q_lens, s_lens = meta.query_lens_host, meta.seq_lens_host
    cache = (meta.block_tables, total_blocks, block_size)
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    groups = []
    decodes = [i for i, q_len in enumerate(q_lens) if q_len == 1]
    if decodes:
        # One batch: splitting it by context length pads less but costs more than it saves.
        rows = None if len(decodes) == len(q_lens) else torch.tensor(
            [starts[i] for i in decodes], device=device)
        groups.append(_group(cache, decodes, rows, [1] * len(decodes),
                             [s_lens[i] for i in decodes], sliding_window, alibi, device))
    for i, q_len in enumerate(q_lens):
        if q_len > 1:
            rows = slice(starts[i], starts[i + 1])
            if fresh and s_lens[i] == q_len:  # no cached context: this step's K/V is all of it
                groups.append(_group(None, [i], rows, [q_len], [q_len], sliding_window, alibi,
                                     device))
            else:
                groups.append(_group(cache, [i], rows, [q_len], [s_lens[i]], sliding_window,
                                     alibi, device))
    return groups


def _group(
    cache: tuple[torch.Tensor, int, int] | None,  # block tables, total blocks, block size
    seqs: list[int],
    rows: torch.Tensor | slice | None,
    query_lens: list[int],
    seq_lens: list[int],
    sliding_window: int | None,
    alibi: bool,
    device: torch.device,
) -> AttentionGroup:
    """A batch reading its context from the cache, or (cache None) from this step's K/V."""
    max_q, max_kv = max(query_lens), max(seq_lens)
    rows_to_read = None
    if cache is not None:
        block_tables, total_blocks, block_size = cache
        own = _own_blocks(block_tables, seqs, seq_lens, block_size, device)
        rows_to_read = kv_rows(own, total_blocks)
    q_lens = torch.tensor(query_lens, device=device)
    s_lens = torch.tensor(seq_lens, device=device)
    q_pos = (s_lens - q_lens)[:, None] + torch.arange(max_q, device=device)[None, :]
    k_pos = torch.arange(max_kv, device=device)
    allowed = k_pos[None, None, :] <= q_pos[:, :, None]  # [seqs, max_q, max_kv]
    if sliding_window is not None:
        allowed &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    rel = (k_pos[None, None, :] - q_pos[:, :, None]).float() if alibi else None
    causal = cache is None and sliding_window is None and not alibi
    # Decodes of equal context length see every key: no mask (decided on the host, no sync).
    sees_all = max_q == 1 and min(seq_lens) == max_kv and (sliding_window or max_kv) >= max_kv
    mask = None if causal or sees_all else allowed[:, None]
    return AttentionGroup(rows, max_kv, rows_to_read, mask, rel, causal)


def _own_blocks(
    block_tables: torch.Tensor, seqs: list[int], seq_lens: list[int], block_size: int,
    device: torch.device,
) -> torch.Tensor:
    """Block ids [seqs, max_blocks] covering each sequence's context; a shorter sequence is
    padded with its own first block (masked out), so no sequence reads another's blocks."""
    num_blocks = [math.ceil(n / block_size) for n in seq_lens]
    width = max(num_blocks)
    index = torch.tensor(seqs, device=device)
    tables = block_tables.index_select(0, index)[:, :width]
    inside = torch.arange(width, device=device)[None, :] < torch.tensor(num_blocks, device=device)[:, None]
    return torch.where(inside, tables, tables[:, :1])


def _attend(
    g: AttentionGroup,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    scale: float,
    alibi: torch.Tensor | None,
) -> torch.Tensor:
    """[seqs, max_q, heads, head_dim]."""
    if g.rows is None:
        q = query.unsqueeze(1)
    elif isinstance(g.rows, slice):
        q = query[g.rows].unsqueeze(0)
    else:
        q = query.index_select(0, g.rows).unsqueeze(1)
    if g.kv_rows is None:
        k, v = key[g.rows].unsqueeze(0), value[g.rows].unsqueeze(0)
    else:
        k, v = _gather(kv_cache, g.kv_rows, q.shape[0], g.max_kv)
    k, v = k.to(q.dtype), v.to(q.dtype)
    mask = g.mask
    if alibi is not None:
        bias = alibi.to(q.device)[None, :, None, None] * g.rel[:, None]
        if mask is not None:
            bias = bias.masked_fill(~mask, float("-inf"))
        mask = bias.to(q.dtype)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),  # [seqs, heads, max_q, head_dim]
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=g.causal,
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


def _gather(
    kv_cache: torch.Tensor, rows: torch.Tensor, num_seqs: int, max_kv: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [seqs, max_kv, kv_heads, head_dim] from the cache rows of a group."""
    _, total_blocks, _, kv_heads, head_dim = kv_cache.shape
    kv = kv_cache.view(2 * total_blocks, -1).index_select(0, rows)
    kv = kv.view(2, num_seqs, -1, kv_heads, head_dim)[:, :, :max_kv]
    return kv[0], kv[1]
