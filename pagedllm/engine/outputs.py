"""A step's samples into the sequences, and the sequences into RequestOutputs.

Per sequence, in one order for single- and multi-step: its chunk counts as computed, then
each step's sample is appended (forking the extra samples of a first best_of sample) up to
a stop, each sample after the first also counting its step's token as computed. Appending
detokenizes (when text is wanted), checks the stop conditions (`check_stop`, the one place
they are written), advances the grammar, and frees a sequence that finished.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pagedllm.contract import SampleResult, SpecStats, StepResult
from pagedllm.engine.batch_builder import StepBatchBuilder
from pagedllm.engine.detokenizer import Detokenizer, find_stop_string
from pagedllm.engine.pooling import finish_pooling, pooling_output
from pagedllm.engine.scheduler import ScheduledSequenceGroup, Scheduler, SchedulerOutput
from pagedllm.engine.sequence import Logprob, Sequence, SequenceGroup, SequenceStatus
from pagedllm.engine.structured_output import StructuredOutputManager
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams

RUNNING = SequenceStatus.RUNNING


@dataclass
class _SampleColumns:
    """A step's samples as per-sample lists over its steps (no SampleResult per token)."""

    token_ids: list[list[int]]  # [sample][step]
    logprobs: list[list[float]]
    first: dict[int, int]  # seq_id -> its row's sample, for rows of one sample


def _sample_columns(result: StepResult, wanted: bool) -> _SampleColumns:
    """Empty unless `wanted` (offline: streamed text appends token by token)."""
    if result.token_ids is None or not wanted:
        return _SampleColumns([], [], {})
    first, index = {}, 0
    for seq_id, n in zip(result.seq_ids, result.num_samples):
        if n == 1 and seq_id not in result.num_spec_tokens:
            first[seq_id] = index
        index += n
    return _SampleColumns(result.token_ids.T.tolist(), result.logprobs.T.tolist(), first)


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


