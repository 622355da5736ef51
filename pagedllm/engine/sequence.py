"""Sequence (one stream of tokens) and SequenceGroup (all samples of one request)."""
from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from pagedllm.outputs import Logprob, RequestMetrics, SampleLogprobs

if TYPE_CHECKING:
    from pagedllm.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    # Rejected by the scheduler: can never fit in the KV cache.
    FINISHED_IGNORED = "ignored"
    # Its grammar failed mid-way (a limit hit during generation); stop_reason says why.
    FINISHED_ERROR = "error"

    # Members are singletons: identity hashing, not Enum's Python-level hash of the name
    # (statuses are looked up in sets for every sequence on every step).
    __hash__ = object.__hash__

    @property
    def is_finished(self) -> bool:
        return self in FINISHED_STATUSES

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.is_finished else None


# A set, not a name test: checked for every sequence on every step.
FINISHED_STATUSES = frozenset({
    SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
    SequenceStatus.FINISHED_ABORTED, SequenceStatus.FINISHED_IGNORED,
    SequenceStatus.FINISHED_ERROR,
})


class Sequence:
    """The token ids of one sample and how many of them already have KV in the cache."""

    # The LoRA adapter it runs under (0: the base model): the prefix cache keys its blocks
    # by it, so the same tokens under two adapters never share KV.
    lora_int_id = 0

    def __init__(self, seq_id: int, prompt_token_ids: list[int], block_size: int) -> None:
        self.seq_id = seq_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.output_logprobs: SampleLogprobs = []
        self.cumulative_logprob = 0.0
        self.block_size = block_size
        self.status = SequenceStatus.WAITING
        # Tokens whose K/V are written in the cache. The next step computes
        # tokens [num_computed_tokens, num_computed_tokens + chunk).
        self.num_computed_tokens = 0
        self.output_text = ""
        self.stop_reason: int | str | None = None
        # Incremental detokenizer state (see engine/detokenizer.py).
        self.tokens: list[str] | None = None
        self.prefix_offset = 0
        self.read_offset = 0
        # How much text / how many tokens the last RequestOutput of this sequence carried.
        self.sent_text_len = 0
        self.sent_token_len = 0

    def get_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) of prompt + output, without copying the whole sequence."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p: end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def get_len(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def get_prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def get_output_len(self) -> int:
        return len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.get_len() - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """True while more than the newest token still needs computing."""
        return self.num_uncomputed_tokens > 1 or not self.output_token_ids

    def append_token(
        self, token_id: int, logprob: float = 0.0, top_logprobs: dict[int, Logprob] | None = None
    ) -> None:
        self.output_token_ids.append(token_id)
        self.cumulative_logprob += logprob
        if top_logprobs is not None:
            self.output_logprobs.append(top_logprobs)

    def reset_for_recompute(self) -> None:
        """Preempted by recompute: the KV is dropped and prompt + output recomputed."""
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING

    def is_finished(self) -> bool:
        return self.status in FINISHED_STATUSES

    def fork(self, new_seq_id: int) -> "Sequence":
        child = Sequence(new_seq_id, self.prompt_token_ids, self.block_size)
        child.output_token_ids = list(self.output_token_ids)
        child.output_logprobs = list(self.output_logprobs)
        child.cumulative_logprob = self.cumulative_logprob
        child.status = self.status
        child.lora_int_id = self.lora_int_id
        child.num_computed_tokens = self.num_computed_tokens
        child.output_text = self.output_text
        child.tokens = list(self.tokens) if self.tokens is not None else None
        child.prefix_offset = self.prefix_offset
        child.read_offset = self.read_offset
        child.sent_text_len = self.sent_text_len
        child.sent_token_len = self.sent_token_len
        return child

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, status={self.status.name}, len={self.get_len()}, "
            f"computed={self.num_computed_tokens})"
        )


class SequenceGroup:
    """One request: its prompt and all its samples (n, or best_of while sampling)."""

    lora_request = None  # the LoRARequest it runs under (None: the base model)

    def __init__(
        self,
        request_id: str,
        seqs: list[Sequence],
        sampling_params: SamplingParams,
        prompt: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.seqs_dict = {s.seq_id: s for s in seqs}
        self.sampling_params = sampling_params
        self.prompt = prompt
        self.metrics = RequestMetrics(arrival_time=arrival_time or time.monotonic())
        # prompt_logprobs[i] is for prompt token i (None for the first token).
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        # Number of prompt tokens found in the prefix cache at admission.
        self.num_cached_tokens = 0
        # A pooling request (engine/pooling.py): "last" | "mean", its PoolingParams, and the
        # vector once its prompt is computed. None: a generation request.
        self.pooling: str | None = None
        self.pooling_params = None
        self.embedding: list[float] | None = None

    @property
    def prompt_token_ids(self) -> list[int]:
        return next(iter(self.seqs_dict.values())).prompt_token_ids

    def get_seqs(self, status: SequenceStatus | None = None) -> list[Sequence]:
        # Called per group per step by the scheduler's callers: one pass, no extra list.
        if status is None:
            return list(self.seqs_dict.values())
        return [s for s in self.seqs_dict.values() if s.status is status]

    def get_unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs_dict.values() if not s.is_finished()]

    def num_seqs(self, status: SequenceStatus | None = None) -> int:
        return len(self.get_seqs(status))

    def add(self, seq: Sequence) -> None:
        self.seqs_dict[seq.seq_id] = seq

    def remove(self, seq_id: int) -> None:
        del self.seqs_dict[seq_id]

    def is_finished(self) -> bool:
        return all(s.is_finished() for s in self.seqs_dict.values())

    @property
    def max_num_samples(self) -> int:
        """Sequences this group will hold once sampling has forked (best_of)."""
        p = self.sampling_params
        return max(p.n, p.best_of or p.n)

    def __repr__(self) -> str:
        return f"SequenceGroup(request_id={self.request_id}, seqs={list(self.seqs_dict.values())})"
