"""Each row's top-k / top-p / min-p cut as one threshold, found without sorting the row.

The cut keeps the tokens whose scaled logit z = x / T is at least the row's threshold:
  top-k: the k-th largest z;
  top-p: the largest z whose set {z' >= z} holds at least top_p of the (top-k) mass, the
         smallest prefix of the sorted row reaching top_p, as the sort-based path keeps;
  min-p: z_max + log(min_p), i.e. p >= min_p * p_max (a ratio, independent of the
         renormalisation after top-k and top-p, so it intersects with them).
The threshold is the largest of the three. The draw (triton_sampling) masks z below it.

Pivot search (FlashInfer's sort-free top-k/top-p idea): both predicates, count(z >= t) >= k
and mass(z >= t) >= target, are true for small t and false past the threshold. One pass over
the row tests PIVOTS evenly spaced pivots between lo (true) and hi at once, with per pivot:
the count and mass of z >= pivot, the smallest z >= pivot and the largest z < pivot. The last
true pivot's smallest value becomes lo (a row value, still true: the same set), the next
pivot's largest value below it becomes hi, so the interval [lo, hi] always holds the
threshold and shrinks to one value. A row is one program with a tile loop; a pass reads the
row once. Ties at the threshold keep every tied token (a sort keeps some of them).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 512
PIVOTS = 16
MAX_PASSES = 12  # per search; a row of distinct values converges in a few


@triton.jit
def _pivot_pass(row_ptr, V, inv_t, m, lo, hi, BLOCK: tl.constexpr, PIVOTS: tl.constexpr):
    """Per pivot between lo and hi: count and mass (exp(z - m)) of z >= pivot, the smallest
    z >= pivot, the largest z < pivot."""
    j = tl.arange(0, PIVOTS)
    piv = lo + (hi - lo) * (j.to(tl.float32) / (PIVOTS - 1))
    piv = tl.where(j == PIVOTS - 1, hi, tl.where(j == 0, lo, piv))
    count = tl.zeros([PIVOTS], dtype=tl.int32)
    mass = tl.zeros([PIVOTS], dtype=tl.float32)
    above = tl.full([PIVOTS], float("inf"), dtype=tl.float32)
    below = tl.full([PIVOTS], float("-inf"), dtype=tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * inv_t
        z = tl.where(cols < V, z, float("-inf"))
        e = tl.exp(z - m)
        ge = z[None, :] >= piv[:, None]
        count += tl.sum(ge.to(tl.int32), 1)
        mass += tl.sum(tl.where(ge, e[None, :], 0.0), 1)
        above = tl.minimum(above, tl.min(tl.where(ge, z[None, :], float("inf")), 1))
        below = tl.maximum(below, tl.max(tl.where(ge, float("-inf"), z[None, :]), 1))
    return j, count, mass, above, below


@triton.jit
def _pick(j, values, at):
    return tl.sum(tl.where(j == at, values, 0), 0)


@triton.jit
def _search(row_ptr, V, inv_t, m, lo, hi, lo_mass, need_count, need_mass,
            BLOCK: tl.constexpr, PIVOTS: tl.constexpr, MAX_PASSES: tl.constexpr):
    """The largest row value t with count(z >= t) >= need_count and mass(z >= t) >=
    need_mass, given lo (true) <= t <= hi. Returns (t, mass(z >= t)); after MAX_PASSES
    without converging, the lower end (a few more tokens kept)."""
    passes = 0
    while (lo < hi) & (passes < MAX_PASSES):
        j, count, mass, above, below = _pivot_pass(row_ptr, V, inv_t, m, lo, hi, BLOCK, PIVOTS)
        ok = (count >= need_count) & (mass >= need_mass)
        last = tl.maximum(tl.max(tl.where(ok, j, -1), 0), 0)
        new_lo = _pick(j, above, last)
        lo_mass = _pick(j, mass, last)
        # the next pivot fails: the threshold is below it, at most its largest value below
        new_hi = tl.where(last == PIVOTS - 1, new_lo, _pick(j, below, last + 1))
        lo = new_lo
        hi = tl.maximum(new_hi, new_lo)
        passes += 1
    return lo, lo_mass


@triton.jit
def _row_threshold_kernel(x_ptr, thr_ptr, inv_temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
                          V, stride, BLOCK: tl.constexpr, PIVOTS: tl.constexpr,
                          MAX_PASSES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = x_ptr + row * stride
    inv_t = tl.load(inv_temp_ptr + row)
    k = tl.load(top_k_ptr + row)
    p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    thr = float("-inf")
    if (inv_t > 0.0) & ((k < V) | (p < 1.0) | (min_p > 0.0)):
        # pass 1: the row's largest and smallest z and its mass relative to the largest
        m_acc = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
        lo_acc = tl.full([BLOCK], float("inf"), dtype=tl.float32)
        s_acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            z = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * inv_t
            z = tl.where(cols < V, z, float("-inf"))
            new_m = tl.maximum(m_acc, z)
            s_acc = s_acc * tl.exp(m_acc - new_m) + tl.where(z == float("-inf"), 0.0,
                                                            tl.exp(z - new_m))
            s_acc = tl.where(new_m == float("-inf"), 0.0, s_acc)
            m_acc = new_m
            lo_acc = tl.minimum(lo_acc, tl.where(z == float("-inf"), float("inf"), z))
        m = tl.max(m_acc, 0)
        total = tl.sum(tl.where(m_acc == float("-inf"), 0.0, s_acc * tl.exp(m_acc - m)), 0)
        lo = tl.min(lo_acc, 0)  # the smallest finite z: both predicates hold there
        if k < V:
            lo, total = _search(row_ptr, V, inv_t, m, lo, m, total, k, 0.0,
                                BLOCK, PIVOTS, MAX_PASSES)
        if p < 1.0:
            lo, total = _search(row_ptr, V, inv_t, m, lo, m, total, 0, p * total,
                                BLOCK, PIVOTS, MAX_PASSES)
        thr = lo
        if (k >= V) & (p >= 1.0):
            thr = float("-inf")
        if min_p > 0.0:
            thr = tl.maximum(thr, m + tl.log(min_p))
    tl.store(thr_ptr + row, thr)


def row_thresholds(x: torch.Tensor, inv_temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor, min_p: torch.Tensor, block: int = BLOCK,
                   pivots: int = PIVOTS) -> torch.Tensor:
    """x [rows, vocab] (fp32 logits), per row: inv_temperature fp32 (0: greedy, no cut),
    top_k int32 (>= vocab: off), top_p fp32 (1: off), min_p fp32 (0: off) -> [rows] fp32
    thresholds on x * inv_temperature (-inf: nothing cut)."""
    rows, vocab = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    thr = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        _row_threshold_kernel[(rows,)](
            x, thr, inv_temperature, top_k, top_p, min_p, vocab, x.stride(0),
            BLOCK=block, PIVOTS=pivots, MAX_PASSES=MAX_PASSES, num_warps=8,
        )
    return thr
