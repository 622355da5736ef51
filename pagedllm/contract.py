"""The step contract: the only things handed between engine and worker, as plain data.

The engine sends a StepBatch per step: sequences the worker has not seen yet (once), then per
scheduled sequence the deltas since the worker last saw it (new token ids, block-table
changes, how many tokens to compute), plus forks, freed sequences and cache ops. The worker
keeps its own per-sequence state built from these (worker/model_runner.py: tokens, block
table, sampling parameters, generator) and returns a StepResult: the sampled token ids and
their logprobs as host arrays. Both are picklable, so with tensor parallelism rank 0 can
send the batch to every rank. The worker describes itself once, in a WorkerInfo.

The worker applies a batch in this order: new sequences, forks (a child copies its parent's
state as it was before this batch's deltas), freed ids, each row's new tokens and table
changes; the cache ops (swap out, swap in, copies) run before the forward.

A row's input tokens are its tokens [num_computed_tokens, num_computed_tokens +
num_scheduled_tokens). Async scheduling may launch a step before the engine has seen the
previous step's samples: then a decode row (one token) past the tokens the worker holds takes
its input id from the sample the previous launched step drew for it, still on the device.

This module is the ground floor: it imports no torch, so the engine's side of the seam (and
anything that only reads results) can be read and tested without the worker.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from pagedllm.sampling_params import SamplingParams


@dataclass
class NewSequence:
    """A sequence the worker has not seen, sent once at its first schedule."""

    seq_id: int
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int | None = None  # the sequence's own generator; None: the global one
    # "last" | "mean": a pooling request (PoolingParams): its rows are pooled, never sampled;
    # its last prompt chunk returns the vector (StepResult.pooled).
    pooling: str | None = None


@dataclass
class Fork:
    """A child starting as a copy of its parent as the worker holds it before this batch's
    deltas, with its own generator (seeded with `seed` when not None)."""

    parent_seq_id: int
    child_seq_id: int
    seed: int | None = None


@dataclass(frozen=True)
class LoRASlotLoad:
    """An adapter the worker copies into a slot (from its host copy, or read from the path
    when it has none: an adapter unloaded while requests still used it)."""

    lora_int_id: int
    lora_name: str
    lora_path: str


@dataclass
class StepBatch:
    new_seqs: list[NewSequence] = field(default_factory=list)
    forks: list[Fork] = field(default_factory=list)
    freed_seq_ids: list[int] = field(default_factory=list)
    # The scheduled sequences in batch order, one entry per row in each list.
    seq_ids: list[int] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)  # appended since last sent
    num_computed_tokens: list[int] = field(default_factory=list)  # the first input position
    num_scheduled_tokens: list[int] = field(default_factory=list)
    do_sample: list[bool] = field(default_factory=list)
    # seq_id -> (start, ids): table[start:] = ids. Absent: the table is unchanged.
    block_tables: dict[int, tuple[int, list[int]]] = field(default_factory=dict)
    num_samples: dict[int, int] = field(default_factory=dict)  # seq_id -> n > 1 (best_of)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, gpu)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst)
    num_steps: int = 1  # >1: a decode-only batch run that many times back to back
    # Structured output: packed int32 [len(token_bitmask_rows), ceil(vocab / 32)] host
    # tensor, bit t % 32 of word t // 32 set = token t allowed (ids past the mask: refused);
    # token_bitmask_rows: the indices, among this batch's sampled rows, of the rows it
    # constrains (the others are left alone). In a multi-step batch these are the first
    # step's masks. Set by the engine for a speculative step (one step, sampled at execute)
    # and for an executor that takes masks with the batch (WorkerInfo.defers_token_bitmask
    # False: the tensor-parallel group, whose windows with constrained rows are one step).
    token_bitmask: Any = None
    token_bitmask_rows: list[int] = field(default_factory=list)
    # The masks come with Executor.sample (GrammarMasks), not in the batch: execute queues
    # the forward at once, the sampling waits for them.
    defer_token_bitmask: bool = False
    # Speculative decoding (a decode row only; its num_scheduled_tokens counts them too):
    # seq_id -> proposed tokens after the row's last token (n-gram, proposed by the engine),
    # or seq_id -> how many tokens the worker's draft model proposes. Such a row's input is
    # its last token plus the proposals; the worker scores every position and keeps the
    # accepted prefix plus one token of its own (StepResult.num_spec_tokens).
    spec_token_ids: dict[int, list[int]] = field(default_factory=dict)
    num_draft_tokens: dict[int, int] = field(default_factory=dict)
    # LoRA: the adapter slot of each row (-1: the base model; empty: every row is the
    # base's), and the adapters to copy into slots before the forward, (slot, LoRASlotLoad).
    lora_slots: list[int] = field(default_factory=list)
    lora_loads: list[tuple[int, "LoRASlotLoad"]] = field(default_factory=list)

    def add_row(self, seq_id: int, new_token_ids: list[int], num_computed_tokens: int,
                num_scheduled_tokens: int, do_sample: bool) -> None:
        self.seq_ids.append(seq_id)
        self.new_token_ids.append(new_token_ids)
        self.num_computed_tokens.append(num_computed_tokens)
        self.num_scheduled_tokens.append(num_scheduled_tokens)
        self.do_sample.append(do_sample)

    @property
    def num_rows(self) -> int:
        return len(self.seq_ids)


# Per predicted prompt token: (logprob, rank, top-k logprobs).
PromptLogprobs = list[tuple[float, int, dict[int, float]]]


@dataclass
class SampleResult:
    token_id: int
    logprob: float  # log_softmax of the raw model logits at token_id
    rank: int  # 1 = most likely under the raw logits; 0 (not computed) unless logprobs asked
    top_logprobs: dict[int, float]  # top `params.logprobs` tokens of the raw logits


@dataclass
class StepResult:
    seq_ids: list[int] = field(default_factory=list)  # the sampled rows, in batch order
    num_samples: list[int] = field(default_factory=list)  # per row
    num_logprobs: list[int] = field(default_factory=list)  # top logprobs asked for, per row
    # Per step and sample (the rows' num_samples in batch order), host arrays: the token id
    # (int64), its logprob and rank [num_steps, samples]; the top alternatives' ids (int64)
    # and logprobs [num_steps, samples, k], k the most any row asked for (a row reads the
    # first num_logprobs of its own). None: nothing was sampled.
    token_ids: np.ndarray | None = None
    logprobs: np.ndarray | None = None
    ranks: np.ndarray | None = None
    top_token_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)  # by seq_id
    # Speculative rows: seq_id -> (tokens it gets this step, 1..k+1; proposals scored, k).
    # Such a row's num_samples entries are its k+1 positions in order, the first
    # num_spec_tokens of them the tokens to append (not forks).
    num_spec_tokens: dict[int, tuple[int, int]] = field(default_factory=dict)
    # Pooling rows whose prompt is complete: seq_id -> the pooled vector, fp32 [hidden]
    # (not normalized; layers/pooler.py).
    pooled: dict[int, np.ndarray] = field(default_factory=dict)

    @property
    def num_steps(self) -> int:
        return 0 if self.token_ids is None else self.token_ids.shape[0]

    def set_packed(self, packed: np.ndarray) -> None:
        """The sampler's packed rows [num_steps, samples, 3 + 2k] (per sample: token id,
        logprob, rank, k top ids, k top logprobs; layers/sampler.py) as the named arrays."""
        k = (packed.shape[2] - 3) // 2
        self.token_ids = packed[:, :, 0].astype(np.int64)
        self.logprobs = np.ascontiguousarray(packed[:, :, 1])
        self.ranks = packed[:, :, 2].astype(np.int64)
        self.top_token_ids = packed[:, :, 3:3 + k].astype(np.int64)
        self.top_logprobs = np.ascontiguousarray(packed[:, :, 3 + k:3 + 2 * k])

    def samples(self) -> list[dict[int, list[SampleResult]]]:
        """Per step: seq_id -> its samples (several only at a first best_of sample)."""
        if self.token_ids is None:
            return []
        token_ids, logprobs, ranks = (a.tolist() for a in (self.token_ids, self.logprobs,
                                                           self.ranks))
        top_ids, top_logprobs = self.top_token_ids.tolist(), self.top_logprobs.tolist()
        out = []
        for step in range(self.num_steps):
            index = 0
            samples: dict[int, list[SampleResult]] = {}
            for seq_id, n, k in zip(self.seq_ids, self.num_samples, self.num_logprobs):
                samples[seq_id] = [SampleResult(
                    token_ids[step][j], logprobs[step][j], ranks[step][j],
                    dict(zip(top_ids[step][j][:k], top_logprobs[step][j][:k])) if k else {},
                ) for j in range(index, index + n)]
                index += n
            out.append(samples)
        return out


@dataclass
class SpecStats:
    """Speculative decoding since the engine started."""

    num_draft_tokens: int = 0  # proposals scored
    num_accepted_tokens: int = 0  # proposals accepted
    num_verified_rows: int = 0  # rows verified (each also gets one token of the target's own)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        self.num_verified_rows += 1


@dataclass(frozen=True)
class WorkerInfo:
    """What the engine needs to know of the worker, decided once as the worker starts."""

    num_gpu_blocks: int
    num_cpu_blocks: int
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    eos_token_ids: tuple[int, ...]
    on_cuda: bool  # the inputs live on a GPU (multi-step and async scheduling pay off)
    # Constrained decode windows: masks handed over with `sample`, sub-step by sub-step (the
    # single-process worker); False: a window with constrained rows is one step, its masks
    # in the batch (and a speculative step's too).
    defers_token_bitmask: bool
    weight_bytes: int  # the model's weights as stored (packed GGUF / FP8 count as such)
    source_name: str  # the model's name, as the server answers to it by default


@dataclass
class GrammarMasks:
    """The allowed tokens of a step's constrained rows, handed to `Executor.sample`.

    `bitmask`: packed int32 [len(rows), ceil(vocab / 32)] host tensor, bit t % 32 of word
    t // 32 set = token t allowed; `rows`: the indices, among the step's sampled rows, of
    the rows it constrains. These are the first sub-step's masks; in a decode window each
    later sub-step's come from `next(token_ids)`, the sub-step before's sampled ids (host
    int64 [samples]) advancing the engine's grammars."""

    bitmask: Any
    rows: list[int]
    next: Callable[[np.ndarray], "GrammarMasks"] | None = None


class StepHandle(Protocol):
    """An executed step whose samples are not drawn yet: what `execute` returns and
    `sample` takes (opaque to the engine)."""


class Executor(Protocol):
    """What the engine drives, in two calls per step as vLLM v1's execute_model and
    sample_tokens: the single-process worker, the tensor-parallel group
    (worker/executor.create_executor makes the one the arguments ask for), or a fake.
    A decode window's sub-steps (num_steps > 1) are the executor's own business."""

    def info(self) -> WorkerInfo: ...

    def execute(self, batch: StepBatch) -> StepHandle:
        """Apply the batch and queue its forward. A batch whose masks come with `sample`
        (defer_token_bitmask) stops there; any other is sampled too, every sub-step of
        its window queued, so the next batch may be executed before `sample` (async
        scheduling: its input ids are these samples, still on the device)."""
        ...

    def sample(self, handle: StepHandle, masks: GrammarMasks | None) -> StepResult:
        """The step's StepResult, its samples on the host (this call waits for them)."""
        ...

    def shutdown(self) -> None: ...