class OutputProcessor:
    """Appends samples to sequences, stops and frees them, and builds their outputs."""

    def __init__(self, scheduler: Scheduler, batch_builder: StepBatchBuilder,
                 structured: StructuredOutputManager, tokenizer, eos_token_ids: set[int],
                 max_model_len: int, seq_ids: Iterator[int], spec_stats: SpecStats) -> None:
        self.scheduler, self.batch_builder, self.structured = scheduler, batch_builder, structured
        self.tokenizer = tokenizer
        self.detokenizer = Detokenizer(tokenizer)
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.seq_ids = seq_ids  # the engine's: forks take their ids from it
        self.spec_stats = spec_stats
        # Streaming (the server) wants text and an output every step; offline generation
        # (LLM.generate) only wants finished requests, and text once at the end, which
        # saves a detokenization per sequence per step.
        self.stream = True

    # ------------------------------------------------------------------- update
    def update(self, out: SchedulerOutput, result: StepResult,
               between: Callable[[], None] | None = None) -> list[RequestOutput]:
        """The one place a step's results land; `between` runs after every few groups."""
        outputs = []
        columns = _sample_columns(result, wanted=not self.stream)
        steps: list | None = None  # every sample as a SampleResult, built when a row needs one
        now = time.monotonic()
        for i, scheduled in enumerate(out.scheduled_seq_groups):
            if between is not None and i % 16 == 15:
                between()
            group = scheduled.seq_group
            seqs = [s for s in group.seqs_dict.values() if s.status is RUNNING]
            if not seqs:
                continue  # finished or aborted while this step ran (async scheduling)
            if group.pooling is not None:
                self._update_pooling(scheduled, seqs[0], result, now, outputs)
                continue
            chunk_logprobs = result.prompt_logprobs.get(seqs[0].seq_id)
            if chunk_logprobs is not None:
                self._append_prompt_logprobs(group, chunk_logprobs)
            for seq in seqs:
                steps = self._update_seq(scheduled, seq, result, columns, steps)
            if scheduled.do_sample:
                _record_token_times(group, now)
                if self.stream or group.is_finished():
                    outputs.append(self.make_output(group))
        return outputs

    def _update_pooling(self, scheduled: ScheduledSequenceGroup, seq: Sequence,
                        result: StepResult, now: float, outputs: list[RequestOutput]) -> None:
        self.scheduler.mark_computed(seq, scheduled.token_chunk_size)
        if scheduled.do_sample:  # the prompt is complete: its vector is out
            finish_pooling(scheduled.seq_group, seq, result.pooled[seq.seq_id], now)
            self.scheduler.free_seq(seq)
            self.batch_builder.free((seq.seq_id,))
            outputs.append(pooling_output(scheduled.seq_group))

    def _update_seq(self, scheduled: ScheduledSequenceGroup, seq: Sequence, result: StepResult,
                    columns: _SampleColumns, steps: list | None) -> list | None:
        """One sequence's chunk and samples; returns `steps` (built here if first needed)."""
        group, params = scheduled.seq_group, scheduled.seq_group.sampling_params
        if not scheduled.do_sample:
            self.scheduler.mark_computed(seq, scheduled.token_chunk_size)
            return steps
        first = columns.first.get(seq.seq_id)
        if first is not None and params.logprobs is None and not params.stop:
            self._append_window(seq, group, columns.token_ids[first], columns.logprobs[first],
                                scheduled.token_chunk_size)
            return steps
        self.scheduler.mark_computed(seq, scheduled.token_chunk_size)
        steps = steps if steps is not None else result.samples()
        samples = steps[0][seq.seq_id]
        spec = result.num_spec_tokens.get(seq.seq_id) if result.num_spec_tokens else None
        if spec is not None:
            self._append_spec(group, seq, samples, *spec)
            return steps
        if len(samples) > 1:
            self._fork(group, seq, samples[1:])
        self._append(seq, samples[0], group)
        for step in steps[1:]:
            if seq.is_finished():
                break
            self.scheduler.mark_computed(seq, 1)  # the step's input was the sample
            self._append(seq, step[seq.seq_id][0], group)
        return steps

    def _append_window(self, seq: Sequence, group: SequenceGroup, token_ids: list[int],
                       logprobs: list[float], chunk: int) -> None:
        """`_append` of each step's sample in turn, up to a stop, for the common row (one
        sample, no logprobs, no stop strings, no streamed text): the same stop checks, one
        prefix-cache registration for all the window's tokens."""
        params = group.sampling_params
        eos = () if params.ignore_eos else self.eos_token_ids
        structured = self.structured if params.structured_outputs is not None else None
        out_len, seq_len = seq.get_output_len(), seq.get_len()
        status, cut = RUNNING, len(token_ids)
        for i, token in enumerate(token_ids):
            status, reason = token_stop(token, out_len + i + 1, params, eos)
            if reason is not None:
                seq.stop_reason = reason
            if status is RUNNING and length_stop(out_len + i + 1, seq_len + i + 1, params,
                                                 self.max_model_len):
                status = SequenceStatus.FINISHED_LENGTH
            # The grammar takes every appended token, and its end stops the sequence.
            if structured is not None and structured.accept(seq.seq_id, token):
                status = self._grammar_end(seq)
            if status is not RUNNING:
                cut = i + 1
                break
        seq.output_token_ids += token_ids[:cut]
        total = seq.cumulative_logprob
        for logprob in logprobs[:cut]:
            total += logprob
        seq.cumulative_logprob = total
        # Each token after the first was the next step's input: its K/V are in the cache.
        self.scheduler.mark_computed(seq, chunk + cut - 1)
        if status is not RUNNING:
            seq.status = status
            self._finish(seq, params)

    def _append_spec(self, group: SequenceGroup, seq: Sequence, samples: list[SampleResult],
                     num_tokens: int, num_proposed: int) -> None:
        """A speculative row's kept tokens, appended one by one up to a stop (a stop string
        or max_tokens mid-window drops the rest); each token after the first was a scored
        proposal, so its K/V is in the cache. Then the rollback: blocks past the tokens go
        back to the allocator (the slots of rejected proposals are overwritten later)."""
        self.spec_stats.record(num_proposed, num_tokens - 1)
        self._append(seq, samples[0], group)
        for sample in samples[1:num_tokens]:
            if seq.is_finished():
                break
            self.scheduler.mark_computed(seq, 1)
            self._append(seq, sample, group)
        if seq.status is RUNNING:
            bm = self.scheduler.block_manager
            if bm.trim(seq):
                self.batch_builder.trim(seq.seq_id, len(bm.block_tables[seq.seq_id]))

    def _fork(self, group: SequenceGroup, parent: Sequence, extra: list[SampleResult]) -> None:
        """The extra samples of a first best_of/n sample become children of `parent`."""
        seed = group.sampling_params.seed
        for i, sample in enumerate(extra, start=1):
            child = parent.fork(next(self.seq_ids))
            self.scheduler.fork_seq(parent, child)
            self.batch_builder.fork(parent, child, None if seed is None else seed + i)
            self.structured.fork(parent.seq_id, child.seq_id)
            self._append(child, sample, group)

    def _append(self, seq: Sequence, sample: SampleResult, group: SequenceGroup) -> None:
        params = group.sampling_params
        top = None
        if params.logprobs is not None:
            top = self._logprob_entry(sample.top_logprobs, sample.token_id, sample.logprob,
                                      sample.rank)
        seq.append_token(sample.token_id, sample.logprob, top)
        new_text = ""
        if self.stream or params.stop:
            new_text = self.detokenizer.decode_new(seq, params.skip_special_tokens)
        self.check_stop(seq, params, len(new_text))
        if params.structured_outputs is not None and self.structured.accept(
                seq.seq_id, sample.token_id):
            seq.status = self._grammar_end(seq)
        if seq.is_finished():
            self._finish(seq, params)

    def check_stop(self, seq: Sequence, params: SamplingParams, new_text_len: int) -> None:
        """Whether `seq`, its last token just appended, stops: on EOS or a stop token, on a
        stop string in its new text (the text cut there), or at its length limit."""
        eos = () if params.ignore_eos else self.eos_token_ids
        status, reason = token_stop(seq.last_token_id, seq.get_output_len(), params, eos)
        if status is RUNNING and seq.get_output_len() >= params.min_tokens:
            found = find_stop_string(seq.output_text, new_text_len, params.stop)
            if found is not None:
                stop, at = found
                keep = at + len(stop) if params.include_stop_str_in_output else at
                seq.output_text = seq.output_text[:keep]
                status, reason = SequenceStatus.FINISHED_STOPPED, stop
        if status is RUNNING and length_stop(seq.get_output_len(), seq.get_len(), params,
                                             self.max_model_len):
            status = SequenceStatus.FINISHED_LENGTH
        if status is not RUNNING:
            seq.status = status
        if reason is not None:
            seq.stop_reason = reason

    def _grammar_end(self, seq: Sequence) -> SequenceStatus:
        """The status of a sequence whose grammar ended: complete (stop), or failed mid-way
        (error, its message as the stop reason: never a plain stop)."""
        error = self.structured.error(seq.seq_id)
        if error is None:
            return SequenceStatus.FINISHED_STOPPED
        seq.stop_reason = error
        return SequenceStatus.FINISHED_ERROR

    def _finish(self, seq: Sequence, params: SamplingParams) -> None:
        """A sequence that just finished: its whole text (offline), its blocks freed."""
        if not (self.stream or params.stop):
            seq.output_text = self.detokenizer.decode_all(seq, params.skip_special_tokens)
        self.scheduler.free_seq(seq)
        self.batch_builder.free((seq.seq_id,))
        self.structured.free((seq.seq_id,))

    # ----------------------------------------------------------------- logprobs
    def _decode_one(self, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else None

    def _append_prompt_logprobs(self, group: SequenceGroup, chunk) -> None:
        if group.prompt_logprobs is None:
            group.prompt_logprobs = [None]  # the first prompt token has no logprob
        for (lp, rank, top), token in zip(chunk, group.prompt_token_ids[len(group.prompt_logprobs):]):
            group.prompt_logprobs.append(self._logprob_entry(top, token, lp, rank))

    def _logprob_entry(
        self, top: dict[int, float], token: int, logprob: float, rank: int
    ) -> dict[int, Logprob]:
        """The top-k alternatives ranked 1..k, plus the token actually there."""
        ordered = sorted(top, key=lambda t: -top[t])
        entry = {t: Logprob(top[t], r, self._decode_one(t)) for r, t in enumerate(ordered, 1)}
        entry[token] = Logprob(logprob, rank, self._decode_one(token))
        return entry

    # ------------------------------------------------------------------ outputs
    def make_output(self, group: SequenceGroup) -> RequestOutput:
        params = group.sampling_params
        seqs = group.get_seqs()
        if len(seqs) > params.n:  # best_of: the n highest cumulative logprobs win
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: params.n]
        holdback = max((len(s) for s in params.stop), default=1) - 1
        outputs, deltas = [], []
        for index, seq in enumerate(seqs):
            text = seq.output_text
            visible = len(text) if seq.is_finished() else max(len(text) - holdback, 0)
            sent_text = min(seq.sent_text_len, visible)
            deltas.append((text[sent_text:visible], seq.output_token_ids[seq.sent_token_len:]))
            seq.sent_text_len, seq.sent_token_len = visible, seq.get_output_len()
            outputs.append(CompletionOutput(
                index=index,
                text=text,
                token_ids=list(seq.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob,
                logprobs=list(seq.output_logprobs) if params.logprobs is not None else None,
                finish_reason=seq.status.finish_reason,
                stop_reason=seq.stop_reason,
            ))
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            prompt_logprobs=group.prompt_logprobs,
            outputs=outputs,
            finished=group.is_finished(),
            metrics=group.metrics,
            num_cached_tokens=group.num_cached_tokens,
            deltas=deltas,
        )


def ignored_output(group: SequenceGroup, cache_tokens: int) -> RequestOutput:
    """A request the scheduler gave up on: it can never fit in the KV cache."""
    return RequestOutput(
        request_id=group.request_id,
        prompt=group.prompt,
        prompt_token_ids=group.prompt_token_ids,
        prompt_logprobs=None,
        outputs=[],
        finished=True,
        metrics=group.metrics,
        error=f"request {group.request_id!r} can never fit in the KV cache "
        f"({cache_tokens} tokens)",
    )


def _record_token_times(group: SequenceGroup, now: float) -> None:
    if group.metrics.first_token_time is None:
        group.metrics.first_token_time = now
    group.metrics.last_token_time = now
    if group.is_finished():
        group.metrics.finished_time = now
