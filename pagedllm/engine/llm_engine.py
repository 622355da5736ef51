"""LLMEngine: requests in, one scheduling step at a time, RequestOutputs out.

A pure sequence generator: prompts are text or token ids; chat formatting lives in the
entrypoints (apply_chat_template is a convenience for them).
"""
from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.engine_args import EngineArgs
from pagedllm.engine.detokenizer import Detokenizer, find_stop_string
from pagedllm.engine.scheduler import ScheduledSequenceGroup, Scheduler
from pagedllm.engine.sequence import Logprob, Sequence, SequenceGroup, SequenceStatus
from pagedllm.layers.sampler import SampleResult
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.worker import Worker

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


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.worker = Worker(args)
        self.model_config = self.worker.model_config
        self.tokenizer = self.worker.tokenizer
        self.model_name = args.served_model_name or self.worker.source_name
        self.max_model_len = self.worker.max_model_len
        self.block_size = args.block_size
        self.cache_config = CacheConfig(
            block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching
        )
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=self.worker.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=args.enable_chunked_prefill,
            preemption_mode=args.preemption_mode,
        )
        self.scheduler = Scheduler(
            self.scheduler_config,
            self.cache_config,
            self.worker.num_gpu_blocks,
            self.worker.num_cpu_blocks,
        )
        self.detokenizer = Detokenizer(self.tokenizer)
        self.eos_token_ids = set(self.worker.eos_token_ids)
        self.requests: dict[str, SequenceGroup] = {}
        self._seq_ids = itertools.count()
        # Streaming (the server) wants text and an output every step; offline generation
        # (LLM.generate) only wants finished requests, and text once at the end, which
        # saves a detokenization per sequence per step.
        self.stream_outputs = True
        steps = args.num_scheduler_steps
        if steps is None:
            steps = 8 if self.worker.device_map.input_device.type == "cuda" else 1
        self.num_scheduler_steps = steps

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

    # ----------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_text, ids = self._tokenize(prompt)
        # Without max_tokens a request may run to the end of the context, but it only has to
        # fit the cache with its prompt and first token to be admissible.
        explicit_max_tokens = params.max_tokens
        params = self._resolve_max_tokens(params, len(ids))
        self._check_fits_cache(ids, params, explicit_max_tokens or 1)
        seq = Sequence(next(self._seq_ids), ids, self.block_size)
        self.detokenizer.start(seq)
        if params.seed is not None:
            seq.generator = self.worker.make_generator(params.seed)
        group = SequenceGroup(request_id, [seq], params, prompt_text, arrival_time)
        self.requests[request_id] = group
        self.scheduler.add_seq_group(group)

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
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
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens, but the model's context is "
                f"{self.max_model_len} tokens (the prompt must leave room for one new token)"
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
        have = self.worker.num_gpu_blocks
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
            self.requests.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_seqs()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_seq_groups()

    # --------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        num_steps = self._multi_step_size()
        out = self.scheduler.schedule()
        if num_steps > 1 and not self._can_multi_step(out, num_steps):
            num_steps = 1
        outputs = [self._ignored_output(g) for g in out.ignored_seq_groups]
        self.worker.apply_cache_ops(out)
        if out.scheduled_seq_groups and num_steps > 1:
            self._run_multi_step(out, num_steps, outputs)
        elif out.scheduled_seq_groups:
            result = self.worker.execute(out)
            self.scheduler.on_step_done(out)
            now = time.monotonic()
            for scheduled in out.scheduled_seq_groups:
                group = scheduled.seq_group
                chunk_logprobs = result.prompt_logprobs.get(group.request_id)
                if chunk_logprobs is not None:
                    self._append_prompt_logprobs(group, chunk_logprobs)
                if scheduled.do_sample:
                    self._process_samples(scheduled, result.samples, now)
                    if self.stream_outputs or group.is_finished():
                        outputs.append(self._make_output(group))
        for group in out.ignored_seq_groups:
            self.requests.pop(group.request_id, None)
        self.scheduler.free_finished_seq_groups()
        for o in outputs:
            if o.finished:
                self.requests.pop(o.request_id, None)
        return outputs

    # ------------------------------------------------------------- multi-step
    def _multi_step_size(self) -> int:
        """Decode steps the next scheduling step may run back to back: 1 unless every
        running request is decoding one sequence whose sampling reads nothing of its own
        output (penalties, a pending min_tokens), none is swapped out, and no waiting request
        could start now (the batch is full). Capped so no sequence passes max_model_len."""
        num_steps = self.num_scheduler_steps
        scheduler = self.scheduler
        if num_steps <= 1 or scheduler.swapped or not scheduler.running:
            return 1
        if scheduler.waiting and len(scheduler.running) < self.scheduler_config.max_num_seqs:
            return 1
        for group in scheduler.running:
            if len(group.seqs_dict) != 1 or group.max_num_samples != 1:
                return 1
            seq = next(iter(group.seqs_dict.values()))
            p = group.sampling_params
            if (seq.num_uncomputed_tokens != 1 or p.has_penalties
                    or seq.get_output_len() < p.min_tokens):
                return 1
            room = self.max_model_len - seq.get_len() + 1
            if room < num_steps:
                num_steps = room
        return max(num_steps, 1)

    def _can_multi_step(self, out, num_steps: int) -> bool:
        """The schedule is the plain decode of every running request (nothing preempted,
        copied or swapped), and the lookahead slots fit (then they are reserved)."""
        plain = (
            not out.ignored_seq_groups and out.num_preempted == 0 and not out.blocks_to_copy
            and not out.blocks_to_swap_in and not out.blocks_to_swap_out
            and len(out.scheduled_seq_groups) == len(self.scheduler.running)
            and all(s.token_chunk_size == 1 and s.do_sample for s in out.scheduled_seq_groups)
        )
        return plain and self.scheduler.reserve_lookahead(out, num_steps - 1)

    def _run_multi_step(self, out, num_steps: int, outputs: list[RequestOutput]) -> None:
        """Append each step's samples in order, up to each sequence's stop (later samples of
        a finished sequence are dropped), then count the computed tokens."""
        results = self.worker.execute_multi_step(out, num_steps)
        now = time.monotonic()
        for scheduled in out.scheduled_seq_groups:
            group = scheduled.seq_group
            (seq,) = group.seqs_dict.values()  # multi-step groups hold one sequence
            for result in results:
                self._append(seq, result.samples[seq.seq_id][0], group)
                if seq.is_finished():
                    break
            self._record_token_times(group, now)
            if self.stream_outputs or seq.is_finished():
                outputs.append(self._make_output(group))
        self.scheduler.on_step_done(out, num_steps)

    def _process_samples(
        self, scheduled: ScheduledSequenceGroup, samples: dict[int, list[SampleResult]], now: float
    ) -> None:
        group = scheduled.seq_group
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            results = samples.get(seq.seq_id)
            if not results:
                continue
            for i, extra in enumerate(results[1:], start=1):
                child = seq.fork(next(self._seq_ids))
                if seq.generator is not None:
                    child.generator = self.worker.make_generator(group.sampling_params.seed + i)
                self.scheduler.fork_seq(seq, child)
                self._append(child, extra, group)
            self._append(seq, results[0], group)
        self._record_token_times(group, now)

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
        if seq.is_finished():
            if not (self.stream_outputs or params.stop):
                seq.output_text = self.detokenizer.decode_all(seq, params.skip_special_tokens)
            self.scheduler.free_seq(seq)

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
            f"({self.worker.num_gpu_blocks * self.block_size} tokens)",
        )

    # -------------------------------------------------------------------- misc
    def get_stats(self) -> EngineStats:
        s = self.scheduler
        bm = s.block_manager
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_swapped=len(s.swapped),
            kv_cache_usage=bm.gpu_usage(),
            prefix_cache_hit_rate=bm.prefix_cache_hit_rate(),
            num_preemptions=s.stats.num_preemptions_recompute + s.stats.num_preemptions_swap,
            num_gpu_blocks=self.worker.num_gpu_blocks,
            block_size=self.block_size,
            weight_bytes=self.worker.weight_bytes,
        )

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template")
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
