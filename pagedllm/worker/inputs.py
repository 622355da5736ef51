"""The step contract: the only things handed between engine and worker, as plain data.

The engine sends a StepBatch per step: sequences the worker has not seen yet (once), then per
scheduled sequence the deltas since the worker last saw it (new token ids, block-table
changes, how many tokens to compute), plus forks, freed sequences and cache ops. The worker
keeps its own per-sequence state built from these (worker/model_runner.py: tokens, block
table, sampling parameters, generator) and returns a StepResult: the sampled tokens and
their logprobs in one host tensor. Both are picklable, so with tensor parallelism rank 0 can
send the batch to every rank.

The worker applies a batch in this order: new sequences, forks (a child copies its parent's
state as it was before this batch's deltas), freed ids, each row's new tokens and table
changes; the cache ops (swap out, swap in, copies) run before the forward.

A row's input tokens are its tokens [num_computed_tokens, num_computed_tokens +
num_scheduled_tokens). Async scheduling may launch a step before the engine has seen the
previous step's samples: then a decode row (one token) past the tokens the worker holds takes
its input id from the sample the previous launched step drew for it, still on the device.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.layers.sampler import SampleResult, unpack_sample
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
    # step's masks: each later step samples once the engine hands it its own
    # (DecodeWindow.sample_with_bitmask), filled from the step before's samples.
    token_bitmask: Any = None
    token_bitmask_rows: list[int] = field(default_factory=list)
    # The first step's masks come after the launch too (async scheduling: they need the last
    # step's tokens): the forward is queued at once, the sampling waits for them.
    defer_token_bitmask: bool = False
    # Speculative decoding (a decode row only; its num_scheduled_tokens counts them too):
    # seq_id -> proposed tokens after the row's last token (n-gram, proposed by the engine),
    # or seq_id -> how many tokens the worker's draft model proposes. Such a row's input is
    # its last token plus the proposals; the worker scores every position and keeps the
    # accepted prefix plus one token of its own (StepResult.num_spec_tokens).
    spec_token_ids: dict[int, list[int]] = field(default_factory=dict)
    num_draft_tokens: dict[int, int] = field(default_factory=dict)

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

    @property
    def has_cache_ops(self) -> bool:
        return bool(self.blocks_to_swap_out or self.blocks_to_swap_in or self.blocks_to_copy)


# Per predicted prompt token: (logprob, rank, top-k logprobs).
PromptLogprobs = list[tuple[float, int, dict[int, float]]]


@dataclass
class StepResult:
    seq_ids: list[int] = field(default_factory=list)  # the sampled rows, in batch order
    num_samples: list[int] = field(default_factory=list)  # per row
    num_logprobs: list[int] = field(default_factory=list)  # top logprobs asked for, per row
    # Host float64 [num_steps, sum(num_samples), 3 + 2k]: per sample [token_id, logprob,
    # rank, k top ids, k top logprobs] (see layers/sampler.py).
    sampled: torch.Tensor | None = None
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)  # by seq_id
    # Speculative rows: seq_id -> (tokens it gets this step, 1..k+1; proposals scored, k).
    # Such a row's num_samples entries are its k+1 positions in order, the first
    # num_spec_tokens of them the tokens to append (not forks).
    num_spec_tokens: dict[int, tuple[int, int]] = field(default_factory=dict)
    # Pooling rows whose prompt is complete: seq_id -> the pooled vector, fp32 on the host
    # (not normalized; layers/pooler.py).
    pooled: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def num_steps(self) -> int:
        return 0 if self.sampled is None else self.sampled.shape[0]

    def samples(self) -> list[dict[int, list[SampleResult]]]:
        """Per step: seq_id -> its samples (several only at a first best_of sample)."""
        if self.sampled is None:
            return []
        out = []
        for step in self.sampled.tolist():
            it = iter(step)
            out.append({
                seq_id: [unpack_sample(next(it), k) for _ in range(n)]
                for seq_id, n, k in zip(self.seq_ids, self.num_samples, self.num_logprobs)
            })
        return out
