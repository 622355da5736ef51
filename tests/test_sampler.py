import collections
import math

import pytest
import torch

from pagedllm.layers.sampler import (
    Sampler,
    SamplingRow,
    compute_prompt_logprobs,
    make_generator,
)
from pagedllm.sampling_params import SamplingParams

EOS = 0


def row(prompt=(1, 2), output=(), num_samples=1, seed=None, **kwargs) -> SamplingRow:
    params = SamplingParams(seed=seed, **kwargs)
    generator = make_generator(seed) if seed is not None else None
    return SamplingRow(params, list(prompt), list(output), num_samples, generator)


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()[None, :]


def draw(probs: list[float], n: int = 4000, seed: int = 0, **kwargs) -> collections.Counter:
    """n samples of one row whose softmax is `probs`."""
    results = Sampler([])(logits_of(probs), [row(num_samples=n, seed=seed, **kwargs)])
    return collections.Counter(r.token_id for r in results[0])


def test_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    out = Sampler([EOS])(logits, [row(temperature=0.0) for _ in range(6)])
    assert [r[0].token_id for r in out] == logits.argmax(-1).tolist()


@pytest.mark.parametrize("kind", ["greedy", "mixed", "min_tokens", "penalty"])
def test_cpu_kernel_reductions_match_the_torch_ops(monkeypatch, kind):
    """On the CPU the argmax and logsumexp come from one C call (kernels/cpu/sampling.c)
    where the library is built: the same tokens, ranks and top logprobs as torch's max and
    logsumexp, and logprobs within float rounding."""
    from pagedllm.kernels import cpu
    from pagedllm.layers import sampler as sampler_module

    if not cpu.available():
        pytest.skip("no C compiler: the CPU runs the torch ops")
    torch.manual_seed(2)
    logits = torch.randn(4, 3000) * 4
    extra = {"greedy": {}, "mixed": {}, "min_tokens": {"min_tokens": 5},
             "penalty": {"repetition_penalty": 1.3}}[kind]

    def rows():
        made = [row(prompt=(1, 7), temperature=0.0, logprobs=2, **extra) for _ in range(3)]
        made.append(row(temperature=0.9, seed=11, logprobs=1, **extra) if kind == "mixed"
                    else row(temperature=0.0, **extra))
        return made

    def run():
        return [r[0] for r in Sampler([EOS, 5])(logits.clone(), rows())]

    with_kernel = run()
    monkeypatch.setattr(sampler_module, "_cpu_reductions", lambda logits, x: False)
    with_torch = run()
    for a, b in zip(with_kernel, with_torch):
        assert (a.token_id, a.rank, a.top_logprobs.keys()) == \
            (b.token_id, b.rank, b.top_logprobs.keys())
        assert a.logprob == pytest.approx(b.logprob, rel=1e-5, abs=1e-5)


def test_logprobs_rank_and_top_logprobs_come_from_raw_logits():
    torch.manual_seed(1)
    logits = torch.randn(3, 40)
    rows = [
        row(temperature=0.7, top_k=5, logprobs=4, seed=3, repetition_penalty=1.5),
        row(temperature=0.0, logprobs=0, presence_penalty=1.0, output=[3, 3]),
        row(temperature=1.3, num_samples=3, logprobs=20, logit_bias={7: 5.0}),
    ]
    out = Sampler([EOS])(logits, rows)
    expected = torch.log_softmax(logits, dim=-1)
    for i, results in enumerate(out):
        assert len(results) == rows[i].num_samples
        ref = expected[i].tolist()
        k = rows[i].params.logprobs
        top = sorted(range(40), key=lambda t: -ref[t])[:k]
        for r in results:
            assert r.logprob == pytest.approx(ref[r.token_id], abs=1e-6)
            assert r.rank == 1 + sum(v > ref[r.token_id] for v in ref)
            assert sorted(r.top_logprobs) == sorted(top)
            for t, v in r.top_logprobs.items():
                assert v == pytest.approx(ref[t], abs=1e-6)


def test_top_k_restricts_support():
    probs = [0.05, 0.3, 0.1, 0.25, 0.2, 0.1]
    counts = draw(probs, top_k=3)
    assert set(counts) == {1, 3, 4}


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = [0.05, 0.5, 0.15, 0.3]
    assert set(draw(probs, top_p=0.7)) == {1, 3}  # 0.5 < 0.7 <= 0.8
    assert set(draw(probs, top_p=0.9)) == {1, 2, 3}  # 0.8 < 0.9 <= 0.95
    assert set(draw(probs, top_p=0.3)) == {1}


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    probs = [0.4, 0.3, 0.2, 0.1]
    # After top_k=2: {0: 4/7, 1: 3/7}; top_p=0.5 then keeps only token 0.
    assert set(draw(probs, top_k=2, top_p=0.5)) == {0}
    assert set(draw(probs, top_k=3, top_p=0.5)) == {0, 1}


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    probs = [0.5, 0.3, 0.12, 0.08]
    assert set(draw(probs, min_p=0.2)) == {0, 1, 2}  # floor 0.1
    assert set(draw(probs, min_p=0.7)) == {0}  # floor 0.35


