"""The scheduler's half of a step's update (`Scheduler.update_from_output`), in one place:
each sampled row's tokens appended to its sequence (a decode window's one per step, a
speculative row's kept tokens, a first best_of/n sample's forks), its computed tokens
marked, the token-level stop checks (EOS unless ignore_eos, stop_token_ids once min_tokens
are out, max_tokens, max_model_len, a grammar's end) and the finished sequences freed.

Stop strings need the text, which is the output processor's (engine/outputs.py): it
detokenizes the appended tokens one by one and, on a stop string, finishes the sequence
through `finish_on_stop_string`, which drops the tokens appended after it.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedllm.contract import SampleResult, SpecStats, StepResult
from pagedllm.engine.pooling import finish_pooling
from pagedllm.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.engine.batch_builder import StepBatchBuilder
    from pagedllm.engine.scheduler import ScheduledSequenceGroup, Scheduler, SchedulerOutput
    from pagedllm.engine.structured_output import StructuredOutputManager

RUNNING = SequenceStatus.RUNNING


def token_stop(token: int, output_len: int, params: SamplingParams,
               eos: set[int] | tuple[()]) -> tuple[SequenceStatus, int | None]:
    """A sequence whose `output_len`-th output token is `token`: stopped by EOS (no stop
    reason) or one of its stop_token_ids (the token as the reason), else RUNNING."""
    if output_len >= params.min_tokens:
        if token in eos:
            return SequenceStatus.FINISHED_STOPPED, None
        if params.stop_token_ids and token in params.stop_token_ids:
            return SequenceStatus.FINISHED_STOPPED, token
    return RUNNING, None


def length_stop(output_len: int, seq_len: int, params: SamplingParams,
                max_model_len: int) -> bool:
    return output_len >= params.max_tokens or seq_len >= max_model_len


@dataclass
class StepUpdate:
    """What one update did, for the output processor."""

    # The groups updated (none finished or aborted while the step ran), each with the id
    # of its first running sequence (the one its prompt logprobs are keyed by).
    rows: list[tuple[ScheduledSequenceGroup, int]] = field(default_factory=list)
    num_new: dict[int, int] = field(default_factory=dict)  # seq_id -> tokens appended
    # Rows with logprobs: seq_id -> the samples of its appended tokens, in order.
    samples: dict[int, list[SampleResult]] = field(default_factory=dict)
    # Rows with stop strings: seq_id -> (its cumulative logprob before the step, the
    # appended tokens' logprobs), so a stop string can drop the tokens after it exactly.
    appended_logprobs: dict[int, tuple[float, list[float]]] = field(default_factory=dict)


class _Columns:
    """A step's samples as per-sample lists over its steps (no SampleResult per token
    unless a row with logprobs asks for them)."""

    def __init__(self, result: StepResult) -> None:
        self.result = result
        self.start: dict[int, int] = {}  # seq_id -> its row's first sample
        self.num_samples: dict[int, int] = {}
        self.owner: list[tuple[int, int]] = []  # sample -> (its row's seq_id, index in row)
        for seq_id, n in zip(result.seq_ids, result.num_samples):
            self.start[seq_id], self.num_samples[seq_id] = len(self.owner), n
            self.owner += [(seq_id, j) for j in range(n)]
        empty = result.token_ids is None
        self.token_ids = [] if empty else result.token_ids.T.tolist()  # [sample][step]
        self.logprobs = [] if empty else result.logprobs.T.tolist()
        self._steps: list | None = None

    def sample(self, column: int, step: int) -> SampleResult:
        if self._steps is None:
            self._steps = self.result.samples()
        seq_id, j = self.owner[column]
        return self._steps[step][seq_id][j]
class SequenceUpdater:
    """`Scheduler.update_from_output`: the engine's pieces a step's tokens reach (the batch
    builder's per-sequence state, the grammars, the fork ids, the speculation counters)."""

    def __init__(self, batch_builder: StepBatchBuilder, structured: StructuredOutputManager,
                 eos_token_ids: set[int], seq_ids: Iterator[int], spec_stats: SpecStats) -> None:
        self.batch_builder, self.structured = batch_builder, structured
        self.eos_token_ids = eos_token_ids
        self.seq_ids = seq_ids  # the engine's: forks take their ids from it
        self.spec_stats = spec_stats
        self.scheduler: Scheduler | None = None

    def bind(self, scheduler: Scheduler) -> None:
        """The scheduler this updater serves: the one it is given to when made
        (Scheduler(..., updater)); one updater, one scheduler."""
        if self.scheduler is not None:
            raise ValueError("this updater serves another scheduler already")
        self.scheduler = scheduler
        self.max_model_len = scheduler.scheduler_config.max_model_len

    def update(self, out: SchedulerOutput, result: StepResult) -> StepUpdate:
        update = StepUpdate()
        columns = _Columns(result)
        now = time.monotonic()
        for scheduled in out.scheduled_seq_groups:
            group = scheduled.seq_group
            seqs = [s for s in group.seqs_dict.values() if s.status is RUNNING]
            if not seqs:
                continue  # finished or aborted while this step ran (async scheduling)
            update.rows.append((scheduled, seqs[0].seq_id))
            if group.pooling is not None:
                self._update_pooling(scheduled, seqs[0], result, now)
                continue
            for seq in seqs:
                if scheduled.do_sample:
                    self._update_seq(scheduled, seq, columns, update)
                else:
                    self.scheduler.mark_computed(seq, scheduled.token_chunk_size)
        return update

    def _update_pooling(self, scheduled: ScheduledSequenceGroup, seq: Sequence,
                        result: StepResult, now: float) -> None:
        self.scheduler.mark_computed(seq, scheduled.token_chunk_size)
        if scheduled.do_sample:  # the prompt is complete: its vector is out
            finish_pooling(scheduled.seq_group, seq, result.pooled[seq.seq_id], now)
            self._free(seq)

    def _update_seq(self, scheduled: ScheduledSequenceGroup, seq: Sequence,
                    columns: _Columns, update: StepUpdate) -> None:
        """One sampled sequence: its row's samples (columns from its row's first) appended."""
        group, chunk = scheduled.seq_group, scheduled.token_chunk_size
        start = columns.start[seq.seq_id]
        spec = columns.result.num_spec_tokens.get(seq.seq_id)
        if spec is not None:
            num_tokens, num_proposed = spec
            self.spec_stats.record(num_proposed, num_tokens - 1)
            # Each kept token after the first was a scored proposal: its K/V is in the cache.
            picks = [(start + j, 0) for j in range(num_tokens)]
            self._append(seq, group, picks, columns, chunk, update)
            if seq.status is RUNNING:  # the rollback: blocks past the tokens are returned
                bm = self.scheduler.block_manager
                if bm.trim(seq):
                    self.batch_builder.trim(seq.seq_id, len(bm.block_tables[seq.seq_id]))
            return
        num_steps = len(columns.token_ids[start]) if columns.token_ids else 0
        # Each step's sample after the first was the next step's input: its K/V are in.
        picks = [(start, step) for step in range(num_steps)]
        extra = columns.num_samples[seq.seq_id] - 1
        if extra:  # a first best_of/n sample: the extra samples become forks of `seq`
            self.scheduler.mark_computed(seq, chunk)
            chunk = 0
            self._fork(group, seq, start, extra, columns, update)
        self._append(seq, group, picks, columns, chunk, update)

    def _fork(self, group: SequenceGroup, parent: Sequence, start: int, extra: int,
              columns: _Columns, update: StepUpdate) -> None:
        seed = group.sampling_params.seed
        for i in range(1, extra + 1):
            child = parent.fork(next(self.seq_ids))
            self.scheduler.fork_seq(parent, child)
            self.batch_builder.fork(parent, child, None if seed is None else seed + i)
            self.structured.fork(parent.seq_id, child.seq_id)
            self._append(child, group, [(start + i, 0)], columns, 0, update)

    def _append(self, seq: Sequence, group: SequenceGroup, picks: list[tuple[int, int]],
                columns: _Columns, chunk: int, update: StepUpdate) -> None:
        """The picked samples' tokens (sample column, step) appended up to a stop; then
        `chunk` and every appended token but the last count as computed."""
        params = group.sampling_params
        tokens = [columns.token_ids[j][step] for j, step in picks]
        cut, status = self._stop_at(seq, params, tokens)
        logprobs = [columns.logprobs[j][step] for j, step in picks[:cut]]
        before = total = seq.cumulative_logprob
        seq.output_token_ids += tokens[:cut]
        for logprob in logprobs:
            total += logprob
        seq.cumulative_logprob = total
        update.num_new[seq.seq_id] = cut
        if params.logprobs is not None:
            update.samples[seq.seq_id] = [columns.sample(j, step) for j, step in picks[:cut]]
        if params.stop:
            update.appended_logprobs[seq.seq_id] = (before, logprobs)
        if chunk + cut - 1 > 0:
            self.scheduler.mark_computed(seq, chunk + cut - 1)
        if status is not RUNNING:
            seq.status = status
            self._free(seq)

    def _stop_at(self, seq: Sequence, params: SamplingParams,
                 tokens: list[int]) -> tuple[int, SequenceStatus]:
        """How many of `tokens` `seq` takes, and its status after them: the token-level
        stop checks of each in turn; the grammar takes every token taken, and its end stops
        the sequence."""
        eos = () if params.ignore_eos else self.eos_token_ids
        structured = self.structured if params.structured_outputs is not None else None
        out_len, seq_len = seq.get_output_len(), seq.get_len()
        for i, token in enumerate(tokens):
            status, reason = token_stop(token, out_len + i + 1, params, eos)
            if reason is not None:
                seq.stop_reason = reason
            if status is RUNNING and length_stop(out_len + i + 1, seq_len + i + 1, params,
                                                 self.max_model_len):
                status = SequenceStatus.FINISHED_LENGTH
            if structured is not None and structured.accept(seq.seq_id, token):
                status = self._grammar_end(seq)
            if status is not RUNNING:
                return i + 1, status
        return len(tokens), RUNNING

    def _grammar_end(self, seq: Sequence) -> SequenceStatus:
        """The status of a sequence whose grammar ended: complete (stop), or failed mid-way
        (error, its message as the stop reason: never a plain stop)."""
        error = self.structured.error(seq.seq_id)
        if error is None:
            return SequenceStatus.FINISHED_STOPPED
        seq.stop_reason = error
        return SequenceStatus.FINISHED_ERROR

    def finish_on_stop_string(self, seq: Sequence, stop: str, output_len: int,
                              update: StepUpdate) -> None:
        """`seq` stops on the stop string `stop`, which its `output_len`-th output token
        completed (a token this step appended): the tokens after it are dropped, and it is
        freed unless a later token's stop freed it already."""
        before, logprobs = update.appended_logprobs[seq.seq_id]
        kept = output_len - (seq.get_output_len() - len(logprobs))
        del seq.output_token_ids[output_len:]
        del update.samples.get(seq.seq_id, [])[kept:]
        total = before
        for logprob in logprobs[:kept]:
            total += logprob
        seq.cumulative_logprob = total
        update.num_new[seq.seq_id] = kept
        was_running = seq.status is RUNNING
        seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
        if was_running:
            self._free(seq)

    def _free(self, seq: Sequence) -> None:
        self.scheduler.free_seq(seq)
        self.batch_builder.free((seq.seq_id,))
        self.structured.free((seq.seq_id,))
