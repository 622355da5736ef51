"""Top-p by rejection: each row's draw from its top-p set without sorting the row or
searching for its cut.

The top-p set of a row is a prefix of its tokens ordered by z = x / T: token i is in it iff
the mass of the tokens strictly above it, mass(z > z_i), is below top_p of the row's mass
(the smallest prefix of the sorted row reaching top_p; tokens tied at the cut are all kept,
as triton_threshold keeps them).

Rounds (FlashInfer's rejection sampling idea): the race of triton_sampling draws a
candidate from the row restricted to a set S (at first the whole row). One pass checks it:
if it is in the top-p set the row is done; else no token at or below it is in the set, so S
becomes the tokens strictly above it and the race runs again with fresh noise. S always
holds the top-p set, so a candidate that is accepted is distributed as the set's
renormalised probabilities, whatever S was: the draw is exact. A round rejects with
probability mass(S outside the set) / mass(S) <= 1 - top_p, so at top_p 0.95 one row in 400
needs a second round. Rows still undecided after the last round (at most (1 - top_p)^rounds
of them) take the threshold search and one race over the tokens at or above it.

Each pass is a [rows, chunks] grid; a row's last chunk to finish merges the chunks
(triton_counters). Rows that are done exit at once, so later rounds cost a launch and a
read of a few bytes a program. The per-row state: 0 done, 1 a candidate to check,
2 rejected (to draw again above `lo`).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pagedllm.kernels.triton_counters import counters
from pagedllm.kernels.triton_threshold import row_thresholds

CHUNK = 4096
ROUND_OFFSET = 1 << 20  # Philox offsets of round r: r * ROUND_OFFSET + quad (vocab < 4M)
MAX_ROUNDS = 8
DONE, CHECK, REJECTED = 0, 1, 2


@triton.jit
def _check_kernel(x_ptr, inv_temp_ptr, top_p_ptr, state_ptr, cand_ptr, lo_ptr,
                  part_m_ptr, part_t_ptr, part_a_ptr, count_ptr, V, stride,
                  CHUNKS: tl.constexpr, CHUNKS_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """Rows in state CHECK: accept the candidate (DONE) when the mass above its z is below
    top_p of the row's, else REJECTED with lo = its z."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    if tl.load(state_ptr + row) == 1:
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        valid = cols < V
        z = tl.load(x_ptr + row * stride + cols, mask=valid, other=float("-inf")).to(tl.float32)
        z = tl.where(valid, z * tl.load(inv_temp_ptr + row), float("-inf"))
        m = tl.max(z, 0)
        e = tl.where(z == float("-inf"), 0.0, tl.exp(z - tl.where(m == float("-inf"), 0.0, m)))
        cand = tl.load(cand_ptr + row)
        part = row * CHUNKS + chunk
        tl.store(part_m_ptr + part, m)
        tl.store(part_t_ptr + part, tl.sum(e, 0))
        tl.store(part_a_ptr + part, tl.sum(tl.where(z > cand, e, 0.0), 0))
        tl.debug_barrier()
        if tl.atomic_add(count_ptr + row, 1, sem="acq_rel") == CHUNKS - 1:
            c = tl.arange(0, CHUNKS_PAD)
            ok = c < CHUNKS
            base = row * CHUNKS + c
            ms = tl.load(part_m_ptr + base, mask=ok, other=float("-inf"), cache_modifier=".cg")
            ts = tl.load(part_t_ptr + base, mask=ok, other=0.0, cache_modifier=".cg")
            As = tl.load(part_a_ptr + base, mask=ok, other=0.0, cache_modifier=".cg")
            top = tl.max(ms, 0)
            w = tl.where(ms == float("-inf"), 0.0, tl.exp(ms - top))
            total = tl.sum(ts * w, 0)
            above = tl.sum(As * w, 0)
            accept = (above < tl.load(top_p_ptr + row) * total) | (above == 0.0)
            tl.store(state_ptr + row, tl.where(accept, 0, 2))
            tl.store(lo_ptr + row, cand, mask=accept == 0)
            tl.atomic_xchg(count_ptr + row, 0)