def test_temperature_reshapes_the_distribution():
    probs = [0.1, 0.2, 0.3, 0.4]
    n = 20000
    for temperature in (1.0, 0.5, 2.0):
        weights = [p ** (1 / temperature) for p in probs]
        expected = [w / sum(weights) for w in weights]
        counts = draw(probs, n=n, seed=7, temperature=temperature)
        for token, p in enumerate(expected):
            assert counts[token] / n == pytest.approx(p, abs=0.015)


def test_empirical_distribution_after_top_k():
    probs = [0.1, 0.2, 0.3, 0.4]
    n = 20000
    counts = draw(probs, n=n, seed=11, top_k=2)
    assert counts[3] / n == pytest.approx(4 / 7, abs=0.015)
    assert counts[2] / n == pytest.approx(3 / 7, abs=0.015)


def _reference_penalties(logits: list[float], r: SamplingRow) -> list[float]:
    p = r.params
    out = list(logits)
    seen = set(r.prompt_token_ids) | set(r.output_token_ids)
    counts = collections.Counter(r.output_token_ids)
    for t in range(len(out)):
        if t in seen:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        out[t] -= p.frequency_penalty * counts[t]
        if counts[t]:
            out[t] -= p.presence_penalty
    return out


def test_penalties_match_a_per_row_reference():
    torch.manual_seed(2)
    vocab = 30
    logits = torch.randn(5, vocab) * 3
    rows = [
        row(prompt=[1, 2, 2, 9], output=[4, 4, 4, 9, 17], repetition_penalty=1.3),
        row(prompt=[5], output=[4, 4, 6], frequency_penalty=0.7, presence_penalty=-0.4),
        row(prompt=[1, 3], output=[], repetition_penalty=0.8, frequency_penalty=1.5),
        row(prompt=[8, 8], output=[8, 20, 21, 21], repetition_penalty=2.0, presence_penalty=2.0),
        row(prompt=[0, 1], output=[2]),  # no penalty: untouched
    ]
    processed = Sampler([]).process_logits(logits, rows)
    for i, r in enumerate(rows):
        expected = _reference_penalties(logits[i].tolist(), r)
        assert processed[i].tolist() == pytest.approx(expected, abs=1e-5)
    assert torch.equal(processed[4], logits[4])


def test_frequency_penalty_changes_the_greedy_choice():
    logits = torch.tensor([[0.0, 2.0, 1.5, 0.0]])
    sampler = Sampler([])
    assert sampler(logits, [row(temperature=0, output=[1])])[0][0].token_id == 1
    r = row(temperature=0, output=[1, 1], frequency_penalty=0.5)
    assert sampler(logits, [r])[0][0].token_id == 2


def test_seeded_rows_reproduce_across_calls_and_batches():
    torch.manual_seed(3)
    logits = torch.randn(4, 64)
    target = logits[2:3]

    def seeded():
        return row(seed=1234, num_samples=8, top_p=0.95)

    alone = Sampler([EOS])(target, [seeded()])[0]
    mixed_rows = [row(seed=99, num_samples=3), row(temperature=0), seeded(), row(num_samples=5)]
    mixed = Sampler([EOS])(logits, mixed_rows)[2]
    again = Sampler([EOS])(target, [seeded()])[0]
    tokens = [r.token_id for r in alone]
    assert tokens == [r.token_id for r in mixed] == [r.token_id for r in again]
    assert len(set(tokens)) > 1  # genuinely random draws, not one repeated token
    other_seed = Sampler([EOS])(target, [row(seed=4321, num_samples=8, top_p=0.95)])[0]
    assert [r.token_id for r in other_seed] != tokens


def test_seeded_row_advances_its_generator_between_steps():
    logits = torch.zeros(1, 1000)
    r = row(seed=5, num_samples=1)
    sampler = Sampler([])
    steps = [sampler(logits, [r])[0][0].token_id for _ in range(5)]
    fresh = row(seed=5, num_samples=1)
    assert steps == [sampler(logits, [fresh])[0][0].token_id for _ in range(5)]
    assert len(set(steps)) > 1


