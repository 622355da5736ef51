"""The sort-free samplers. PAGEDLLM_SAMPLER=sortfree: each row's top-k / top-p / min-p cut as
a threshold found by pivot search (kernels/triton_threshold.py), then the Gumbel race over
the tokens at or above it (kernels/triton_sampling.py). =rejection: rows with top-p alone
drawn by rejection rounds (kernels/triton_top_p.py). Against the sort-based path of
layers/sampler.py, in Triton's interpreter on CPU tensors (small vocabularies: the
interpreter runs a program in tens of milliseconds)."""
from __future__ import annotations

import math

import pytest
import torch

from tests.triton_setup import DEVICE, skip_unless_runnable

from pagedllm.kernels import triton_threshold  # noqa: E402
from pagedllm.kernels.triton_sampling import sample_rows  # noqa: E402
from pagedllm.kernels.triton_threshold import row_thresholds  # noqa: E402
from pagedllm.kernels.triton_top_p import rounds_for, top_p_by_rejection  # noqa: E402
from pagedllm.layers.sampler import (  # noqa: E402
    SamplingRow,
    _random_probs,
    _sample_with_triton,
    make_generator,
    sampler_kind,
)
from pagedllm.sampling_params import SamplingParams  # noqa: E402

skip_unless_runnable(triton_threshold._row_threshold_kernel)

PARAMS = [
    SamplingParams(temperature=0.8, top_p=0.95),
    SamplingParams(temperature=1.0, top_p=0.5),
    SamplingParams(temperature=1.0, top_k=7),
    SamplingParams(temperature=0.7, min_p=0.1),
    SamplingParams(temperature=1.3, top_k=40, top_p=0.8, min_p=0.02),
    SamplingParams(temperature=0.5, top_k=1),
    SamplingParams(temperature=1.0, top_p=1e-9),  # the top token alone, as greedy
    SamplingParams(temperature=1.0),  # no cut
    SamplingParams(temperature=0.0, top_p=0.5),  # greedy: no cut either
]


def inputs(params: list[SamplingParams], x: torch.Tensor):
    vocab = x.shape[1]
    inv_temp = torch.tensor([0.0 if p.temperature == 0 else 1 / p.temperature for p in params])
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params],
                         dtype=torch.int32)
    top_p = torch.tensor([p.top_p for p in params])
    min_p = torch.tensor([p.min_p for p in params])
    return [t.to(DEVICE) for t in (inv_temp, top_k, top_p, min_p)]