@triton.jit
def _race_kernel(x_ptr, inv_temp_ptr, seed_ptr, state_ptr, lo_ptr, token_ptr, cand_ptr,
                 part_r_ptr, part_j_ptr, part_z_ptr, count_ptr, V, stride, offset,
                 CHUNKS: tl.constexpr, CHUNKS_PAD: tl.constexpr, BLOCK: tl.constexpr,
                 FINAL: tl.constexpr):
    """Rows in state REJECTED (FINAL: any row not DONE): the Gumbel race over the tokens
    with z > lo (FINAL: z >= lo, the threshold) -> token, its z as the candidate, state
    CHECK (FINAL: DONE). A row whose race finds no token keeps its state."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    state = tl.load(state_ptr + row)
    todo = state == 2
    if FINAL:
        todo = state != 0
    if todo:
        quad = chunk * (BLOCK // 4) + tl.arange(0, BLOCK // 4)
        lane = tl.arange(0, 4)
        cols = quad[:, None] * 4 + lane[None, :]
        valid = cols < V
        z = tl.load(x_ptr + row * stride + cols, mask=valid, other=float("-inf")).to(tl.float32)
        z = z * tl.load(inv_temp_ptr + row)
        u0, u1, u2, u3 = tl.rand4x(tl.load(seed_ptr + row), quad + offset)
        u = tl.where(lane[None, :] == 0, u0[:, None],
                     tl.where(lane[None, :] == 1, u1[:, None],
                              tl.where(lane[None, :] == 2, u2[:, None], u3[:, None])))
        lo = tl.load(lo_ptr + row)
        if FINAL:
            keep = valid & (z >= lo)
        else:
            keep = valid & (z > lo)
        score = tl.where(keep, z - tl.log(-tl.log(u)), float("-inf"))
        r = tl.max(tl.max(score, 1), 0)
        j = tl.min(tl.min(tl.where(score == r, cols, V), 1), 0)
        j = tl.where(r == float("-inf"), V, j)  # no token of the chunk in the race
        zj = tl.max(tl.max(tl.where(cols == j, z, float("-inf")), 1), 0)
        part = row * CHUNKS + chunk
        tl.store(part_r_ptr + part, r)
        tl.store(part_j_ptr + part, j)
        tl.store(part_z_ptr + part, zj)
        tl.debug_barrier()
        if tl.atomic_add(count_ptr + row, 1, sem="acq_rel") == CHUNKS - 1:
            c = tl.arange(0, CHUNKS_PAD)
            ok = c < CHUNKS
            base = row * CHUNKS + c
            rs = tl.load(part_r_ptr + base, mask=ok, other=float("-inf"), cache_modifier=".cg")
            js = tl.load(part_j_ptr + base, mask=ok, other=V, cache_modifier=".cg")
            zs = tl.load(part_z_ptr + base, mask=ok, other=float("-inf"), cache_modifier=".cg")
            best = tl.min(tl.where(rs == tl.max(rs, 0), c, CHUNKS_PAD), 0)
            drawn = tl.sum(tl.where(c == best, js, 0), 0)
            if drawn < V:
                tl.store(token_ptr + row, drawn.to(tl.int64))
                tl.store(cand_ptr + row, tl.sum(tl.where(c == best, zs, 0.0), 0))
                if FINAL:
                    tl.store(state_ptr + row, 0)
                else:
                    tl.store(state_ptr + row, 1)
            tl.atomic_xchg(count_ptr + row, 0)


def rounds_for(top_p: float, miss: float = 1e-3) -> int:
    """Checks enough that a row is undecided after them with probability <= miss."""
    if top_p >= 1.0:
        return 1
    if top_p <= 0.0:
        return MAX_ROUNDS
    return max(1, min(MAX_ROUNDS, math.ceil(math.log(miss) / math.log1p(-top_p))))


def top_p_by_rejection(x: torch.Tensor, inv_temperature: torch.Tensor, seeds: torch.Tensor,
                       top_p: torch.Tensor, tokens: torch.Tensor, rounds: int,
                       block: int = CHUNK) -> torch.Tensor:
    """x [rows, vocab] logits; per row inv_temperature fp32 (> 0 where top_p < 1), seeds
    int64, top_p fp32 (1: the row is left as it is), tokens int64: a draw from the whole row
    at its temperature (triton_sampling's race with the same seeds), updated in place to a
    draw from the row's top-p set. Returns tokens."""
    rows, vocab = x.shape
    if rows == 0:
        return tokens
    if x.stride(-1) != 1:
        x = x.contiguous()
    if block % 4:
        raise ValueError(f"the chunk must hold whole quads of tokens, got {block}")
    device = x.device
    chunks = triton.cdiv(vocab, block)
    pad = triton.next_power_of_2(chunks)
    state = (top_p < 1.0).to(torch.int32)
    cand = x.gather(1, tokens.view(rows, 1)).view(rows).float() * inv_temperature
    lo = torch.empty_like(cand)
    part = [torch.empty(rows * chunks, dtype=torch.float32, device=device) for _ in range(4)]
    part_j = torch.empty(rows * chunks, dtype=torch.int32, device=device)
    count = counters("top_p_rejection", device, rows)
    grid = (rows, chunks)

    def race(offset: int, final: bool) -> None:
        _race_kernel[grid](x, inv_temperature, seeds, state, lo, tokens, cand, part[0], part_j,
                           part[1], count, vocab, x.stride(0), offset, CHUNKS=chunks,
                           CHUNKS_PAD=pad, BLOCK=block, FINAL=final, num_warps=8)

    for r in range(1, rounds + 1):
        _check_kernel[grid](x, inv_temperature, top_p, state, cand, lo, part[0], part[1],
                            part[2], count, vocab, x.stride(0), CHUNKS=chunks,
                            CHUNKS_PAD=pad, BLOCK=block, num_warps=8)
        if r < rounds:
            race(r * ROUND_OFFSET, final=False)
    # the rows still undecided: their cut by the threshold search, one race above it
    left_p = torch.where(state != 0, top_p, torch.ones_like(top_p))
    lo.copy_(row_thresholds(x, inv_temperature, torch.full_like(state, vocab), left_p,
                            torch.zeros_like(top_p)))
    race(rounds * ROUND_OFFSET, final=True)
    return tokens