def test_min_tokens_blocks_eos_and_stop_tokens():
    logits = torch.tensor([[9.0, 1.0, 8.0, 7.0]])  # EOS=0 most likely, then stop token 2
    sampler = Sampler([EOS])

    def greedy(output, **kw):
        return sampler(logits, [row(temperature=0, output=output, **kw)])[0][0].token_id

    assert greedy([5], min_tokens=2, stop_token_ids=[2]) == 3
    assert greedy([5, 5], min_tokens=2, stop_token_ids=[2]) == EOS
    # ignore_eos: EOS ends nothing, so it is not masked; stop_token_ids still are.
    assert greedy([], min_tokens=2, stop_token_ids=[2], ignore_eos=True) == EOS
    logits[0, EOS] = -5.0
    assert greedy([], min_tokens=2, stop_token_ids=[2], ignore_eos=True) == 3
    # Random rows respect it too.
    out = sampler(logits, [row(output=[], min_tokens=1, stop_token_ids=[2], num_samples=500, seed=1)])
    assert {r.token_id for r in out[0]}.isdisjoint({EOS, 2})


def test_min_tokens_alone_refuses_in_place_and_reports_raw_logprobs():
    """min_tokens without penalties or logit_bias refuses its tokens in the logits
    themselves: afterwards the logits are as they were, the tokens avoid the refused ids,
    and logprob, rank and top logprobs are those of the raw logits (EOS included)."""
    torch.manual_seed(3)
    logits = torch.randn(4, 40) * 2
    logits[:, EOS] += 12.0  # EOS the most likely everywhere, then 7
    logits[:, 7] += 8.0
    rows = [row(temperature=0, min_tokens=3, stop_token_ids=[7, 7], logprobs=3),
            row(temperature=0, output=[5, 5, 5], min_tokens=3, logprobs=2),  # no longer pending
            row(temperature=0.8, seed=3, min_tokens=2, stop_token_ids=[EOS, 7], logprobs=1),
            row(temperature=0, min_tokens=2, ignore_eos=True, stop_token_ids=[7], logprobs=2)]
    before = logits.clone()
    out = Sampler([EOS])(logits, rows)
    assert torch.equal(logits, before)
    raw = torch.log_softmax(before, dim=-1)
    tokens = [r[0].token_id for r in out]
    refused = before.clone()
    refused[0, [EOS, 7]] = float("-inf")
    refused[3, 7] = float("-inf")
    assert tokens[0] == int(refused[0].argmax()) and tokens[3] == int(refused[3].argmax())
    assert tokens[1] == int(before[1].argmax()) and tokens[2] not in (EOS, 7)
    for i, (result,) in enumerate(out):
        assert result.logprob == pytest.approx(float(raw[i, result.token_id]), abs=1e-5)
        assert result.rank == 1 + int((raw[i] > raw[i, result.token_id]).sum())
        top = raw[i].topk(rows[i].params.logprobs)
        assert list(result.top_logprobs) == top.indices.tolist()
        assert list(result.top_logprobs.values()) == pytest.approx(top.values.tolist(), abs=1e-5)


def test_min_tokens_in_place_matches_the_copying_path():
    """The same rows with a zero logit_bias added (the path that copies the logits): the
    same tokens and logprobs; and a row whose every token is refused still reports its raw
    logprobs."""
    torch.manual_seed(4)
    logits = torch.randn(3, 30)
    logits[:, EOS] += 5.0

    def rows(bias=None):
        return [row(temperature=0, min_tokens=2, logprobs=2, logit_bias=bias),
                row(temperature=1.0, seed=9, min_tokens=2, stop_token_ids=[4], logprobs=1),
                row(temperature=0, logprobs=1)]

    in_place = Sampler([EOS])(logits, rows())
    copied = Sampler([EOS])(logits, rows({29: 0.0}))
    assert [r[0].token_id for r in in_place] == [r[0].token_id for r in copied]
    assert [r[0].logprob for r in in_place] == pytest.approx([r[0].logprob for r in copied], abs=1e-5)
    small = torch.tensor([[1.0, 2.0, 3.0]])
    (result,), = Sampler([EOS])(small, [row(temperature=0, min_tokens=1, stop_token_ids=[1, 2])])
    assert result.logprob == pytest.approx(float(torch.log_softmax(small, -1)[0, result.token_id]))
    assert torch.equal(small, torch.tensor([[1.0, 2.0, 3.0]]))


