"""Sampler: one row of logits per sequence -> its next token(s) and their logprobs.

Order, as in vLLM: the reported logprobs come from the raw logits. The token is chosen from
the logits after logit_bias, the min_tokens mask and the repetition / frequency / presence
penalties: greedy rows take the argmax; random rows apply temperature, top-k, top-p and min-p,
then draw with the exponential race (argmax of probs / Exp(1) noise, which picks token i
with probability p_i). Everything is batched over rows; the only per-row loop is over rows
that carry their own seeded generator. Per-row parameters reach the device from pinned memory
without blocking, so the host queues the whole sampling step behind the forward; the one
transfer that waits is the packed result coming back.

On CUDA, when every row is greedy or plain temperature sampling (one sample, no top-k, top-p
or min-p), one Triton kernel reads the logits once for the tokens (the race as Gumbel-max
with Philox noise seeded per row) and the logsumexp (kernels/triton_sampling.py).

PAGEDLLM_SAMPLER picks how CUDA rows with top-k, top-p or min-p (one sample each) are drawn.
rejection (the default): rows with top-p alone take the race over the whole row, then
rejection rounds, a pass each, that keep the draw once it lies in the top-p set
(kernels/triton_top_p.py); rows with top-k or min-p as sortfree. sortfree: a first kernel
finds each row's cut as a threshold by pivot search (kernels/triton_threshold.py) and the
race skips the tokens below it. sort: torch sorts the whole [rows, vocab] logits.
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.contract import SampleResult
from pagedllm.kernels.metadata import host_to_device
from pagedllm.sampling_params import SamplingParams, SamplingType


@dataclass
class SamplingRow:
    """One row of the logits matrix."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far by this sequence
    num_samples: int = 1  # >1 only at the first sample of a best_of > 1 request
    generator: torch.Generator | None = None  # set when params.seed is given
    # Tokens generated before this sample, from the row's position: under async scheduling
    # output_token_ids may not hold the last step's token yet. None: len(output_token_ids).
    num_output_tokens: int | None = None

    @property
    def output_len(self) -> int:
        return len(self.output_token_ids) if self.num_output_tokens is None \
            else self.num_output_tokens


@dataclass
class SampledBatch:
    """One sampling call's results, still on the device."""

    token_ids: torch.Tensor  # [num samples] int64: the next step's input ids in multi-step
    packed: torch.Tensor  # [num samples, 3 + 2k] float64 (see _pack_logprobs)
    rows: list[SamplingRow]
    num_top: list[int]  # logprobs asked for, per row

    def results(self, packed: list[list[float]]) -> list[list[SampleResult]]:
        """`packed` as host lists -> num_samples results per row."""
        out: list[list[SampleResult]] = []
        it = iter(packed)
        for row, k in zip(self.rows, self.num_top):
            out.append([unpack_sample(next(it), k) for _ in range(row.num_samples)])
        return out


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator a seeded request keeps for its whole life (it lives on the logits' device)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


SAMPLERS = ("sort", "sortfree", "rejection")


def sampler_kind() -> str:
    """PAGEDLLM_SAMPLER: how CUDA rows with top-k / top-p / min-p are drawn."""
    kind = os.environ.get("PAGEDLLM_SAMPLER", "rejection")
    if kind not in SAMPLERS:
        raise ValueError(f"PAGEDLLM_SAMPLER must be one of {', '.join(SAMPLERS)}, got {kind!r}")
    return kind


# One row of each kind the sampling paths tell apart, for Sampler.warm_up.
WARM_UP_PARAMS = (
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=0.8, top_p=0.95),
    SamplingParams(temperature=0.8, top_k=40),
    SamplingParams(temperature=0.8, min_p=0.05),
    SamplingParams(temperature=0.8, top_k=40, top_p=0.9),
    SamplingParams(temperature=0.8, repetition_penalty=1.1),
    SamplingParams(temperature=0.8, seed=0),
    SamplingParams(temperature=0.0, logprobs=5),
)


