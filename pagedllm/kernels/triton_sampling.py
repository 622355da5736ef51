"""The sampler's per-row passes over the logits on CUDA, in one kernel: the first index of
each row's maximum (greedy's token), the row's logsumexp (every sampled token's logprob)
and, for rows sampled at a temperature, the token of a Gumbel-max race.

torch runs each as its own pass (and the race as five: divide, softmax, exponential noise,
divide, argmax), ~0.6 ms of a 256-row step over a 152k vocabulary, and for few rows reduces
a row in a few blocks (~55 us of a Llama-3-8B batch-1 decode step). Here a row is cut into
chunks, one program each, and the last chunk to finish merges the row's chunks
(triton_counters), in chunk order.

The race: argmax_i (x_i / T + G_i) with G_i = -log(-log U_i) standard Gumbel noise picks
token i with probability softmax(x / T)_i (the exponential race of layers/sampler.py in
log space). U comes from Philox (tl.rand4x) keyed by the row's seed and the token's index, so
a row's draw depends only on its seed, not on the batch around it.

With a threshold per row (kernels/triton_threshold: the top-k / top-p / min-p cut), tokens
whose x / T is below it drop out of the race: the draw is from the renormalised kept
distribution, no sort of the row.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.triton_counters import counters

CHUNK = 4096


@triton.jit
def _row_stats_kernel(logits_ptr, idx_ptr, lse_ptr, token_ptr, inv_temp_ptr, seed_ptr, thr_ptr,
                      part_m_ptr, part_s_ptr, part_i_ptr, part_r_ptr, part_j_ptr, count_ptr,
                      V, stride, CHUNKS: tl.constexpr, CHUNKS_PAD: tl.constexpr,
                      BLOCK: tl.constexpr, RANDOM: tl.constexpr, THRESHOLD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    # The chunk as [BLOCK / 4, 4]: one Philox call gives four uniforms (tl.rand4x), one for
    # each token of a quad, where tl.rand spends a whole call (ten rounds) on each token:
    # the race is bound by arithmetic, not by reading the logits.
    quad = chunk * (BLOCK // 4) + tl.arange(0, BLOCK // 4)
    lane = tl.arange(0, 4)
    cols = quad[:, None] * 4 + lane[None, :]
    v = tl.load(logits_ptr + row * stride + cols, mask=cols < V,
                other=float("-inf")).to(tl.float32)
    m = tl.max(tl.max(v, 1), 0)
    first = tl.min(tl.min(tl.where(v == m, cols, V), 1), 0)
    s = tl.sum(tl.sum(tl.where(v == float("-inf"), 0.0, tl.exp(v - m)), 1), 0)
    # the race (rows at temperature 0, greedy, run it too and ignore it)
    r = m
    j = first
    if RANDOM:
        u0, u1, u2, u3 = tl.rand4x(tl.load(seed_ptr + row), quad)
        u = tl.where(lane[None, :] == 0, u0[:, None],
                     tl.where(lane[None, :] == 1, u1[:, None],
                              tl.where(lane[None, :] == 2, u2[:, None], u3[:, None])))
        z = v * tl.load(inv_temp_ptr + row)
        score = z - tl.log(-tl.log(u))
        keep = cols < V
        if THRESHOLD:
            keep = keep & (z >= tl.load(thr_ptr + row))
        score = tl.where(keep, score, float("-inf"))
        r = tl.max(tl.max(score, 1), 0)
        j = tl.min(tl.min(tl.where(score == r, cols, V), 1), 0)
    if CHUNKS == 1:
        tl.store(idx_ptr + row, first.to(tl.int64))
        tl.store(lse_ptr + row, m + tl.log(s))
        if RANDOM:
            greedy = tl.load(inv_temp_ptr + row) == 0.0
            tl.store(token_ptr + row, tl.where(greedy, first, j).to(tl.int64))
    else:
        part = row * CHUNKS + chunk
        tl.store(part_m_ptr + part, m)
        tl.store(part_s_ptr + part, s)
        tl.store(part_i_ptr + part, first)
        if RANDOM:
            tl.store(part_r_ptr + part, r)
            tl.store(part_j_ptr + part, j)
        tl.debug_barrier()
        done = tl.atomic_add(count_ptr + row, 1, sem="acq_rel")
        if done == CHUNKS - 1:
            c = tl.arange(0, CHUNKS_PAD)
            valid = c < CHUNKS
            base = row * CHUNKS + c
            ms = tl.load(part_m_ptr + base, mask=valid, other=float("-inf"), cache_modifier=".cg")
            ss = tl.load(part_s_ptr + base, mask=valid, other=0.0, cache_modifier=".cg")
            ids = tl.load(part_i_ptr + base, mask=valid, other=V, cache_modifier=".cg")
            top = tl.max(ms, 0)
            # chunks hold increasing columns: the first maximal column is the smallest index
            # among the chunks whose maximum is the row's
            best = tl.min(tl.where(ms == top, ids, V), 0)
            tl.store(idx_ptr + row, best.to(tl.int64))
            total = tl.sum(tl.where(ms == float("-inf"), 0.0, ss * tl.exp(ms - top)), 0)
            tl.store(lse_ptr + row, top + tl.log(total))
            if RANDOM:
                rs = tl.load(part_r_ptr + base, mask=valid, other=float("-inf"),
                             cache_modifier=".cg")
                js = tl.load(part_j_ptr + base, mask=valid, other=V, cache_modifier=".cg")
                drawn = tl.min(tl.where(rs == tl.max(rs, 0), js, V), 0)
                greedy = tl.load(inv_temp_ptr + row) == 0.0
                tl.store(token_ptr + row, tl.where(greedy, best, drawn).to(tl.int64))
            tl.atomic_xchg(count_ptr + row, 0)


def _launch(logits: torch.Tensor, inv_temp: torch.Tensor | None, seeds: torch.Tensor | None,
            block: int, thresholds: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, vocab = logits.shape
    if block % 4:
        raise ValueError(f"the chunk must hold whole quads of tokens, got {block}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    device = logits.device
    idx = torch.empty(rows, dtype=torch.long, device=device)
    lse = torch.empty(rows, 1, dtype=torch.float32, device=device)
    tokens = torch.empty(rows, dtype=torch.long, device=device) if seeds is not None else idx
    if rows == 0:
        return idx, lse, tokens
    chunks = triton.cdiv(vocab, block)
    part_m = torch.empty(rows * chunks, dtype=torch.float32, device=device)
    part_s, part_r = torch.empty_like(part_m), torch.empty_like(part_m)
    part_i = torch.empty(rows * chunks, dtype=torch.int32, device=device)
    part_j = torch.empty_like(part_i)
    random = seeds is not None
    _row_stats_kernel[(rows, chunks)](
        logits, idx, lse, tokens, inv_temp if random else lse, seeds if random else idx,
        thresholds if thresholds is not None else lse,
        part_m, part_s, part_i, part_r, part_j,
        counters("row_stats", device, rows), vocab, logits.stride(0),
        CHUNKS=chunks, CHUNKS_PAD=triton.next_power_of_2(chunks), BLOCK=block, RANDOM=random,
        THRESHOLD=thresholds is not None, num_warps=8,
    )
    return idx, lse, tokens


def row_argmax_logsumexp(logits: torch.Tensor, block: int = CHUNK
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [rows, vocab] -> (first index of each row's maximum [rows] int64, logsumexp
    [rows, 1] fp32): logits.max(-1).indices and logits.float().logsumexp(-1, keepdim=True)."""
    idx, lse, _ = _launch(logits, None, None, block)
    return idx, lse


def sample_rows(logits: torch.Tensor, inv_temperature: torch.Tensor, seeds: torch.Tensor,
                block: int = CHUNK, thresholds: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [rows, vocab], inv_temperature [rows] fp32 (0: greedy), seeds [rows] int64,
    thresholds [rows] fp32 on logits / T or None -> (tokens [rows]: a draw from
    softmax(logits / T) over the tokens at or above the row's threshold, the argmax where
    1/T is 0; the argmax [rows]; logsumexp [rows, 1] of the logits, uncut)."""
    idx, lse, tokens = _launch(logits, inv_temperature, seeds, block, thresholds)
    return tokens, idx, lse
