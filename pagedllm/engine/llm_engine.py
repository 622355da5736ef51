"""LLMEngine: requests in, one scheduling step at a time, RequestOutputs out.

A pure sequence generator: prompts are text or token ids; chat formatting lives in the
entrypoints (apply_chat_template is a convenience for them).
"""
from __future__ import annotations

import gc
import itertools
import logging
import math
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.contract import SampleResult, SpecStats, StepBatch, StepResult
from pagedllm.engine_args import EngineArgs
from pagedllm.engine.batch_builder import StepBatchBuilder
from pagedllm.engine.detokenizer import Detokenizer, find_stop_string
from pagedllm.engine.ngram_proposer import propose_ngram
from pagedllm.engine.pooling import finish_pooling, pooling_output
from pagedllm.engine.scheduler import Scheduler, SchedulerOutput
from pagedllm.engine.sequence import Logprob, Sequence, SequenceGroup, SequenceStatus
from pagedllm.engine.structured_output import StructuredOutputManager
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.model_runner import PendingStep
from pagedllm.worker.tp_worker import create_worker

RUNNING = SequenceStatus.RUNNING

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_cache_usage: float
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_gpu_blocks: int
    block_size: int
    weight_bytes: int = 0  # the model's weights as stored (packed GGUF / FP8 count as such)
    # Speculative decoding since the engine started: proposals scored, proposals accepted,
    # and rows verified (each also gets one token of the target's own).
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_verified_rows: int = 0
    # Prompt tokens looked up in the prefix cache and found there, since the engine started.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted / proposed tokens (0 before any proposal)."""
        n = self.spec_num_draft_tokens
        return self.spec_num_accepted_tokens / n if n else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a verified row produced on average: accepted proposals + 1."""
        n = self.spec_num_verified_rows
        return (self.spec_num_accepted_tokens + n) / n if n else 0.0


# Running sequences past which speculation is off by default: a large batch already keeps
# the device busy, and verifying proposals then costs more than it saves (docs/benchmarks.md).
SPEC_BATCH_LIMIT = {"cuda": 32, "cpu": 8}


@dataclass
class _InFlight:
    """A launched step whose samples the engine has not read yet."""

    out: SchedulerOutput
    pending: PendingStep
    batch: StepBatch


# Whether the engine froze the garbage collector's heap (gc's state is the process's).
_heap_frozen = False


def _freeze_heap() -> None:
    """The objects alive when an engine first steps (the block pools' blocks, the model's
    modules, everything imported) kept out of the collector's passes: a full pass walks
    every tracked object, a long pause between two steps. They stay frozen while the engine
    is idle too: unfrozen, the collector's count of old objects is left at the few it saw
    while frozen, so the next full pass would come soon after. Frozen even when the process
    froze some objects of its own first: gc.freeze only adds to what is frozen."""
    global _heap_frozen
    if not _heap_frozen:
        gc.freeze()
        _heap_frozen = True


def _unfreeze_heap() -> None:
    """An engine was shut down or dropped: its model (in a reference cycle) is collectable
    again. gc.unfreeze takes everything out of the permanent generation, what the process
    froze itself before too. A live engine freezes the heap anew at its next step."""
    global _heap_frozen
    if _heap_frozen:
        gc.unfreeze()
        _heap_frozen = False


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


def _has_running(out: SchedulerOutput) -> bool:
    return any(scheduled.seq_group.num_seqs(RUNNING) for scheduled in out.scheduled_seq_groups)


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.worker = create_worker(args)
        weakref.finalize(self, _unfreeze_heap)
        self.info = info = self.worker.info()
        self.model_config = self.worker.model_config
        self.tokenizer = self.worker.tokenizer
        # The names the server answers to; the first is the one its responses carry.
        self.served_model_names = args.served_model_names() or [info.source_name]
        self.model_name = self.served_model_names[0]
        self.max_model_len = info.max_model_len
        self.block_size = args.block_size
        self.cache_config = CacheConfig(
            block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching
        )
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=info.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=args.enable_chunked_prefill,
            preemption_mode=args.preemption_mode,
        )
        self.scheduler = Scheduler(
            self.scheduler_config,
            self.cache_config,
            info.num_gpu_blocks,
            info.num_cpu_blocks,
        )
        self.detokenizer = Detokenizer(self.tokenizer)
        self.eos_token_ids = set(info.eos_token_ids)
        self.requests: dict[str, SequenceGroup] = {}
        self._seq_ids = itertools.count()
        # Streaming (the server) wants text and an output every step; offline generation
        # (LLM.generate) only wants finished requests, and text once at the end, which
        # saves a detokenization per sequence per step.
        self.stream_outputs = True
        on_cuda = info.on_cuda
        steps = args.num_scheduler_steps
        if steps is None:
            steps = 8 if on_cuda else 1
        self.num_scheduler_steps = steps
        # On the CPU the forward runs while it is launched: nothing to overlap.
        self.async_scheduling = on_cuda if args.async_scheduling is None else args.async_scheduling
        self.batch_builder = StepBatchBuilder()
        self._in_flight: _InFlight | None = None
        # A speculative step needs the last step's tokens: it runs alone (one step per
        # schedule, nothing launched ahead). Multi-step and async scheduling stay for the
        # steps where speculation is off (above disable_by_batch_size running sequences).
        self.speculative_config = args.speculative_config
        spec = args.speculative_config
        self.spec_batch_limit = None if spec is None else (
            spec.disable_by_batch_size or SPEC_BATCH_LIMIT["cuda" if on_cuda else "cpu"])
        self.spec_stats = SpecStats()
        # Grammar matchers of requests with structured_outputs (engine/structured_output.py).
        self.structured = StructuredOutputManager(
            self.tokenizer, list(info.eos_token_ids), self.model_config.vocab_size,
            pin_masks=on_cuda)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

    # ----------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
    ) -> None:
        """A generation request, or with PoolingParams a pooling one: its prompt's forward
        (chunked as any prompt's) gives one vector (RequestOutput.embedding), no token is
        sampled, and its blocks are freed as the vector comes out."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(params, PoolingParams):
            return self._add_pooling_request(request_id, prompt, params, arrival_time)
        prompt_text, ids = self._tokenize(prompt)
        # Without max_tokens a request may run to the end of the context, but it only has to
        # fit the cache with its prompt and first token to be admissible.
        explicit_max_tokens = params.max_tokens
        params = self._resolve_max_tokens(params, len(ids))
        self._check_fits_cache(ids, params, explicit_max_tokens or 1)
        seq = Sequence(next(self._seq_ids), ids, self.block_size)
        self.detokenizer.start(seq)
        group = SequenceGroup(request_id, [seq], params, prompt_text, arrival_time)
        if params.structured_outputs is not None:
            self.structured.start(seq.seq_id, group)
        self.requests[request_id] = group
        self.scheduler.add_seq_group(group)

    def _add_pooling_request(self, request_id: str, prompt: str | list[int],
                             params: PoolingParams, arrival_time: float | None) -> None:
        params.check_dimensions(self.model_config.hidden_size, self.model_name)
        prompt_text, ids = self._tokenize(prompt, room=0)
        need = math.ceil(len(ids) / self.block_size)
        if need > self.info.num_gpu_blocks:
            raise ValueError(
                f"the prompt needs {need * self.block_size} tokens of KV cache for its "
                f"forward but the cache holds only {self.info.num_gpu_blocks * self.block_size}")
        seq = Sequence(next(self._seq_ids), ids, self.block_size)
        # The sampling params only steer the scheduler: one step, nothing sampled.
        group = SequenceGroup(request_id, [seq], SamplingParams(max_tokens=1), prompt_text,
                              arrival_time)
        group.pooling, group.pooling_params = self.args.pooling, params
        self.requests[request_id] = group
        self.scheduler.add_seq_group(group)

    def _tokenize(self, prompt: str | list[int],
                  room: int = 1) -> tuple[str | None, list[int]]:
        """`room`: tokens the prompt must leave in the context (0: a pooling prompt)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass the prompt as token ids")
            ids = self.tokenizer.encode(prompt)
            text: str | None = prompt
        else:
            ids = list(prompt)
            vocab = self.model_config.vocab_size
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token id {bad[0]!r} is out of range [0, {vocab})")
            text = None
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) + room > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens, but the model's context is "
                f"{self.max_model_len} tokens" + (
                    " (the prompt must leave room for one new token)" if room else "")
            )
        return text, ids

    def _resolve_max_tokens(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        room = self.max_model_len - prompt_len
        if params.max_tokens is None:
            params = params.clone()
            params.max_tokens = room
        elif params.max_tokens > room:
            raise ValueError(
                f"max_tokens ({params.max_tokens}) plus the prompt ({prompt_len} tokens) is "
                f"{params.max_tokens + prompt_len} tokens, more than the model's context of "
                f"{self.max_model_len} tokens"
            )
        return params

    def _check_fits_cache(self, ids: list[int], params: SamplingParams, max_tokens: int) -> None:
        bs = self.block_size
        samples = max(params.n, params.best_of or params.n)
        need = math.ceil(len(ids) / bs) + samples * (math.ceil(max_tokens / bs) + 1)
        have = self.info.num_gpu_blocks
        if need > have:
            raise ValueError(
                f"the request needs up to {need * bs} tokens of KV cache "
                f"({len(ids)} prompt + {max_tokens} max_tokens x {samples} samples) but "
                f"the cache holds only {have * bs} tokens; lower max_tokens or give the cache "
                f"more memory"
            )

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.scheduler.abort_seq_group(ids)
        for rid in ids:
            group = self.requests.get(rid)
            if group is not None:
                self._forget(group)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_seqs() or self._in_flight is not None

    # --------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Schedule -> build the step batch -> the worker runs it -> update (append, fork,
        detokenize, stop, free). With async scheduling the next decode window is launched
        before this one's samples are read (Scheduler.schedule_continuation), so the host's
        update overlaps the device's next forward."""
        _freeze_heap()
        return self._step()

    def _step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        running, self._in_flight = self._in_flight, None
        if running is None:
            speculate = self._speculation_on()
            out = self.scheduler.schedule(1 if speculate else self.num_scheduler_steps,
                                          structured_ok=self.info.defers_token_bitmask)
            for group in out.ignored_seq_groups:
                outputs.append(self._ignored_output(group))
                self._forget(group)
            if out.is_empty():
                return outputs
            if speculate:
                self._speculate(out)
            running = self._launch(out)
        self._sample_constrained_steps(running)
        if self.async_scheduling and not (running.out.spec_token_ids or
                                          running.out.num_draft_tokens or
                                          self._speculation_on()):
            after = self.scheduler.schedule_continuation(
                running.out, self.num_scheduler_steps,
                structured_ok=self.info.defers_token_bitmask)
            if after is not None:
                self._in_flight = self._launch(after, defer_masks=True)
        result = running.pending.wait()
        ahead = self._in_flight
        if ahead is not None and ahead.batch.defer_token_bitmask:
            # The continuation's forward runs while this step's last samples advance the
            # grammars; its first masks are filled in the background during this update.
            self.structured.advance(running.batch, result.token_ids[-1])
            self.structured.start_fill(ahead.batch)
        between = None
        if ahead is not None and ahead.pending.awaits_bitmask:
            # The update takes longer than one forward: the window launched ahead samples its
            # next steps between parts of it, as soon as their masks are in.
            def between() -> None:
                self._sample_when_ready(ahead)
        outputs += self._update(running.out, result, between)
        if ahead is not None and not _has_running(ahead.out):
            # Every sequence of the step launched ahead finished in this one (on a token or a
            # stop string): nothing waits for its samples.
            self._sample_constrained_steps(ahead)
            ahead.pending.wait()
            self._in_flight = None
        for group in self.scheduler.free_finished_seq_groups():
            self._forget(group)
        return outputs

    def _sample_constrained_steps(self, running: _InFlight) -> None:
        """A decode window with constrained rows: each further step waits for the samples
        of the one before (its forward is already running), advances the grammars with
        them, and samples under the masks they give (a fill already started first)."""
        pending, batch, structured = running.pending, running.batch, self.structured
        if structured.filling(batch):
            self._sample_filled(running)
        while pending.awaits_bitmask:
            structured.advance(batch, pending.last_samples())
            structured.start_fill(batch, background=False)
            self._sample_filled(running)

    def _sample_when_ready(self, running: _InFlight) -> None:
        """Without waiting: the window's next step samples once its masks are in, and the
        masks of the one after start filling once its samples are."""
        pending, batch, structured = running.pending, running.batch, self.structured
        if structured.filling(batch):
            if not structured.fill_ready():
                return
            self._sample_filled(running)
        if pending.awaits_bitmask and pending.last_samples_ready():
            structured.advance(batch, pending.last_samples())
            structured.start_fill(batch)

    def _sample_filled(self, running: _InFlight) -> None:
        """The window's next step samples under the masks started last."""
        self.structured.finish_fill()
        batch = running.batch
        running.pending.sample_with_bitmask(batch.token_bitmask, batch.token_bitmask_rows)

    def _speculation_on(self) -> bool:
        limit = self.spec_batch_limit
        return limit is not None and \
            sum(len(g.seqs_dict) for g in self.scheduler.running) <= limit

    def _speculate(self, out: SchedulerOutput) -> None:
        """Proposals for the step's decode rows (n-gram: the tokens themselves; draft
        model: how many the worker's draft proposes), each with its slots reserved. None
        past `disable_by_batch_size` running sequences, none past max_tokens (the target's
        own token covers the last) or the context, none where the slots do not fit."""
        spec = self.speculative_config
        if out.num_steps != 1:
            return
        seqs = [(scheduled.seq_group, seq) for scheduled in out.scheduled_seq_groups
                if scheduled.token_chunk_size == 1 and scheduled.do_sample
                for seq in scheduled.seq_group.seqs_dict.values()
                if seq.status is RUNNING and seq.output_token_ids
                # a grammar's mask covers one position: constrained rows are not speculated
                and scheduled.seq_group.sampling_params.structured_outputs is None]
        for group, seq in seqs:
            length = seq.get_len()
            k = min(spec.num_speculative_tokens,
                    group.sampling_params.max_tokens - seq.get_output_len() - 1,
                    self.max_model_len - length - 1)
            if k < 1:
                continue
            if spec.method == "ngram":
                proposal = propose_ngram(seq.get_token_ids(), k, spec.prompt_lookup_min,
                                         spec.prompt_lookup_max)
                if proposal and self.scheduler.reserve_speculative(out, seq, len(proposal)):
                    out.spec_token_ids[seq.seq_id] = proposal
            elif self.scheduler.reserve_speculative(out, seq, k):
                out.num_draft_tokens[seq.seq_id] = k

    def _launch(self, out: SchedulerOutput, defer_masks: bool = False) -> _InFlight:
        """Build and launch a step; `defer_masks`: constrained rows get their masks after
        the launch (async scheduling), once the previous step's tokens are known."""
        batch = self.batch_builder.build(out)
        if self.structured:
            if defer_masks and any(i in self.structured.matchers for i in batch.seq_ids):
                batch.defer_token_bitmask = True
            else:
                self.structured.fill_bitmask(batch)
        return _InFlight(out, self.worker.launch(batch), batch)

    def _forget(self, group: SequenceGroup) -> None:
        self.requests.pop(group.request_id, None)
        self.batch_builder.free(group.seqs_dict)
        self.structured.free(group.seqs_dict)

    def _update(self, out: SchedulerOutput, result: StepResult,
                between: Callable[[], None] | None = None) -> list[RequestOutput]:
        """The one place a step's results land, in one order for single- and multi-step:
        per sequence, its chunk counts as computed, then each step's sample is appended
        (forking the extra samples of a first best_of sample) up to a stop, each sample
        after the first also counting its step's token as computed; then the outputs.
        `between` runs after every few groups."""
        outputs = []
        columns = _sample_columns(result, wanted=not self.stream_outputs)
        steps = None  # every sample as a SampleResult, built when a row needs one
        now = time.monotonic()
        for i, scheduled in enumerate(out.scheduled_seq_groups):
            if between is not None and i % 16 == 15:
                between()
            group = scheduled.seq_group
            seqs = [s for s in group.seqs_dict.values() if s.status is RUNNING]
            if not seqs:
                continue  # finished or aborted while this step ran (async scheduling)
            if group.pooling is not None:
                self.scheduler.mark_computed(seqs[0], scheduled.token_chunk_size)
                if scheduled.do_sample:  # the prompt is complete: its vector is out
                    finish_pooling(group, seqs[0], result.pooled[seqs[0].seq_id], now)
                    self.scheduler.free_seq(seqs[0])
                    self.batch_builder.free((seqs[0].seq_id,))
                    outputs.append(pooling_output(group))
                continue
            chunk_logprobs = result.prompt_logprobs.get(seqs[0].seq_id)
            if chunk_logprobs is not None:
                self._append_prompt_logprobs(group, chunk_logprobs)
            params = group.sampling_params
            for seq in seqs:
                if not scheduled.do_sample:
                    self.scheduler.mark_computed(seq, scheduled.token_chunk_size)
                    continue
                first = columns.first.get(seq.seq_id)
                if first is not None and params.logprobs is None and not params.stop:
                    self._append_window(seq, group, columns.token_ids[first],
                                        columns.logprobs[first], scheduled.token_chunk_size)
                    continue
                self.scheduler.mark_computed(seq, scheduled.token_chunk_size)
                steps = steps if steps is not None else result.samples()
                samples = steps[0][seq.seq_id]
                spec = result.num_spec_tokens.get(seq.seq_id) if result.num_spec_tokens \
                    else None
                if spec is not None:
                    self._append_spec(group, seq, samples, *spec)
                    continue
                if len(samples) > 1:
                    self._fork(group, seq, samples[1:])
                self._append(seq, samples[0], group)
                for step in steps[1:]:
                    if seq.is_finished():
                        break
                    self.scheduler.mark_computed(seq, 1)  # the step's input was the sample
                    self._append(seq, step[seq.seq_id][0], group)
            if scheduled.do_sample:
                self._record_token_times(group, now)
                if self.stream_outputs or group.is_finished():
                    outputs.append(self._make_output(group))
        return outputs

    def _append_window(self, seq: Sequence, group: SequenceGroup, token_ids: list[int],
                       logprobs: list[float], chunk: int) -> None:
        """`_append` of each step's sample in turn, up to a stop, for the common row (one
        sample, no logprobs, no stop strings, no streamed text): the stop checks inline,
        one prefix-cache registration for all the window's tokens."""
        params = group.sampling_params
        stop_ids = params.stop_token_ids
        eos = () if params.ignore_eos else self.eos_token_ids
        structured = self.structured if params.structured_outputs is not None else None
        out_len = seq.get_output_len()
        room = min(params.max_tokens - out_len, self.max_model_len - seq.get_len())
        status, cut = RUNNING, len(token_ids)
        for i, token in enumerate(token_ids):
            if out_len + i + 1 >= params.min_tokens and (
                    token in eos or (stop_ids and token in stop_ids)):
                status = SequenceStatus.FINISHED_STOPPED
                if token not in eos:
                    seq.stop_reason = token
            elif i + 1 >= room:
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
            child = parent.fork(next(self._seq_ids))
            self.scheduler.fork_seq(parent, child)
            self.batch_builder.fork(parent, child, None if seed is None else seed + i)
            self.structured.fork(parent.seq_id, child.seq_id)
            self._append(child, sample, group)

    @staticmethod
    def _record_token_times(group: SequenceGroup, now: float) -> None:
        if group.metrics.first_token_time is None:
            group.metrics.first_token_time = now
        group.metrics.last_token_time = now
        if group.is_finished():
            group.metrics.finished_time = now

    def _append(self, seq: Sequence, sample: SampleResult, group: SequenceGroup) -> None:
        params = group.sampling_params
        top = None
        if params.logprobs is not None:
            top = self._logprob_entry(sample.top_logprobs, sample.token_id, sample.logprob,
                                      sample.rank)
        seq.append_token(sample.token_id, sample.logprob, top)
        new_text = ""
        if self.stream_outputs or params.stop:
            new_text = self.detokenizer.decode_new(seq, params.skip_special_tokens)
        self._check_stop(seq, params, len(new_text))
        if params.structured_outputs is not None and self.structured.accept(
                seq.seq_id, sample.token_id):
            seq.status = self._grammar_end(seq)
        if seq.is_finished():
            self._finish(seq, params)

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
        if not (self.stream_outputs or params.stop):
            seq.output_text = self.detokenizer.decode_all(seq, params.skip_special_tokens)
        self.scheduler.free_seq(seq)
        self.batch_builder.free((seq.seq_id,))
        self.structured.free((seq.seq_id,))

    def _decode_one(self, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else None

    def _check_stop(self, seq: Sequence, params: SamplingParams, new_text_len: int) -> None:
        token = seq.last_token_id
        if seq.get_output_len() >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                seq.status = SequenceStatus.FINISHED_STOPPED
                return
            if params.stop_token_ids and token in params.stop_token_ids:
                seq.status = SequenceStatus.FINISHED_STOPPED
                seq.stop_reason = token
                return
            found = find_stop_string(seq.output_text, new_text_len, params.stop)
            if found is not None:
                stop, at = found
                keep = at + len(stop) if params.include_stop_str_in_output else at
                seq.output_text = seq.output_text[:keep]
                seq.status = SequenceStatus.FINISHED_STOPPED
                seq.stop_reason = stop
                return
        if seq.get_output_len() >= params.max_tokens or seq.get_len() >= self.max_model_len:
            seq.status = SequenceStatus.FINISHED_LENGTH

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
    def _make_output(self, group: SequenceGroup) -> RequestOutput:
        params = group.sampling_params
        finished = group.is_finished()
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
            outputs.append(
                CompletionOutput(
                    index=index,
                    text=text,
                    token_ids=list(seq.output_token_ids),
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=list(seq.output_logprobs) if params.logprobs is not None else None,
                    finish_reason=seq.status.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            prompt_logprobs=group.prompt_logprobs,
            outputs=outputs,
            finished=finished,
            metrics=group.metrics,
            num_cached_tokens=group.num_cached_tokens,
            deltas=deltas,
        )

    def _ignored_output(self, group: SequenceGroup) -> RequestOutput:
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            prompt_logprobs=None,
            outputs=[],
            finished=True,
            metrics=group.metrics,
            error=f"request {group.request_id!r} can never fit in the KV cache "
            f"({self.info.num_gpu_blocks * self.block_size} tokens)",
        )

    # -------------------------------------------------------------------- misc
    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks, if any (also done at exit)."""
        _unfreeze_heap()
        self.worker.shutdown()

    def get_stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            num_swapped=s.num_swapped,
            kv_cache_usage=s.gpu_cache_usage,
            prefix_cache_hit_rate=s.prefix_cache_hit_rate,
            num_preemptions=s.num_preemptions,
            num_gpu_blocks=self.info.num_gpu_blocks,
            block_size=self.block_size,
            weight_bytes=self.info.weight_bytes,
            spec_num_draft_tokens=self.spec_stats.num_draft_tokens,
            spec_num_accepted_tokens=self.spec_stats.num_accepted_tokens,
            spec_num_verified_rows=self.spec_stats.num_verified_rows,
            prefix_cache_queries=s.block_manager.gpu_allocator.num_cache_queries * self.block_size,
            prefix_cache_hits=s.block_manager.gpu_allocator.num_cache_hits * self.block_size,
        )

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template")
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