class Sampler:
    def __init__(self, eos_token_ids: list[int]) -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.kind = sampler_kind()

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[list[SampleResult]]:
        """logits: [len(rows), vocab]. Returns num_samples results per row."""
        batch = self.sample(logits, rows)
        return batch.results(batch.packed.cpu().tolist())

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow],
               steps_ahead: int = 0) -> "SampledBatch":
        """Choose the tokens without waiting for the device: the results stay on it until
        the caller moves `packed` to the host (several steps' at once, in multi-step).
        `steps_ahead`: tokens each row has sampled since its output length was taken (the
        later steps of a decode window), which a pending min_tokens counts."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must have shape [num_rows={len(rows)}, vocab], got {tuple(logits.shape)}"
            )
        num_top = [r.params.logprobs or 0 for r in rows]
        if not rows:
            empty = torch.empty(0, 3, dtype=torch.float64)
            return SampledBatch(torch.empty(0, dtype=torch.long), empty, rows, num_top)
        logits = logits.float()
        refused, x = None, logits
        changes = _logits_changes(rows, steps_ahead)
        if changes == "min_tokens":
            # min_tokens alone refuses a few tokens per row: they are set to -inf in the
            # logits themselves for the draw and put back before the logprobs read them
            # (no copy of the whole [rows, vocab] logits).
            refused = self._refuse_stop_tokens(logits, rows, steps_ahead)
        elif changes is not None:
            x = self._changed_copy(logits, rows, steps_ahead)
        sample_rows = _sample_rows(rows, x.device)
        token_ids = lse = None
        if logits.is_cuda:
            token_ids, lse = _sample_with_triton(logits, x, rows, self.kind)
        elif _cpu_reductions(logits, x):
            token_ids, lse = _sample_with_cpu_kernels(logits, x, rows)
        if token_ids is None:
            token_ids = _choose_tokens(x, rows, sample_rows)
        if refused is not None:
            lse = refused.restore(logits, lse)
        with_rank = any(r.params.logprobs is not None for r in rows)
        packed = _pack_logprobs(logits, sample_rows, token_ids, max(num_top), with_rank, lse)
        return SampledBatch(token_ids, packed, rows, num_top)

    def warm_up(self, logits: torch.Tensor) -> None:
        """Draw from `logits` [len(WARM_UP_PARAMS), vocab] with each kind of row alone, then
        with all of them in one batch, and wait for the draws: on CUDA each path's Triton
        kernels compile (or load from Triton's cache) here, at start-up, not under the first
        request that takes the path. torch's random state is left as it was."""
        if logits.shape[0] != len(WARM_UP_PARAMS):
            raise ValueError(f"warm_up takes {len(WARM_UP_PARAMS)} rows of logits, "
                             f"got {logits.shape[0]}")
        devices = [logits.device] if logits.is_cuda else []
        with torch.random.fork_rng(devices=devices):
            for kinds in [[i] for i in range(len(WARM_UP_PARAMS))] + [range(len(WARM_UP_PARAMS))]:
                rows = [SamplingRow(WARM_UP_PARAMS[i], [1, 2], [3],
                                    generator=make_generator(0, logits.device)
                                    if WARM_UP_PARAMS[i].seed is not None else None)
                        for i in kinds]
                self.sample(logits[list(kinds)], rows).packed.cpu()

    def process_logits(self, logits: torch.Tensor, rows: list[SamplingRow],
                       steps_ahead: int = 0) -> torch.Tensor:
        """The float32 logits the token is chosen from, before temperature: logit_bias
        added, min_tokens mask, then the penalties. A copy when any of them applies (the raw
        logits still give the logprobs); else the logits themselves, which nothing writes."""
        x = logits.float()
        if _logits_changes(rows, steps_ahead) is None:
            return x
        return self._changed_copy(x, rows, steps_ahead)

    def _changed_copy(self, logits: torch.Tensor, rows: list[SamplingRow],
                      steps_ahead: int) -> torch.Tensor:
        """A copy of the float32 logits with the rows' changes applied."""
        x = logits.clone()
        self._apply_logit_bias(x, rows)
        self._apply_min_tokens(x, rows, steps_ahead)
        _apply_penalties(x, rows)
        return x

    def _apply_logit_bias(self, x: torch.Tensor, rows: list[SamplingRow]) -> None:
        vocab = x.shape[1]
        row_idx, token_idx, bias = [], [], []
        for i, row in enumerate(rows):
            for token_id, value in (row.params.logit_bias or {}).items():
                if token_id >= vocab:
                    raise ValueError(
                        f"logit_bias token id {token_id} is out of range for a vocabulary of {vocab}"
                    )
                row_idx.append(i)
                token_idx.append(token_id)
                bias.append(value)
        if row_idx:
            index = _index_tensors(row_idx, token_idx, x.device)
            x.index_put_(index, host_to_device(bias, torch.float32, x.device), accumulate=True)

    def _apply_min_tokens(self, x: torch.Tensor, rows: list[SamplingRow],
                          steps_ahead: int = 0) -> None:
        """Until min_tokens are out, no token may end the sequence."""
        index = self._stop_token_index(x, rows, steps_ahead)
        if index is not None:
            # A device -inf: a host scalar would be copied to the device synchronously.
            x.index_put_(index, _neg_inf(x.device))

    def _refuse_stop_tokens(self, logits: torch.Tensor, rows: list[SamplingRow],
                            steps_ahead: int) -> "_Refused | None":
        """_apply_min_tokens on the logits themselves, keeping what it overwrites."""
        index = self._stop_token_index(logits, rows, steps_ahead)
        if index is None:
            return None
        refused = _Refused(index, logits[index])
        logits.index_put_(index, _neg_inf(logits.device))
        return refused

    def _stop_token_index(self, x: torch.Tensor, rows: list[SamplingRow], steps_ahead: int
                          ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, token ids) of the tokens that would end a sequence before its min_tokens,
        each pair once; None when there are none."""
        vocab = x.shape[1]
        eos = self.eos_token_ids
        row_idx, token_idx = [], []
        for i, row in enumerate(rows):
            p = row.params
            if row.output_len + steps_ahead >= p.min_tokens:
                continue
            # With ignore_eos, EOS does not stop the sequence, so it needs no mask.
            stops = {t for t in (p.stop_token_ids or []) if t < vocab}
            if not p.ignore_eos:
                stops.update(t for t in eos if t < vocab)
            row_idx += [i] * len(stops)
            token_idx += sorted(stops)
        return _index_tensors(row_idx, token_idx, x.device) if row_idx else None


@dataclass
class _Refused:
    """Entries of the logits set to -inf in place for one draw, and their raw values."""

    index: tuple[torch.Tensor, torch.Tensor]  # (rows, token ids), each pair once
    raw: torch.Tensor

    def restore(self, logits: torch.Tensor, lse: torch.Tensor | None) -> torch.Tensor | None:
        """Put the raw values back; `lse` ([rows, 1], of the logits while refused; None:
        not computed yet) becomes the raw logits' logsumexp, each row's refused values
        added to it (relative to the larger of the two, so a row refused entirely stays
        finite where its raw values are)."""
        logits.index_put_(self.index, self.raw)
        if lse is None:
            return None
        rows = self.index[0]
        ref = lse.view(-1).scatter_reduce(0, rows, self.raw, "amax").nan_to_num_(neginf=0.0)
        total = torch.exp(lse.view(-1) - ref).index_add_(0, rows, torch.exp(self.raw - ref[rows]))
        return (ref + torch.log(total)).view_as(lse)


def _logits_changes(rows: list[SamplingRow], steps_ahead: int) -> str | None:
    """What the rows change in the logits before the draw, in one pass: None (nothing),
    "min_tokens" (only pending min_tokens) or "copy" (a logit_bias or penalties too)."""
    pending = False
    for row in rows:
        p = row.params
        if p.logit_bias or p.has_penalties:
            return "copy"
        pending = pending or row.output_len + steps_ahead < p.min_tokens
    return "min_tokens" if pending else None


_NEG_INF: dict[torch.device, torch.Tensor] = {}


def _neg_inf(device: torch.device) -> torch.Tensor:
    value = _NEG_INF.get(device)
    if value is None:
        value = _NEG_INF[device] = torch.tensor(float("-inf"), device=device)
    return value


def _sample_rows(rows: list[SamplingRow], device: torch.device) -> torch.Tensor | None:
    """The logits row of every sample, in order (a row repeats for best_of samples); None
    when that is every row once, in order (no gathering needed)."""
    if all(r.num_samples == 1 for r in rows):
        return None
    return host_to_device([i for i, r in enumerate(rows) for _ in range(r.num_samples)],
                          torch.long, device)


def _rows_of(t: torch.Tensor, sample_rows: torch.Tensor | None) -> torch.Tensor:
    return t if sample_rows is None else t[sample_rows]


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    """Per-row float parameters as a [rows, 1] column."""
    return host_to_device(values, torch.float32, device)[:, None]


def _index_tensors(rows: list[int], cols: list[int], device: torch.device) -> tuple[torch.Tensor, ...]:
    return host_to_device(rows, torch.long, device), host_to_device(cols, torch.long, device)


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab] float counts of each token id in each list."""
    lengths = [len(t) for t in token_lists]
    counts = torch.zeros(len(token_lists), vocab, device=device)
    total = sum(lengths)
    if total == 0:
        return counts
    # numpy builds the flat id tensor from Python ints several times faster than torch.tensor.
    flat = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int64, count=total)
    token_ids = host_to_device(flat, torch.long, device)
    row_ids = host_to_device(np.repeat(np.arange(len(lengths)), lengths), torch.long, device)
    counts.view(-1).scatter_add_(0, row_ids * vocab + token_ids, torch.ones(total, device=device))
    return counts