def test_refused_entries_restore_the_raw_logsumexp():
    """_Refused.restore: the raw values back in place, and a logsumexp taken while they were
    -inf turned into the raw one, also for a row refused entirely (-inf while refused)."""
    from pagedllm.layers.sampler import _Refused

    torch.manual_seed(6)
    logits = torch.randn(3, 20) * 4
    rows = [0, 0, 1] + [2] * 20
    cols = [3, 11, 19] + list(range(20))
    index = (torch.tensor(rows), torch.tensor(cols))
    masked = logits.clone()
    refused = _Refused(index, masked[index])
    masked[index] = float("-inf")
    lse = refused.restore(masked, masked.logsumexp(-1, keepdim=True))
    assert torch.equal(masked, logits)
    torch.testing.assert_close(lse, logits.logsumexp(-1, keepdim=True))


def test_logit_bias_forces_a_token():
    torch.manual_seed(4)
    logits = torch.randn(2, 100)
    weakest = int(logits[0].argmin())
    rows = [
        row(temperature=0, logit_bias={weakest: 100}),
        row(num_samples=50, seed=2, logit_bias={str(weakest): 100}),
    ]
    out = Sampler([])(logits, rows)
    assert out[0][0].token_id == weakest
    assert {r.token_id for r in out[1]} == {weakest}
    # The reported logprob is still that of the raw logits.
    assert out[0][0].logprob == pytest.approx(torch.log_softmax(logits[0], -1)[weakest].item(), abs=1e-6)


def test_logit_bias_out_of_vocab_raises():
    with pytest.raises(ValueError, match="^logit_bias token id 10 is out of range for a vocabulary of 10$"):
        Sampler([])(torch.zeros(1, 10), [row(logit_bias={10: 1.0})])


def test_num_samples_returns_k_results():
    logits = torch.zeros(2, 1000)
    out = Sampler([])(logits, [row(num_samples=4), row(temperature=0, num_samples=3)])
    assert [len(r) for r in out] == [4, 3]
    assert len({r.token_id for r in out[0]}) > 1  # independent draws
    assert len({r.token_id for r in out[1]}) == 1  # greedy: all the same


def test_unseeded_rows_sample_within_support():
    torch.manual_seed(5)
    logits = torch.randn(3, 20)
    out = Sampler([])(logits, [row(top_k=2, num_samples=50) for _ in range(3)])
    for i, results in enumerate(out):
        allowed = set(logits[i].topk(2).indices.tolist())
        assert {r.token_id for r in results} == allowed


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match=r"^logits must have shape \[num_rows=2, vocab\], got \(1, 5\)$"):
        Sampler([])(torch.zeros(1, 5), [row(), row()])
    assert Sampler([])(torch.zeros(0, 5), []) == []


def test_compute_prompt_logprobs():
    torch.manual_seed(6)
    logits = torch.randn(5, 25)
    next_ids = [3, 0, 24, 7, 7]
    ref = torch.log_softmax(logits, -1)
    out = compute_prompt_logprobs(logits, next_ids, 3)
    assert len(out) == 5
    for i, (logprob, rank, top) in enumerate(out):
        row_ref = ref[i].tolist()
        assert logprob == pytest.approx(row_ref[next_ids[i]], abs=1e-6)
        assert rank == 1 + sum(v > row_ref[next_ids[i]] for v in row_ref)
        assert set(top) == set(ref[i].topk(3).indices.tolist())
        assert all(math.isclose(v, row_ref[t], abs_tol=1e-6) for t, v in top.items())
    assert all(top == {} for _, _, top in compute_prompt_logprobs(logits, next_ids, None))
    with pytest.raises(ValueError, match="^token id 25 is out of range for a vocabulary of 25$"):
        compute_prompt_logprobs(logits, [0, 0, 0, 0, 25], 1)
    with pytest.raises(ValueError, match="one row per next token"):
        compute_prompt_logprobs(logits, [0, 1], 1)


def test_warm_up_draws_each_kind_alone_then_together_and_keeps_the_random_state(monkeypatch):
    from pagedllm.layers.sampler import WARM_UP_PARAMS

    sampler = Sampler([EOS])
    batches = []
    inner = sampler.sample
    monkeypatch.setattr(sampler, "sample", lambda logits, rows: batches.append(
        [r.params for r in rows]) or inner(logits, rows))
    logits = torch.randn(len(WARM_UP_PARAMS), 300)
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    sampler.warm_up(logits)
    assert torch.equal(torch.rand(4), expected)  # unseeded requests draw as without it
    assert batches == [[p] for p in WARM_UP_PARAMS] + [list(WARM_UP_PARAMS)]
    with pytest.raises(ValueError, match="warm_up takes 9 rows of logits, got 2"):
        sampler.warm_up(logits[:2])
