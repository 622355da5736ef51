"""LLMEngine: requests in, one scheduling step at a time (EngineCore), RequestOutputs out.

A pure sequence generator: prompts are text or token ids; chat formatting lives in the
entrypoints (apply_chat_template is a convenience for them).
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedllm.engine.core import EngineCore, _unfreeze_heap  # noqa: F401 (tests reset it)
from pagedllm.engine.lora_slots import adapter_names
from pagedllm.engine.sequence import Sequence, SequenceGroup
from pagedllm.engine_args import EngineArgs
from pagedllm.lora import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.startup import paused_gc

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
    # With enable_lora: the slots, and the names of the adapters of the running requests
    # and of the waiting ones (swapped out included), each name once, sorted.
    max_loras: int = 0
    running_lora_adapters: list[str] = field(default_factory=list)
    waiting_lora_adapters: list[str] = field(default_factory=list)

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


class LLMEngine(EngineCore):
    """EngineCore with its requests' front door: tokenization, the admission checks
    (context, KV cache), aborts, and the engine's figures."""

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        with paused_gc():  # a build makes long-lived objects only (pagedllm/startup.py)
            return cls(args)

    # ----------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """A generation request, or with PoolingParams a pooling one: its prompt's forward
        (chunked as any prompt's) gives one vector (RequestOutput.embedding), no token is
        sampled, and its blocks are freed as the vector comes out. `lora_request`: the
        adapter it runs under (registered here if new; enable_lora must be on)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if lora_request is not None:
            if isinstance(params, PoolingParams):
                raise ValueError("lora_request is not supported with pooling requests (yet)")
            self.loras.add(lora_request)
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
        if lora_request is not None:
            group.lora_request, seq.lora_int_id = lora_request, lora_request.lora_int_id
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
            max_loras=len(self.lora_slots.slot_ids) if self.lora_slots is not None else 0,
            running_lora_adapters=adapter_names(s.running),
            waiting_lora_adapters=adapter_names([*s.waiting, *s.swapped]),
        )

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template")
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
