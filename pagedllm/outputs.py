"""What the engine returns: RequestOutput, CompletionOutput, Logprob and RequestMetrics
(vLLM-compatible)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely token
    decoded_token: str | None = None


# Per generated token: the chosen token and the top-k alternatives.
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class RequestMetrics:
    """When a request arrived, was first scheduled, got its first and last token, finished
    (time.monotonic())."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


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
    # A pooling request's vector (PoolingParams): the prompt's pooled final hidden state.
    embedding: list[float] | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]  # the prompt's pooled final hidden state


@dataclass
class EmbeddingRequestOutput:
    """What LLM.embed returns per prompt (vLLM's shape: `.outputs.embedding`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True

    @classmethod
    def from_output(cls, output: RequestOutput) -> "EmbeddingRequestOutput":
        assert output.embedding is not None, f"{output.request_id} is no pooling request"
        return cls(output.request_id, output.prompt, output.prompt_token_ids,
                   EmbeddingOutput(output.embedding))
