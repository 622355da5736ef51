"""What the engine returns: RequestOutput and CompletionOutput (vLLM-compatible)."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.engine.sequence import Logprob, RequestMetrics, SampleLogprobs


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    # Set when the engine rejected the request (e.g. it can never fit the KV cache).
    error: str | None = None
    # Text and token ids new since the previous output of this request, per sample.
    deltas: list[tuple[str, list[int]]] = field(default_factory=list)