def kept_by_sort(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The tokens the sort-based path can draw: nonzero probability after its cut."""
    return _random_probs(x[None].cpu(), [p])[0] > 0


@pytest.mark.parametrize("vocab, scale, block", [(64, 1.0, 16), (200, 3.0, 64), (150, 0.3, 512)])
def test_threshold_keeps_what_the_sort_keeps(vocab, scale, block):
    """Several tiles, one tile, flat and peaked rows: the tokens at or above each row's
    threshold are exactly the sort's cut (top-k, top-p over the top-k, min-p)."""
    g = torch.Generator().manual_seed(vocab)
    x = (torch.randn(len(PARAMS), vocab, generator=g) * scale).to(DEVICE)
    x[0, :5] = float("-inf")  # masked tokens (a logit_bias, min_tokens) stay out
    inv_temp, top_k, top_p, min_p = inputs(PARAMS, x)
    thr = row_thresholds(x, inv_temp, top_k, top_p, min_p, block=block).cpu()
    for i, p in enumerate(PARAMS):
        if p.temperature == 0 or (p.top_k <= 0 and p.top_p >= 1 and p.min_p <= 0):
            assert thr[i] == float("-inf"), (i, thr[i])
            continue
        z = x[i].cpu() * inv_temp[i].cpu()
        kept = z >= thr[i]
        assert torch.equal(kept, kept_by_sort(x[i], p)), (i, p, kept.sum(), thr[i])
        assert thr[i] <= z[kept].min()
        if p.min_p == 0:
            assert thr[i] == z[kept].min()  # a row value: the last one kept
    assert (x[0].cpu() * inv_temp[0].cpu() >= thr[0])[:5].sum() == 0


def test_top_k_ties_keep_every_tied_token():
    """A sort keeps k of tied tokens in some order; the threshold keeps all of them."""
    x = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0]]).to(DEVICE)
    params = [SamplingParams(temperature=1.0, top_k=2)]
    thr = row_thresholds(x, *inputs(params, x), block=4)
    assert thr.item() == 2.0


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """The upper 0.001 point of chi-square(df) (z = 3.09), Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_draws_follow_the_renormalised_cut_distribution():
    """Seeded draws, one per row of repeated logits, three cuts in one call: no token below
    a cut is ever drawn and the counts pass a chi-square test (p = 0.001) against the sort
    path's renormalised probabilities. (A fixed seed set: not flaky.)"""
    vocab, per = 48, 200
    g = torch.Generator().manual_seed(11)
    base = torch.randn(3, vocab, generator=g) * 1.5
    params = [SamplingParams(temperature=0.8, top_p=0.9),
              SamplingParams(temperature=1.2, top_k=6),
              SamplingParams(temperature=1.0, top_k=20, top_p=0.85, min_p=0.1)]
    inv_temp, top_k, top_p, min_p = inputs(params, base)
    thr = row_thresholds(base.to(DEVICE), inv_temp, top_k, top_p, min_p, block=16)
    logits = base.repeat_interleave(per, 0).to(DEVICE)
    seeds = torch.randint(0, 1 << 62, (3 * per,), generator=g).to(DEVICE)
    tokens, _, _ = sample_rows(logits, inv_temp.repeat_interleave(per), seeds, block=64,
                               thresholds=thr.repeat_interleave(per))
    tokens = tokens.cpu().view(3, per)
    for i, p in enumerate(params):
        probs = _random_probs(base[i:i + 1], [p])[0].double()
        probs /= probs.sum()
        counts = torch.bincount(tokens[i], minlength=vocab).double()
        kept = probs > 0
        assert counts[~kept].sum() == 0, (i, counts[~kept].nonzero())
        assert kept.sum() >= 3  # a cut that leaves a distribution to test
        expected = probs[kept] * per
        stat = ((counts[kept] - expected) ** 2 / expected).sum().item()
        assert stat < chi_square_critical(int(kept.sum()) - 1), (i, stat, counts[kept], expected)


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """(statistic, its 0.001 critical value) of the draws against probs (kept tokens)."""
    kept = probs > 0
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    assert counts[~kept].sum() == 0, counts[~kept].nonzero()
    expected = probs[kept] * len(tokens)
    stat = ((counts[kept] - expected) ** 2 / expected).sum().item()
    return stat, chi_square_critical(int(kept.sum()) - 1)


@pytest.mark.parametrize("rounds", [3, 1])  # 1: many rows end in the threshold fallback
def test_rejection_draws_follow_the_top_p_distribution(rounds):
    """Seeded draws by rejection, rows of repeated logits in three chunks each: no token
    outside the top-p set and a chi-square test (p = 0.001) against the sort path's
    renormalised probabilities, both when the rounds decide and when the fallback does."""
    vocab, per = 40, 160
    g = torch.Generator().manual_seed(11)
    base = torch.randn(2, vocab, generator=g)
    params = [SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=1.0,
                                                                        top_p=0.4)]
    inv_temp, _, top_p, _ = inputs(params, base)
    logits = base.repeat_interleave(per, 0).to(DEVICE)
    inv_rows, p_rows = inv_temp.repeat_interleave(per), top_p.repeat_interleave(per)
    seeds = torch.randint(0, 1 << 62, (2 * per,), generator=g).to(DEVICE)
    first, _, _ = sample_rows(logits, inv_rows, seeds, block=16)
    tokens = top_p_by_rejection(logits, inv_rows, seeds, p_rows, first.clone(), rounds,
                                block=16).cpu().view(2, per)
    for i, p in enumerate(params):
        probs = _random_probs(base[i:i + 1], [p])[0].double()
        probs /= probs.sum()
        assert (probs > 0).sum() >= 3
        stat, critical = chi_square(tokens[i], probs)
        assert stat < critical, (i, stat, critical)
    # the whole-row draws had tokens outside the sets: the rounds replaced them
    outside = [(_random_probs(base[i:i + 1], [p])[0] == 0)[first.cpu().view(2, per)[i]].sum()
               for i, p in enumerate(params)]
    assert sum(outside) > 0