def _apply_penalties(x: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Repetition penalty (prompt + output, HF rule), then frequency and presence (output)."""
    chosen = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not chosen:
        return
    vocab, device = x.shape[1], x.device
    index = host_to_device(chosen, torch.long, device)
    params = [rows[i].params for i in chosen]
    sub = x[index]
    output_counts = _token_counts([rows[i].output_token_ids for i in chosen], vocab, device)
    if any(p.repetition_penalty != 1.0 for p in params):
        prompt_counts = _token_counts([rows[i].prompt_token_ids for i in chosen], vocab, device)
        seen = (prompt_counts + output_counts) > 0
        penalty = _column([p.repetition_penalty for p in params], device)
        penalised = torch.where(sub > 0, sub / penalty, sub * penalty)
        sub = torch.where(seen, penalised, sub)
    frequency = _column([p.frequency_penalty for p in params], device)
    presence = _column([p.presence_penalty for p in params], device)
    sub = sub - frequency * output_counts - presence * (output_counts > 0).float()
    x[index] = sub


def _plain_row(row: SamplingRow, vocab: int) -> bool:
    """One sample, greedy or at a temperature with no top-k, top-p or min-p cut."""
    p = row.params
    return row.num_samples == 1 and (
        p.sampling_type == SamplingType.GREEDY
        or ((p.top_k <= 0 or p.top_k >= vocab) and p.top_p >= 1.0 and p.min_p <= 0.0))


def _row_seeds(rows: list[SamplingRow], device: torch.device) -> torch.Tensor:
    """A fresh Philox seed per row for this step: from the row's own generator when it has
    one (so its draws depend on its seed alone), else from torch's (no host sync)."""
    seeds = torch.randint(0, 1 << 62, (len(rows),), device=device)
    for i, row in enumerate(rows):
        if row.generator is not None:
            seeds[i] = torch.randint(0, 1 << 62, (1,), generator=row.generator,
                                     device=row.generator.device)[0]
    return seeds


def _sample_with_triton(logits: torch.Tensor, x: torch.Tensor, rows: list[SamplingRow],
                        kind: str = "rejection") -> tuple[torch.Tensor | None, torch.Tensor]:
    """kernels/triton_sampling: the tokens of x's rows when every row is plain, or (kind
    sortfree / rejection) every row has one sample (None otherwise: _choose_tokens draws
    them), and the logsumexp of the raw logits, in one pass over the logits where x is the
    logits."""
    from pagedllm.kernels import triton_sampling

    vocab = x.shape[1]
    plain = all(_plain_row(r, vocab) for r in rows)
    if not plain and not (kind != "sort" and all(r.num_samples == 1 for r in rows)):
        return None, triton_sampling.row_argmax_logsumexp(logits)[1]
    if all(r.params.sampling_type == SamplingType.GREEDY for r in rows):
        tokens, lse = triton_sampling.row_argmax_logsumexp(x)
    else:
        inv_temp = host_to_device([0.0 if r.params.sampling_type == SamplingType.GREEDY
                                   else 1.0 / r.params.temperature for r in rows],
                                  torch.float32, x.device)
        seeds = _row_seeds(rows, x.device)
        rejected = [] if plain or kind != "rejection" else \
            [_top_p_alone(r, vocab) for r in rows]
        cut = [not _plain_row(r, vocab) and not (rejected and rejected[i])
               for i, r in enumerate(rows)]
        thresholds = _thresholds(x, rows, inv_temp, cut) if any(cut) else None
        tokens, _, lse = triton_sampling.sample_rows(x, inv_temp, seeds, thresholds=thresholds)
        if any(rejected):
            tokens = _top_p_by_rejection(x, rows, rejected, inv_temp, seeds, tokens)
    if x is not logits:
        lse = triton_sampling.row_argmax_logsumexp(logits)[1]
    return tokens, lse


def _top_p_alone(row: SamplingRow, vocab: int) -> bool:
    """A random row whose only cut is top-p."""
    p = row.params
    return (p.sampling_type != SamplingType.GREEDY and p.top_p < 1.0
            and (p.top_k <= 0 or p.top_k >= vocab) and p.min_p <= 0.0)


def _top_p_by_rejection(x: torch.Tensor, rows: list[SamplingRow], rejected: list[bool],
                        inv_temp: torch.Tensor, seeds: torch.Tensor, tokens: torch.Tensor
                        ) -> torch.Tensor:
    """The rows marked in `rejected` redrawn from their top-p set (kernels/triton_top_p);
    the race's tokens of the other rows stay."""
    from pagedllm.kernels import triton_top_p

    top_p = [r.params.top_p if cut else 1.0 for r, cut in zip(rows, rejected)]
    rounds = triton_top_p.rounds_for(min(top_p))
    return triton_top_p.top_p_by_rejection(
        x, inv_temp, seeds, host_to_device(top_p, torch.float32, x.device), tokens, rounds)


def _cpu_reductions(logits: torch.Tensor, x: torch.Tensor) -> bool:
    """kernels/cpu's row_argmax_logsumexp applies: fp32 CPU rows and the C kernels built."""
    from pagedllm.kernels import cpu

    return (logits.device.type == "cpu" and all(
        t.dtype == torch.float32 and t.dim() == 2 and t.stride(-1) == 1 for t in (logits, x))
        and logits.shape[1] > 0 and cpu.available())


def _sample_with_cpu_kernels(logits: torch.Tensor, x: torch.Tensor, rows: list[SamplingRow]
                             ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The tokens of x's rows when every row is greedy with one sample (None otherwise:
    _choose_tokens draws them), and the logsumexp of the raw logits: one C call per
    [rows, vocab] tensor instead of torch's six passes (kernels/cpu/sampling.c)."""
    from pagedllm.kernels import cpu

    tokens, lse = cpu.row_argmax_logsumexp(logits)
    if not all(r.num_samples == 1 and r.params.sampling_type == SamplingType.GREEDY
               for r in rows):
        return None, lse
    if x is not logits:
        tokens = cpu.row_argmax_logsumexp(x)[0]
    return tokens, lse


def _thresholds(x: torch.Tensor, rows: list[SamplingRow], inv_temp: torch.Tensor,
                cut: list[bool]) -> torch.Tensor:
    """The top-k / top-p / min-p cut on x / T of each row marked in `cut`
    (kernels/triton_threshold); -inf (nothing cut) for the others."""
    from pagedllm.kernels.triton_threshold import row_thresholds

    vocab, device = x.shape[1], x.device
    top_k = [r.params.top_k if c and 0 < r.params.top_k < vocab else vocab
             for r, c in zip(rows, cut)]
    top_p = [r.params.top_p if c else 1.0 for r, c in zip(rows, cut)]
    min_p = [r.params.min_p if c else 0.0 for r, c in zip(rows, cut)]
    return row_thresholds(
        x, inv_temp, host_to_device(top_k, torch.int32, device),
        host_to_device(top_p, torch.float32, device),
        host_to_device(min_p, torch.float32, device))


def _choose_tokens(x: torch.Tensor, rows: list[SamplingRow],
                   sample_rows: torch.Tensor | None) -> torch.Tensor:
    """[num_samples_total] token ids; greedy samples are the argmax of their row. Each
    [rows, vocab] pass costs a read of the whole logits, so none runs that is not needed."""
    random_rows = [i for i, r in enumerate(rows) if r.params.sampling_type != SamplingType.GREEDY]
    all_random = len(random_rows) == len(rows)
    if not all_random:
        # max(dim) returns the first maximal index, as argmax does, in about half its time.
        token_ids = _rows_of(x.max(dim=-1).indices, sample_rows)
    if not random_rows:
        return token_ids
    counts = [rows[i].num_samples for i in random_rows]
    index = host_to_device(random_rows, torch.long, x.device)
    probs = _random_probs(x if all_random else x[index], [rows[i].params for i in random_rows])
    if any(c > 1 for c in counts):
        repeats = [j for j, c in enumerate(counts) for _ in range(c)]
        probs = probs.index_select(0, host_to_device(repeats, torch.long, x.device))
    noise = _exponential_noise(probs.shape, [rows[i].generator for i in random_rows], counts, x.device)
    sampled = (probs / noise).argmax(dim=-1)
    if all_random:
        return sampled
    starts = [0]
    for r in rows:
        starts.append(starts[-1] + r.num_samples)
    positions = [p for i in random_rows for p in range(starts[i], starts[i + 1])]
    token_ids[host_to_device(positions, torch.long, x.device)] = sampled
    return token_ids


def _random_probs(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p, then min-p; returns (unnormalised) probabilities."""
    vocab, device = x.shape[1], x.device
    temperature = _column([p.temperature for p in params], device)
    x = x / temperature
    top_k = [p.top_k if p.top_k > 0 else vocab for p in params]
    top_p = [p.top_p for p in params]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        x = _apply_top_k_top_p(
            x, host_to_device(top_k, torch.long, device), host_to_device(top_p, torch.float32, device)
        )
    probs = torch.softmax(x, dim=-1)
    min_p = [p.min_p for p in params]
    if any(m > 0 for m in min_p):
        floor = _column(min_p, device) * probs.max(dim=-1, keepdim=True).values
        # The race below is invariant to each row's scale, so no renormalising is needed.
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs


def _apply_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's top_k logits, then the smallest prefix whose probability reaches top_p."""
    sorted_x, order = x.sort(dim=-1, descending=True)
    rank = torch.arange(x.shape[1], device=x.device)[None, :]
    sorted_x = sorted_x.masked_fill(rank >= top_k[:, None], float("-inf"))
    probs = torch.softmax(sorted_x, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # Rows with top_p == 1 are exempt: rounding in the cumsum must not cut their tail. The
    # top token always stays: a top_p below float32's smallest positive value is 0 here,
    # and acts as greedy (the limit of ever smaller top_p), never as "drop every token".
    drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0) & (rank > 0)
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, sorted_x)


def _exponential_noise(
    shape: torch.Size,
    generators: list[torch.Generator | None],
    counts: list[int],
    device: torch.device,
) -> torch.Tensor:
    """Exp(1) noise, one row per sample; a seeded row draws only from its own generator.
    Drawn as -log(U), U uniform: on the CPU 4x faster than exponential_ (6 vs 26 ms for 16
    rows of a 49k vocabulary, 2 threads), the same distribution."""
    noise = torch.empty(shape, device=device)
    if all(g is None for g in generators):
        _exponential_(noise)
    else:
        unseeded: list[int] = []
        start = 0
        for generator, count in zip(generators, counts):
            if generator is None:
                unseeded.extend(range(start, start + count))
            else:
                _exponential_(noise[start : start + count], generator)
            start += count
        if unseeded:
            index = host_to_device(unseeded, torch.long, device)
            noise[index] = _exponential_(torch.empty(len(unseeded), shape[1], device=device))
    # A zero draw would turn a masked (zero-probability) token into 0/0 = nan, which argmax picks.
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def _exponential_(t: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """t filled in place with Exp(1) draws, -log(U)."""
    return t.uniform_(generator=generator).log_().neg_()


def _pack_logprobs(
    logits: torch.Tensor, sample_rows: torch.Tensor | None, token_ids: torch.Tensor, k: int,
    with_rank: bool = True, lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Everything the host needs, per sample, in one float64 tensor (on the device) to move
    to the host at once: [token_id, logprob, rank, k top token ids, k top logprobs]. float64
    holds ids exactly. Logprobs are the raw logits minus each row's logsumexp (no
    [rows, vocab] logprob matrix is written); the rank (0 without `with_rank`) counts the
    raw logits above the chosen one."""
    logits = logits.float()
    if lse is None:
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    row_logits = _rows_of(logits, sample_rows)
    chosen_logit = row_logits.gather(1, token_ids[:, None])
    chosen = chosen_logit - _rows_of(lse, sample_rows)
    if with_rank:
        rank = (row_logits > chosen_logit).sum(dim=-1, keepdim=True) + 1
    else:
        rank = torch.zeros_like(chosen)
    columns = [token_ids[:, None], chosen, rank]
    if k > 0:
        top_values, top_ids = logits.topk(k, dim=-1)
        columns += [_rows_of(top_ids, sample_rows), _rows_of(top_values - lse, sample_rows)]
    return torch.cat([c.double() for c in columns], dim=1)


def unpack_sample(values: list[float], k: int) -> SampleResult:
    if not k:  # no top logprobs asked: most rows, every step
        return SampleResult(int(values[0]), values[1], int(values[2]), {})
    width = (len(values) - 3) // 2
    ids, top = values[3 : 3 + k], values[3 + width : 3 + width + k]
    return SampleResult(
        token_id=int(values[0]),
        logprob=values[1],
        rank=int(values[2]),
        top_logprobs={int(t): v for t, v in zip(ids, top)},
    )


def compute_prompt_logprobs(
    logits: torch.Tensor, next_token_ids: list[int], k: int | None
) -> list[tuple[float, int, dict[int, float]]]:
    """For prompt_logprobs: logits[i] predicts next_token_ids[i]. Returns, per position, the
    logprob of that token, its rank, and the top-k logprobs ({} when k is None or 0)."""
    if logits.dim() != 2 or logits.shape[0] != len(next_token_ids):
        raise ValueError(
            f"logits must have shape [{len(next_token_ids)}, vocab] (one row per next token), "
            f"got {tuple(logits.shape)}"
        )
    if not next_token_ids:
        return []
    vocab = logits.shape[1]
    if not all(0 <= t < vocab for t in next_token_ids):
        bad = next(t for t in next_token_ids if not 0 <= t < vocab)
        raise ValueError(f"token id {bad} is out of range for a vocabulary of {vocab}")
    token_ids = host_to_device(next_token_ids, torch.long, logits.device)
    k = k or 0
    packed = _pack_logprobs(logits, None, token_ids, k).cpu().tolist()
    out = []
    for values in packed:
        r = unpack_sample(values, k)
        out.append((r.logprob, r.rank, r.top_logprobs))
    return out
