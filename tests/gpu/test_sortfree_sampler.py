"""The sort-free samplers (PAGEDLLM_SAMPLER=sortfree, =rejection) compiled on CUDA at
Llama-3's vocabulary: each row's threshold keeps what the sort path keeps, seeded draws
follow the renormalised cut distribution (chi-square over 20,000 draws in one call), greedy
rows give the argmax."""
from __future__ import annotations

import math

import pytest
import torch

from pagedllm.kernels.triton_sampling import sample_rows
from pagedllm.kernels.triton_threshold import row_thresholds
from pagedllm.kernels.triton_top_p import rounds_for, top_p_by_rejection
from pagedllm.layers.sampler import _random_probs
from pagedllm.sampling_params import SamplingParams

pytestmark = pytest.mark.cuda

CUTS = [dict(top_p=0.95), dict(top_p=0.5), dict(top_k=50), dict(min_p=0.05),
        dict(top_k=1000, top_p=0.9, min_p=0.01), dict(top_k=1)]


def tensors(params: list[SamplingParams], vocab: int):
    inv = torch.tensor([0.0 if p.temperature == 0 else 1 / p.temperature for p in params])
    k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params],
                     dtype=torch.int32)
    top_p = torch.tensor([p.top_p for p in params])
    min_p = torch.tensor([p.min_p for p in params])
    return [t.cuda() for t in (inv, k, top_p, min_p)]


@pytest.mark.parametrize("scale", [1.0, 4.0])  # flat rows (a cut deep in the bulk), peaked
def test_thresholds_match_the_sort_at_llama3_vocab(scale):
    vocab = 128256
    params = [SamplingParams(temperature=t, **c) for t in (0.8, 1.2) for c in CUTS]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(len(params), vocab, device="cuda", generator=g) * scale
    thr = row_thresholds(x, *tensors(params, vocab))
    mismatched = []
    for i, p in enumerate(params):
        want = _random_probs(x[i:i + 1], [p])[0] > 0
        got = x[i] / p.temperature >= thr[i]
        if not torch.equal(got, want):
            mismatched.append((i, int(got.sum()), int(want.sum())))
    print(f"scale {scale}: {len(params) - len(mismatched)}/{len(params)} rows keep exactly the "
          f"sort's tokens; differing (row, kept, sort kept): {mismatched}", flush=True)
    # summation order may move a top-p boundary by one token; never more
    assert all(abs(a - b) <= 1 for _, a, b in mismatched) and len(mismatched) <= 2


def test_sortfree_draws_chi_square_and_greedy_rows():
    vocab, per = 4096, 5000
    params = [SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=1.0, top_k=8),
              SamplingParams(temperature=1.0, top_k=40, top_p=0.8, min_p=0.05),
              SamplingParams(temperature=0.7, min_p=0.2)]
    g = torch.Generator(device="cuda").manual_seed(1)
    base = torch.randn(len(params), vocab, device="cuda", generator=g) * 3
    inv, k, top_p, min_p = tensors(params, vocab)
    thr = row_thresholds(base, inv, k, top_p, min_p)
    n = len(params) * per
    logits = base.repeat_interleave(per, 0)
    seeds = torch.randint(0, 1 << 62, (n,), device="cuda", generator=g)
    inv_rows = inv.repeat_interleave(per)
    inv_rows[::1000] = 0.0  # some greedy rows among them
    tokens, argmax, _ = sample_rows(logits, inv_rows, seeds, thresholds=thr.repeat_interleave(per))
    assert torch.equal(tokens[::1000], argmax[::1000])
    assert torch.equal(argmax[::1000], logits[::1000].argmax(-1))
    keep = torch.ones(n, dtype=torch.bool, device="cuda")
    keep[::1000] = False
    tokens = tokens.view(len(params), per)
    keep = keep.view(len(params), per)
    for i, p in enumerate(params):
        probs = _random_probs(base[i:i + 1], [p])[0].double()
        probs /= probs.sum()
        counts = torch.bincount(tokens[i][keep[i]], minlength=vocab).double()
        kept = probs > 0
        assert counts[~kept].sum() == 0
        expected = probs[kept] * counts.sum()
        observed = counts[kept]
        small = expected < 5  # pooled into one bin: chi-square needs expected counts >= 5
        if small.any():
            expected = torch.cat([expected[~small], expected[small].sum()[None]])
            observed = torch.cat([observed[~small], observed[small].sum()[None]])
        stat = ((observed - expected) ** 2 / expected).sum().item()
        df = len(expected) - 1
        critical = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3
        print(f"{p.top_k=} {p.top_p=} {p.min_p=}: {df + 1} tokens kept, chi-square {stat:.1f} "
              f"< {critical:.1f}", flush=True)
        assert stat < critical


def chi_square_pooled(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[float, float, int]:
    """(statistic, 0.001 critical value, tokens kept) of the draws against probs, the bins
    expecting fewer than 5 draws pooled into one."""
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    kept = probs > 0
    assert counts[~kept].sum() == 0, "a token outside the cut was drawn"
    expected = probs[kept] * len(tokens)
    observed = counts[kept]
    small = expected < 5
    if small.any():
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
        observed = torch.cat([observed[~small], observed[small].sum()[None]])
    stat = ((observed - expected) ** 2 / expected).sum().item()
    df = len(expected) - 1
    return stat, df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3, int(kept.sum())


@pytest.mark.parametrize("vocab, scale", [(4096, 3.0), (128256, 4.0)])
def test_rejection_draws_chi_square(vocab, scale):
    """Top-p by rejection: 5,000 seeded draws a cut, chi-square against the sort path, with
    the rounds the sampler picks and with one round (the threshold fallback deciding)."""
    per = 5000
    params = [SamplingParams(temperature=0.8, top_p=0.95), SamplingParams(temperature=1.0,
                                                                          top_p=0.5)]
    g = torch.Generator(device="cuda").manual_seed(2)
    base = torch.randn(len(params), vocab, device="cuda", generator=g) * scale
    inv, _, top_p, _ = tensors(params, vocab)
    logits = base.repeat_interleave(per, 0)
    inv_rows, p_rows = inv.repeat_interleave(per), top_p.repeat_interleave(per)
    for rounds in (rounds_for(0.5), 1):
        seeds = torch.randint(0, 1 << 62, (len(params) * per,), device="cuda", generator=g)
        first, _, _ = sample_rows(logits, inv_rows, seeds)
        tokens = top_p_by_rejection(logits, inv_rows, seeds, p_rows, first, rounds)
        for i, p in enumerate(params):
            probs = _random_probs(base[i:i + 1], [p])[0].double()
            probs /= probs.sum()
            stat, critical, kept = chi_square_pooled(tokens.view(len(params), per)[i], probs)
            print(f"vocab {vocab} rounds {rounds} top_p {p.top_p}: {kept} tokens kept, "
                  f"chi-square {stat:.1f} < {critical:.1f}", flush=True)
            assert stat < critical