def test_rejection_leaves_rows_without_top_p_alone():
    x = torch.randn(3, 30, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    tokens = torch.tensor([4, 7, 9]).to(DEVICE)
    top_p = torch.tensor([1.0, 1.0, 1.0]).to(DEVICE)
    inv = torch.tensor([1.0, 0.0, 2.0]).to(DEVICE)
    seeds = torch.tensor([1, 2, 3]).to(DEVICE)
    out = top_p_by_rejection(x, inv, seeds, top_p, tokens, rounds=2, block=16)
    assert out.cpu().tolist() == [4, 7, 9]


def test_rounds_for_bounds_the_undecided_rows():
    assert rounds_for(1.0) == 1
    assert rounds_for(0.95) == 3  # 0.05^3 = 1.25e-4 <= 1e-3 < 0.05^2
    assert rounds_for(0.9) == 3
    assert rounds_for(0.5) == 8  # 0.5^10 would be needed: capped
    assert rounds_for(1e-9) == 8


def sampling_rows(params: list[SamplingParams]) -> list[SamplingRow]:
    return [SamplingRow(p, [1], [], generator=make_generator(p.seed, DEVICE) if p.seed else None)
            for p in params]


def test_sampler_sortfree_path_greedy_rows_and_fallback():
    """_sample_with_triton(kind="sortfree"): greedy rows give the argmax, cut rows a token
    inside their cut (the same token again for the same seeds), the logsumexp from the raw
    logits; best_of > 1 still goes to torch's path."""
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(4, 100, generator=g) * 2).to(DEVICE)
    params = [SamplingParams(temperature=0.0, top_p=0.5),
              SamplingParams(temperature=0.8, top_p=0.6, seed=3),
              SamplingParams(temperature=1.0, top_k=3, seed=4),
              SamplingParams(temperature=0.0)]
    tokens, lse = _sample_with_triton(logits, logits, sampling_rows(params), kind="sortfree")
    tokens = tokens.cpu()
    assert tokens[0] == logits[0].argmax().item() and tokens[3] == logits[3].argmax().item()
    for i in (1, 2):
        assert kept_by_sort(logits[i], params[i])[tokens[i]]
    torch.testing.assert_close(lse.cpu(), logits.cpu().logsumexp(-1, keepdim=True))
    again, _ = _sample_with_triton(logits, logits, sampling_rows(params), kind="sortfree")
    assert torch.equal(again.cpu(), tokens)
    rows = sampling_rows(params)
    rows[1].num_samples = 2
    fallback, _ = _sample_with_triton(logits, logits, rows, kind="sortfree")
    assert fallback is None
    sorted_path, _ = _sample_with_triton(logits, logits, sampling_rows(params), kind="sort")
    assert sorted_path is None  # the sort path leaves cut rows to torch


def test_sampler_rejection_path_mixes_cuts():
    """_sample_with_triton(kind="rejection"): top-p rows by rejection, a top-k row and a
    min-p + top-p row by the threshold, greedy rows the argmax; same seeds, same tokens."""
    g = torch.Generator().manual_seed(6)
    logits = (torch.randn(5, 100, generator=g) * 2).to(DEVICE)
    params = [SamplingParams(temperature=0.8, top_p=0.6, seed=3),
              SamplingParams(temperature=1.0, top_k=3, seed=4),
              SamplingParams(temperature=0.0, top_p=0.5),
              SamplingParams(temperature=1.2, top_p=0.3, seed=5),
              SamplingParams(temperature=0.9, top_p=0.7, min_p=0.2, seed=6)]
    tokens, lse = _sample_with_triton(logits, logits, sampling_rows(params), kind="rejection")
    tokens = tokens.cpu()
    assert tokens[2] == logits[2].argmax().item()
    for i in (0, 1, 3, 4):
        assert kept_by_sort(logits[i], params[i])[tokens[i]], i
    torch.testing.assert_close(lse.cpu(), logits.cpu().logsumexp(-1, keepdim=True))
    again, _ = _sample_with_triton(logits, logits, sampling_rows(params), kind="rejection")
    assert torch.equal(again.cpu(), tokens)


def test_sampler_switch_is_checked(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_SAMPLER", raising=False)
    assert sampler_kind() == "rejection"
    monkeypatch.setenv("PAGEDLLM_SAMPLER", "sort")
    assert sampler_kind() == "sort"
    monkeypatch.setenv("PAGEDLLM_SAMPLER", "sortfree")
    assert sampler_kind() == "sortfree"
    monkeypatch.setenv("PAGEDLLM_SAMPLER", "rejection")
    assert sampler_kind() == "rejection"
    monkeypatch.setenv("PAGEDLLM_SAMPLER", "radix")
    with pytest.raises(ValueError, match=r"^PAGEDLLM_SAMPLER must be one of sort, sortfree, "
                       r"rejection, got 'radix'$"):
        sampler_kind()
