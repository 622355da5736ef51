"""A step's updated sequences into RequestOutputs: the output processor's half of a step's
update, after the scheduler's (`Scheduler.update_from_output`, engine/scheduler_update.py,
appended the tokens, applied the token-level stops and freed the finished).

Per updated sequence: its new tokens are detokenized one by one (when text is wanted:
streaming, or stop strings), a stop string ends it through
`Scheduler.finish_on_stop_string`, its logprob entries are built, and its group's
RequestOutput (every step when streaming, else once finished).
"""
from __future__ import annotations

import time

from pagedllm.contract import StepResult
from pagedllm.engine.detokenizer import Detokenizer, find_stop_string
from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.scheduler_update import StepUpdate
from pagedllm.engine.sequence import Logprob, Sequence, SequenceGroup, SequenceStatus
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams

RUNNING = SequenceStatus.RUNNING


class OutputProcessor:
    """Detokenizes, checks stop strings, builds logprobs and RequestOutputs."""

    def __init__(self, scheduler: Scheduler, tokenizer) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.detokenizer = Detokenizer(tokenizer)
        # Streaming (the server) wants text and an output every step; offline generation
        # (LLM.generate) only wants finished requests, and text once at the end, which
        # saves a detokenization per sequence per step.
        self.stream = True

    # ------------------------------------------------------------------ process
    def process(self, update: StepUpdate, result: StepResult) -> list[RequestOutput]:
        """The outputs of the groups the scheduler's update of this step reached."""
        outputs = []
        now = time.monotonic()
        for scheduled, first_seq_id in update.rows:
            group = scheduled.seq_group
            if group.pooling is not None:
                if scheduled.do_sample:
                    outputs.append(final_output(group, embedding=group.embedding))
                continue
            chunk_logprobs = result.prompt_logprobs.get(first_seq_id)
            if chunk_logprobs is not None:
                self._append_prompt_logprobs(group, chunk_logprobs)
            if not scheduled.do_sample:
                continue
            for seq in list(group.seqs_dict.values()):
                num_new = update.num_new.get(seq.seq_id)
                if num_new is not None:
                    self._process_seq(seq, group.sampling_params, num_new, update)
            _record_token_times(group, now)
            if self.stream or group.is_finished():
                outputs.append(self.make_output(group))
        return outputs

    def _process_seq(self, seq: Sequence, params: SamplingParams, num_new: int,
                     update: StepUpdate) -> None:
        if self.stream or params.stop:
            self._detokenize(seq, params, num_new, update)
        elif seq.is_finished():  # offline: the whole text once
            seq.output_text = self.detokenizer.decode_all(seq, params.skip_special_tokens)
        if params.logprobs is not None:
            for sample in update.samples[seq.seq_id]:
                seq.output_logprobs.append(self._logprob_entry(
                    sample.top_logprobs, sample.token_id, sample.logprob, sample.rank))

    def _detokenize(self, seq: Sequence, params: SamplingParams, num_new: int,
                    update: StepUpdate) -> None:
        """The new tokens' text, token by token; the first stop string completed (once
        min_tokens are out) cuts the text there and stops the sequence. A token that
        stopped it itself (EOS, a stop token, a grammar's end) wins over a stop string it
        completes; a length limit does not."""
        first_len = seq.get_len() - num_new
        out_len = seq.get_output_len() - num_new
        for i in range(num_new):
            new_text = self.detokenizer.decode_new(seq, params.skip_special_tokens,
                                                   end=first_len + i + 1)
            if not params.stop or out_len + i + 1 < params.min_tokens:
                continue
            if i == num_new - 1 and seq.status not in (RUNNING, SequenceStatus.FINISHED_LENGTH):
                break
            found = find_stop_string(seq.output_text, len(new_text), params.stop)
            if found is not None:
                stop, at = found
                keep = at + len(stop) if params.include_stop_str_in_output else at
                seq.output_text = seq.output_text[:keep]
                self.scheduler.finish_on_stop_string(seq, stop, out_len + i + 1, update)
                break

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


def final_output(group: SequenceGroup, error: str | None = None,
                 embedding: list[float] | None = None) -> RequestOutput:
    """The one output of a request that samples nothing: a pooling request's vector, or
    the error of one the scheduler gave up on."""
    return RequestOutput(
        request_id=group.request_id,
        prompt=group.prompt,
        prompt_token_ids=group.prompt_token_ids,
        prompt_logprobs=None,
        outputs=[],
        finished=True,
        metrics=group.metrics,
        num_cached_tokens=group.num_cached_tokens if error is None else 0,
        embedding=embedding,
        error=error,
    )


def ignored_output(group: SequenceGroup, cache_tokens: int) -> RequestOutput:
    """A request the scheduler gave up on: it can never fit in the KV cache."""
    return final_output(group, error=f"request {group.request_id!r} can never fit in the "
                        f"KV cache ({cache_tokens} tokens)")


def _record_token_times(group: SequenceGroup, now: float) -> None:
    if group.metrics.first_token_time is None:
        group.metrics.first_token_time = now
    group.metrics.last_token_time = now
    if group.is_finished():
        group.metrics.finished_time = now
