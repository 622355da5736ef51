"""Speculative sampling keeps the target's distribution: a chi-square test over a small
vocabulary of the tokens that rejection sampling emits, with draft-model proposals (drawn
from q) and n-gram proposals (one-hot q), and through the SpecVerifier the model runner uses
(temperature, top-k); the same test rejects a naive accept-all rule."""
from __future__ import annotations

import pytest
import torch

from pagedllm.layers.rejection_sampler import SpecVerifier, rejection_sample
from pagedllm.layers.sampler import Sampler, SamplingRow
from pagedllm.sampling_params import SamplingParams

N = 20000
# Chi-square critical values at p = 0.001 by degrees of freedom: a correct sampler fails
# one run in a thousand (the seeds are fixed, so it does not flake).
CRITICAL = {3: 16.266, 4: 18.467, 5: 20.515}

P = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.06, 0.04],
                  [0.05, 0.05, 0.10, 0.20, 0.30, 0.30],
                  [0.30, 0.05, 0.30, 0.05, 0.25, 0.05]])
Q = torch.tensor([[0.10, 0.10, 0.20, 0.20, 0.20, 0.20],
                  [0.30, 0.30, 0.10, 0.10, 0.10, 0.10]])


def chi_square(tokens: torch.Tensor, p: torch.Tensor) -> float:
    """Over the tokens p allows (the caller checks none outside them was drawn)."""
    counts = torch.bincount(tokens, minlength=p.numel()).double()
    expected = p.double() * tokens.numel()
    support = p > 0
    return float(((counts - expected)[support] ** 2 / expected[support]).sum())


def draft_rows(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.multinomial(q, N, replacement=True, generator=g) for q in Q], 1)


def test_rejection_sampling_with_draft_probabilities_keeps_p():
    torch.manual_seed(1)
    ids = draft_rows()
    tokens, kept = rejection_sample(P.expand(N, 3, 6).contiguous(), ids, [2] * N,
                                    Q.expand(N, 2, 6).contiguous())
    kept = torch.tensor(kept)
    assert chi_square(tokens[:, 0], P[0]) < CRITICAL[5]
    # Given the first proposal was kept, the second token is the target's too.
    reached = kept >= 2
    assert chi_square(tokens[reached, 1], P[1]) < CRITICAL[5]
    # The bonus token after two kept proposals.
    assert chi_square(tokens[kept == 3, 2], P[2]) < CRITICAL[5]
    # Kept proposals are the draft's; the acceptance rate is sum(min(p, q)) per position.
    assert torch.equal(tokens[reached, 0], ids[reached, 0])
    assert abs(float(reached.double().mean()) - float(torch.minimum(P[0], Q[0]).sum())) < 0.02


def test_naive_accept_all_fails_the_same_test():
    """Keeping every proposal emits q, not p: the chi-square test catches it."""
    ids = draft_rows()
    assert chi_square(ids[:, 0], P[0]) > 10 * CRITICAL[5]


def test_ngram_proposals_one_hot_q_keep_p():
    """A deterministic proposal (q one-hot on it) is kept with probability p(d) and the
    residual is p without d: the token is still distributed as p."""
    torch.manual_seed(2)
    ids = torch.full((N, 2), 3, dtype=torch.long)  # always propose token 3 (p = 0.10 first)
    tokens, kept = rejection_sample(P.expand(N, 3, 6).contiguous(), ids, [2] * N, None)
    assert chi_square(tokens[:, 0], P[0]) < CRITICAL[5]
    assert abs(sum(k > 1 for k in kept) / N - 0.10) < 0.01
    assert chi_square(ids[:, 0], P[0]) > 10 * CRITICAL[5]  # accept-all: always token 3


def test_rows_with_fewer_proposals_and_none():
    """Rows of one batch with 2, 1 and 0 real proposals: at most num_draft + 1 tokens each,
    and a row with none draws its one token from p_0."""
    torch.manual_seed(3)
    ids = draft_rows()[:3000]
    num_draft = [2, 1, 0] * 1000
    tokens, kept = rejection_sample(P.expand(3000, 3, 6).contiguous(), ids, num_draft,
                                    Q.expand(3000, 2, 6).contiguous())
    assert all(1 <= k <= d + 1 for k, d in zip(kept, num_draft))
    none = tokens[2::3, 0]
    assert chi_square(none, P[0]) < CRITICAL[5]


@pytest.mark.parametrize("params, proposal", [
    (SamplingParams(temperature=0.7), 1),
    (SamplingParams(temperature=1.3, top_k=4), 0),  # top-k leaves 4 tokens: 3 dof
])
def test_spec_verifier_samples_the_processed_target_distribution(params, proposal):
    """Through the model runner's verifier: raw logits -> temperature, top-k -> p; n-gram
    proposals of one fixed token; the first emitted token follows p."""
    torch.manual_seed(4)
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5])
    rows_n = 8000
    x = logits / params.temperature
    if params.top_k > 0:
        x = x.masked_fill(x < x.topk(params.top_k).values[-1], float("-inf"))
    p = torch.softmax(x, -1)
    verifier = SpecVerifier(Sampler(eos_token_ids=[]))
    rows = [SamplingRow(params, [0], [1]) for _ in range(rows_n)]
    packed, kept = verifier(logits.repeat(rows_n * 2, 1), rows, [[proposal]] * rows_n,
                            [None] * rows_n)
    first = packed[0::2, 0].long()
    support = p > 0
    assert bool(support[first].all())
    dof = int(support.sum()) - 1
    assert chi_square(first, p) < CRITICAL[dof]
    assert abs(sum(k == 2 for k in kept) / rows_n - float(p[proposal])) < 0.02
    # Greedy rows: the proposal is kept exactly when it is the argmax.
    greedy = SamplingParams(temperature=0.0)
    _, kept = verifier(logits.repeat(4, 1), [SamplingRow(greedy, [0], [1])] * 2, [[0], [1]],
                       [None, None])
    assert kept == [2, 1]
