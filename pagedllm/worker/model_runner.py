"""ModelRunner: turns a StepBatch into model forwards and samples the next tokens.

It keeps the worker's own state of every sequence (SeqState: tokens, block table, sampling
parameters, generator), built only from the batches' deltas (pagedllm/contract.py). Inputs are
gathered once per step on the host (FlatBatch), then either copied into a captured CUDA
graph's static buffers (a decode step, see cuda_graphs.py) or built into
PagedAttentionInputMetadata on the input device (eager; the model's forward copies it once
to each later device group). Host-to-device copies go from pinned memory without blocking,
and the samples come back in one copy that the caller waits for only when it needs them
(PendingStep), so the engine can prepare the next step meanwhile.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import nn

from pagedllm.kernels.metadata import (
    PagedAttentionInputMetadata, host_to_device, pad_block_tables, slots_for,
)
from pagedllm.layers import pooler
from pagedllm.layers import lora as lora_layer
from pagedllm.layers.lora import LoRARows, lora_rows, num_lora_slots
from pagedllm.layers.sampler import (
    SampledBatch, Sampler, SamplingRow, compute_prompt_logprobs, make_generator,
)
from pagedllm.layers.rejection_sampler import SpecVerifier
from pagedllm.layers.token_bitmask import apply_token_bitmask
from pagedllm.models.device_map import DeviceMap
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker import cuda_graphs
from pagedllm.worker.cuda_graphs import DecodeCUDAGraphs
from pagedllm.contract import GrammarMasks, StepBatch, StepResult


@dataclass(slots=True)
class SeqState:
    """What the worker knows of one sequence: what the engine sent it, nothing more."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    block_table: list[int]
    generator: torch.Generator | None
    pooling: str | None = None  # a pooling sequence ("last" | "mean"): pooled, never sampled
    pooled: torch.Tensor | None = None  # its partial over the chunks computed so far

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) of prompt + output."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p: end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]


@dataclass
class FlatBatch:
    """One step's flat batch, as host lists."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    # Flat token indices whose logits we need: prompt_logprobs rows first, then one row per
    # sampled sequence.
    logits_indices: list[int] = field(default_factory=list)
    sample_rows: list[tuple[int, SamplingRow]] = field(default_factory=list)  # (seq_id, row)
    # seq_id -> (first logits row, number of rows, the prompt tokens they predict, top-k)
    prompt_logprob_rows: dict[int, tuple[int, int, list[int], int]] = field(default_factory=dict)
    # (flat index, index into the last step's samples): input ids still on the device.
    from_last_samples: list[tuple[int, int]] = field(default_factory=list)
    # Speculative rows, (seq_id, row, proposals): their k+1 logits rows come last.
    spec_rows: list[tuple[int, SamplingRow, list[int]]] = field(default_factory=list)
    # Pooling rows, (seq_id, first flat index, rows, first position, the prompt's last chunk).
    pool_rows: list[tuple[int, int, int, int, bool]] = field(default_factory=list)
    # block_tables padded into host tensors, by (rows, pinned): made once for all the steps
    # of a decode window, which share the tables (next_decode_step passes this on).
    padded: dict[tuple[int, bool], torch.Tensor] = field(default_factory=dict, repr=False)

    def padded_block_tables(self, num_rows: int | None = None, pin: bool = False) -> torch.Tensor:
        """block_tables as a [num_rows, widest] int32 host tensor (pad_block_tables), page
        locked with `pin`; the same tensor for every step that shares these tables."""
        key = (num_rows or len(self.block_tables), pin)
        tables = self.padded.get(key)
        if tables is None:
            tables = pad_block_tables(self.block_tables, key[0])
            tables = self.padded[key] = tables.pin_memory() if pin else tables
        return tables

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)

    def as_decode_rows(self) -> "FlatBatch":
        """The same step with each row of q tokens split into q rows of one token, the j-th
        attending to the cache up to its own position (all of the step's K/V is written
        before any row attends): a speculative step's k+1 tokens per sequence then run
        through the decode kernels and the decode CUDA graphs, as plain decoding does. The
        flat token order, and so the logits rows, stay the same."""
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        for q, n, table in zip(self.query_lens, self.seq_lens, self.block_tables):
            seq_lens += range(n - q + 1, n + 1)
            tables += [table] * q
        return replace(self, query_lens=[1] * len(self.input_ids), seq_lens=seq_lens,
                       block_tables=tables, padded={})

    def next_decode_step(self, block_size: int) -> "FlatBatch":
        """The same decode batch one token further on (multi-step): positions, context lengths
        and slots advance by one, in blocks the scheduler reserved ahead. The input ids of
        the new step are the last step's samples, still on the device."""
        positions = [p + 1 for p in self.positions]
        return FlatBatch(
            input_ids=self.input_ids,  # placeholders of the right length
            positions=positions,
            slot_mapping=[t[p // block_size] * block_size + p % block_size
                          for t, p in zip(self.block_tables, positions)],
            query_lens=self.query_lens,
            seq_lens=[n + 1 for n in self.seq_lens],
            block_tables=self.block_tables,
            logits_indices=self.logits_indices,
            sample_rows=self.sample_rows,
            padded=self.padded,
        )


@dataclass
class ModelInput:
    """The eager forward's device inputs."""

    input_ids: torch.Tensor
    metadata: dict[torch.device, PagedAttentionInputMetadata]


class _HostCopy:
    """A device tensor copied into pinned host memory behind the kernels that make it (on
    CUDA; a host tensor is its own copy): `get()` blocks on that copy alone."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._host, self._event = tensor, None
        if tensor.is_cuda:
            with torch.cuda.device(tensor.device):
                self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                self._host.copy_(tensor, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record()

    def get(self) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host


class PendingStep:
    """An executed step: its StepResult is complete once `sample()` (or `wait()`) returns. On
    CUDA the samples are copied into pinned host memory behind the step's kernels; waiting
    blocks on that copy alone."""

    # A decode window whose masks come with sample() samples sub-step by sub-step then.
    awaits_bitmask = False

    def __init__(self, result: StepResult, sampled: torch.Tensor | None = None) -> None:
        self._result = result
        self._copy = None if sampled is None else _HostCopy(sampled)

    def sample(self, masks: GrammarMasks | None) -> StepResult:
        """Executor.sample: the samples, drawn already (no masks to wait for)."""
        return self.wait()

    def wait(self) -> StepResult:
        if self._copy is not None:
            self._result.set_packed(self._copy.get().numpy())
        return self._result


class DecodeWindow(PendingStep):
    """An executed step's sampling and, in multi-step, its further decode steps (sub-steps),
    each fed the samples of the one before on the device.

    Without grammar masks every sub-step is queued at execute. A batch whose masks come
    with sample() (defer_token_bitmask) samples there sub-step by sub-step: the first under
    the masks handed over, each later one under `masks.next(the sub-step before's samples)`.
    Each sub-step's forward is queued before its masks are asked for, so the engine fills
    them while the device runs it; the scheduling, the batch and the update are paid once
    per window, as without masks."""

    def __init__(self, runner: "ModelRunner", batch: StepBatch, b: FlatBatch,
                 logits: torch.Tensor, result: StepResult, kv_caches: list[torch.Tensor]) -> None:
        if batch.token_bitmask is not None and batch.num_steps > 1:
            raise ValueError("a batch carrying its token bitmask runs one step; a decode "
                             "window's masks come with sample (defer_token_bitmask)")
        self._runner, self._b, self._kv_caches = runner, b, kv_caches
        self._result = result
        self.num_steps = batch.num_steps
        self._rows = [row for _, row in b.sample_rows]
        self._logits = logits[len(b.logits_indices) - len(self._rows):]
        self._stepped = batch.defer_token_bitmask
        self._steps: list[SampledBatch] = []
        self._copies: list[_HostCopy] = []  # stepped: each sub-step's samples, on the host
        self._done: PendingStep | None = None
        if not self._stepped:
            self.sample_with_bitmask(batch.token_bitmask, batch.token_bitmask_rows)
            while self.awaits_bitmask:
                self.sample_with_bitmask(None, [])

    @property
    def awaits_bitmask(self) -> bool:
        """Sub-steps are left to sample (a stepped window before sample())."""
        return len(self._steps) < self.num_steps

    def sample(self, masks: GrammarMasks | None) -> StepResult:
        if self.awaits_bitmask:
            if masks is None:
                raise ValueError("this step waits for its grammar masks (defer_token_bitmask)")
            self.sample_with_bitmask(masks.bitmask, masks.rows)
            while self.awaits_bitmask:
                masks = masks.next(self._last_samples())
                self.sample_with_bitmask(masks.bitmask, masks.rows)
        return self.wait()

    @torch.inference_mode()
    def sample_with_bitmask(self, token_bitmask: Any, rows: list[int]) -> None:
        """Sample the next sub-step, `token_bitmask` applied to its `rows` (indices among
        the sampled rows; None: no mask), then queue the forward of the one after."""
        if not self.awaits_bitmask:
            raise ValueError("this step's samples were already drawn")
        runner, k = self._runner, len(self._steps)
        if token_bitmask is not None:  # structured output: refused tokens get -inf
            apply_token_bitmask(self._logits, token_bitmask, rows)
        sampled = runner.sampler.sample(self._logits, self._rows, steps_ahead=k)
        self._steps.append(sampled)
        if self._stepped:
            self._copies.append(_HostCopy(sampled.packed))
        if k + 1 < self.num_steps:
            self._b = self._b.next_decode_step(runner.block_size)
            hidden = runner.forward(self._b, self._kv_caches, sampled.token_ids)
            self._logits = runner.model.compute_logits(hidden)
            return
        result = self._result
        result.seq_ids = [seq_id for seq_id, _ in self._b.sample_rows]
        result.num_samples = [row.num_samples for row in self._rows]
        result.num_logprobs = self._steps[0].num_top
        runner._last_sampled = (result.seq_ids, result.num_samples, sampled.token_ids)
        runner._open_window = None
        self._logits = None
        if not self._stepped:
            self._done = PendingStep(result, _stack_packed(self._steps))

    def _last_samples(self) -> np.ndarray:
        """The latest sub-step's sampled token ids on the host, int64 [samples]."""
        return self._copies[-1].get()[:, 0].numpy().astype(np.int64)

    def wait(self) -> StepResult:
        if self.awaits_bitmask:
            raise ValueError("the step waits for its grammar masks (sample)")
        if self._done is not None:
            return self._done.wait()
        self._result.set_packed(torch.stack([c.get() for c in self._copies]).numpy())
        return self._result


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        block_size: int,
        eos_token_ids: list[int],
        layer_devices: list[torch.device],
        logits_device: torch.device | None = None,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.layer_devices = layer_devices
        self.input_device = layer_devices[0]
        self.logits_device = logits_device or layer_devices[-1]
        self.sampler = Sampler(eos_token_ids)
        self.verifier = SpecVerifier(self.sampler)
        # The draft model of speculative decoding (worker/draft_model.py), when configured.
        self.drafter = None
        self.graphs: DecodeCUDAGraphs | None = None  # set by enable_cuda_graphs
        # The launched step's LoRA token rows (worker/lora_manager.py; None: base only),
        # for every forward of the step (a decode window's sub-steps have the same rows).
        self.lora_rows: LoRARows | None = None
        self.seqs: dict[int, SeqState] = {}
        # The last launched step's samples (async scheduling reads a row's input id from
        # them): the sampled seq ids, samples per row, and the last step's token ids.
        self._last_sampled: tuple[list[int], list[int], torch.Tensor] | None = None
        # A launched decode window still waiting for token bitmasks (DecodeWindow).
        self._open_window: DecodeWindow | None = None

    def enable_cuda_graphs(self, max_num_seqs: int, max_model_len: int, num_kv_heads: int,
                           head_dim: int, dtype: torch.dtype) -> DecodeCUDAGraphs:
        """Set up decode graphs (static buffers now; capture once the KV cache exists). With
        adapters attached, a LoRA set too, unless PAGEDLLM_LORA_GRAPHS=0 or the torch LoRA
        path is forced (PAGEDLLM_LORA_TRITON=0: the graphs run the Triton pair)."""
        lora_slots = num_lora_slots(self.model) \
            if cuda_graphs.LORA_GRAPHS and lora_layer.USE_TRITON else 0
        self.graphs = DecodeCUDAGraphs(self.model, DeviceMap.from_layer_devices(self.layer_devices),
                                       max_num_seqs, max_model_len, self.block_size,
                                       num_kv_heads, head_dim, dtype, lora_slots)
        return self.graphs

    # ------------------------------------------------------------------ state
    def _generator(self, seed: int | None) -> torch.Generator | None:
        return None if seed is None else make_generator(seed, self.logits_device)

    def apply(self, batch: StepBatch) -> None:
        """Update the per-sequence state from the batch: new sequences, forks, freed
        sequences, then each row's new tokens and block-table changes."""
        seqs = self.seqs
        for new in batch.new_seqs:
            seqs[new.seq_id] = SeqState(new.sampling_params, list(new.prompt_token_ids), [], [],
                                        self._generator(new.seed), new.pooling)
        for fork in batch.forks:
            parent = self._state(fork.parent_seq_id)
            seqs[fork.child_seq_id] = SeqState(
                parent.params, parent.prompt_token_ids, list(parent.output_token_ids),
                list(parent.block_table), self._generator(fork.seed))
        for seq_id in batch.freed_seq_ids:
            seqs.pop(seq_id, None)
        # Plain indexing in the per-row loops (they run for every sequence every step); an
        # unknown id becomes the clear error.
        try:
            for seq_id, tokens in zip(batch.seq_ids, batch.new_token_ids):
                if tokens:
                    seqs[seq_id].output_token_ids += tokens
            for seq_id, (start, ids) in batch.block_tables.items():
                seqs[seq_id].block_table[start:] = ids
        except KeyError as missing:
            raise _unknown(missing.args[0]) from None

    def _state(self, seq_id: int) -> SeqState:
        state = self.seqs.get(seq_id)
        if state is None:
            raise _unknown(seq_id)
        return state

    # ----------------------------------------------------------------- inputs
    def gather(self, batch: StepBatch, spec: dict[int, list[int]] | None = None) -> FlatBatch:
        """`spec`: the speculative rows' proposals (batch.spec_token_ids and the draft
        model's); such a row's input is its known tokens, then the proposals."""
        b = FlatBatch()
        prompt_indices: list[int] = []
        sample_indices: list[int] = []
        spec_indices: list[int] = []
        bs = self.block_size
        seqs = self.seqs
        num_samples = batch.num_samples
        last_index: dict[int, int] | None = None
        for i, seq_id in enumerate(batch.seq_ids):
            st = seqs.get(seq_id) or self._state(seq_id)
            start = batch.num_computed_tokens[i]
            chunk = batch.num_scheduled_tokens[i]
            end = start + chunk
            table = st.block_table
            first = len(b.input_ids)
            prompt_len = len(st.prompt_token_ids)
            proposals = spec.get(seq_id) if spec else None
            last_index = self._gather_input_ids(b, seq_id, st, start, chunk, proposals,
                                                last_index)
            b.positions += range(start, end)
            b.slot_mapping += slots_for(table, start, end, bs)
            b.query_lens.append(chunk)
            b.seq_lens.append(end)
            b.block_tables.append(table)
            params = st.params
            if st.pooling is not None:
                b.pool_rows.append((seq_id, first, chunk, start, batch.do_sample[i]))
                continue
            if params.prompt_logprobs is not None and start + 1 < prompt_len:
                # Logits at position p predict prompt token p + 1.
                last = min(end, prompt_len - 1)
                b.prompt_logprob_rows[seq_id] = (
                    len(prompt_indices), last - start, st.token_slice(start + 1, last + 1),
                    params.prompt_logprobs,
                )
                prompt_indices += range(first, first + last - start)
            if proposals is not None and batch.do_sample[i]:
                spec_indices += range(first + chunk - len(proposals) - 1, first + chunk)
                b.spec_rows.append((seq_id, SamplingRow(
                    params=params, prompt_token_ids=st.prompt_token_ids,
                    output_token_ids=st.output_token_ids, generator=st.generator,
                ), proposals))
            elif batch.do_sample[i]:
                sample_indices.append(first + chunk - 1)
                b.sample_rows.append((seq_id, SamplingRow(
                    params=params,
                    prompt_token_ids=st.prompt_token_ids,
                    output_token_ids=st.output_token_ids,
                    num_samples=num_samples.get(seq_id, 1) if num_samples else 1,
                    generator=st.generator,
                    num_output_tokens=end - prompt_len,
                )))
        b.logits_indices = prompt_indices + sample_indices + spec_indices
        return b

    def _gather_input_ids(self, b: FlatBatch, seq_id: int, st: SeqState, start: int, chunk: int,
                          proposals: list[int] | None,
                          last_index: dict[int, int] | None) -> dict[int, int] | None:
        """A row's input ids into `b`: its known tokens (then its proposals), or the last
        launched step's sample still on the device; returns `last_index`, made if needed."""
        end = start + chunk
        num_known = len(st.prompt_token_ids) + len(st.output_token_ids)
        if proposals is not None:
            b.input_ids += st.token_slice(start, end - len(proposals))
            b.input_ids += proposals
        elif end <= num_known:
            b.input_ids += st.token_slice(start, end)
        else:
            if last_index is None:
                last_index = self._last_sample_index()
            b.from_last_samples.append((len(b.input_ids), self._pending_input(
                seq_id, start, chunk, num_known, last_index)))
            b.input_ids.append(0)
        return last_index

    def _last_sample_index(self) -> dict[int, int]:
        """seq_id -> index of its (first) sample among the last launched step's samples."""
        if self._last_sampled is None:
            return {}
        seq_ids, counts, _ = self._last_sampled
        index, offset = {}, 0
        for seq_id, n in zip(seq_ids, counts):
            index[seq_id] = offset
            offset += n
        return index

    @staticmethod
    def _pending_input(seq_id: int, start: int, chunk: int, num_known: int,
                       last_index: dict[int, int]) -> int:
        """Async scheduling: a decode token the engine has not sent yet must be the sample
        the last launched step drew for this sequence."""
        if chunk != 1 or start < num_known or seq_id not in last_index:
            raise ValueError(
                f"sequence {seq_id}: tokens [{start}, {start + chunk}) were never sent to the "
                f"worker (it holds {num_known}) and are not the last step's sample"
            )
        return last_index[seq_id]

    def _device_input_ids(self, b: FlatBatch) -> torch.Tensor | None:
        """The input ids as a device tensor when some come from the last step's samples
        (else None: the host list is copied as it is)."""
        if not b.from_last_samples:
            return None
        last = self._last_sampled[2].to(self.input_device)
        dst, src = zip(*b.from_last_samples)
        if len(dst) == len(b.input_ids) == len(last) and src == tuple(range(len(src))):
            return last  # every row decodes the last step's samples, in order
        ids = host_to_device(b.input_ids, torch.long, self.input_device)
        ids[host_to_device(dst, torch.long, self.input_device)] = \
            last[host_to_device(src, torch.long, self.input_device)]
        return ids

    def prepare_input(self, b: FlatBatch, input_ids: torch.Tensor | None = None) -> ModelInput:
        """The eager path's device tensors, on the input device (the model's forward copies
        the metadata once to each later device group). `input_ids`: already on the device."""
        meta = PagedAttentionInputMetadata.build(
            b.positions, b.slot_mapping, b.query_lens, b.seq_lens, b.block_tables,
            device=self.input_device, padded_tables=b.padded_block_tables(),
        )
        if input_ids is None:
            input_ids = host_to_device(b.input_ids, torch.long, self.input_device)
        return ModelInput(input_ids.to(self.input_device), {self.input_device: meta})

    # ---------------------------------------------------------------- execution
    def uses_graph(self, b: FlatBatch) -> bool:
        # A step with adapter rows needs the graphs' LoRA set.
        lora = self.lora_rows is not None and self.lora_rows.has_adapters
        return self.graphs is not None and self.graphs.can_run(
            b.max_query_len, len(b.input_ids), len(b.query_lens), lora
        )

    def forward(self, b: FlatBatch, kv_caches: list[torch.Tensor],
                input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states of every token of the step, [num_tokens, hidden]. `input_ids`, when
        given, replaces b.input_ids with a device tensor (multi-step, async scheduling)."""
        if self.uses_graph(b):
            ids = b.input_ids if input_ids is None else input_ids
            return self.graphs.run(ids, b.positions, b.slot_mapping, b.seq_lens, b.block_tables,
                                   b.padded_block_tables, self.lora_rows)
        inp = self.prepare_input(b, input_ids)
        with lora_rows(self.lora_rows):
            return self.model(inp.input_ids, kv_caches, inp.metadata)

    @torch.inference_mode()
    def launch(self, batch: StepBatch, kv_caches: list[torch.Tensor]) -> PendingStep:
        """Apply the batch, then queue its forward(s) and sampling. A multi-step batch
        (`num_steps > 1`, decode only: one sample per row, no row reading its own output)
        runs its steps back to back, each step's samples the next step's input ids without
        a trip to the host; all steps' samples come back in one transfer, or, under token
        bitmasks, one per step as the engine fills the next step's masks (DecodeWindow)."""
        if self._open_window is not None:
            raise ValueError("the last executed step still waits for its grammar masks "
                             "(sample): its samples come before the next step")
        self.apply(batch)
        spec, draft_probs = batch.spec_token_ids, {}
        if self.drafter is not None:
            # The draft model's cache follows every row; it proposes for the rows that ask.
            drafted = self.drafter.propose(batch, self.seqs)
            if drafted:
                spec = {**spec, **{i: tokens for i, (tokens, _) in drafted.items()}}
                draft_probs = {i: q for i, (_, q) in drafted.items()}
        if not batch.seq_ids:
            return PendingStep(StepResult())
        b = self.gather(batch, spec)
        if b.spec_rows and b.max_query_len <= 1 + max(len(p) for _, _, p in b.spec_rows):
            b = b.as_decode_rows()  # no prompt chunk in the step: k+1 decode rows per sequence
        input_ids = self._device_input_ids(b)
        self._last_sampled = None
        hidden = self.forward(b, kv_caches, input_ids)
        result = StepResult()
        if b.pool_rows:
            result.pooled = self._pool(hidden, b.pool_rows)
        if not b.logits_indices:
            return PendingStep(result)
        logits = self.model.compute_logits(self._select_rows(hidden, b.logits_indices))
        for seq_id, (row, count, targets, k) in b.prompt_logprob_rows.items():
            result.prompt_logprobs[seq_id] = compute_prompt_logprobs(
                logits[row: row + count], targets, k
            )
        if b.spec_rows:
            return PendingStep(result, self._verify(batch, b, logits, result, draft_probs))
        if not b.sample_rows:
            return PendingStep(result)
        window = DecodeWindow(self, batch, b, logits, result, kv_caches)
        if window.awaits_bitmask:
            self._open_window = window
        return window

    def _pool(self, hidden: torch.Tensor,
              rows: list[tuple[int, int, int, int, bool]]) -> dict[int, np.ndarray]:
        """Each pooling row's chunk into its sequence's partial; the vectors of the prompts
        this step completes, fp32 on the host (one copy; pooling steps wait for it)."""
        done: dict[int, torch.Tensor] = {}
        for seq_id, first, count, start, last_chunk in rows:
            st = self.seqs[seq_id]
            # A prompt computed from its start again (preempted by recompute) starts over.
            partial = None if start == 0 else st.pooled
            st.pooled = pooler.pool_chunk(st.pooling, hidden[first: first + count], partial)
            if last_chunk:
                done[seq_id] = pooler.finish(st.pooling, st.pooled, start + count)
                st.pooled = None
        if not done:
            return done
        vectors = torch.stack(list(done.values())).float().cpu().numpy()
        return dict(zip(done, vectors))

    def _verify(self, batch: StepBatch, b: FlatBatch, logits: torch.Tensor, result: StepResult,
                draft_probs: dict[int, torch.Tensor | None]) -> torch.Tensor:
        """A step with speculative rows (one step, synchronous): the plain rows sample as
        usual, the speculative rows keep their accepted proposals plus one token. Fills
        `result` but its samples, which it returns ([1, samples, width])."""
        if batch.num_steps != 1:
            raise ValueError("a speculative step runs one step (num_steps must be 1)")
        self._last_sampled = None
        rows = [row for _, row in b.sample_rows]
        num_spec = sum(len(p) + 1 for _, _, p in b.spec_rows)
        first_spec = len(b.logits_indices) - num_spec
        parts, num_top = [], []
        if batch.token_bitmask is not None:
            apply_token_bitmask(logits[first_spec - len(rows): first_spec], batch.token_bitmask,
                                _plain_rows(batch, {seq_id for seq_id, _, _ in b.spec_rows}))
        if rows:
            sampled = self.sampler.sample(logits[first_spec - len(rows): first_spec], rows)
            parts.append(sampled.packed)
            num_top += sampled.num_top
        packed, kept = self.verifier(
            logits[first_spec:], [row for _, row, _ in b.spec_rows],
            [p for _, _, p in b.spec_rows],
            [draft_probs.get(seq_id) for seq_id, _, _ in b.spec_rows])
        parts.append(packed)
        result.seq_ids = [seq_id for seq_id, _ in b.sample_rows] + \
            [seq_id for seq_id, _, _ in b.spec_rows]
        result.num_samples = [row.num_samples for row in rows] + \
            [len(p) + 1 for _, _, p in b.spec_rows]
        num_top += [row.params.logprobs or 0 for _, row, _ in b.spec_rows]
        result.num_logprobs = num_top
        for (seq_id, _, proposals), n in zip(b.spec_rows, kept):
            result.num_spec_tokens[seq_id] = (n, len(proposals))
        if self.drafter is not None:
            self.drafter.accepted({seq_id: n for (seq_id, _, _), n in zip(b.spec_rows, kept)})
        width = max(p.shape[1] for p in parts)
        return torch.cat([_widen(p, width) for p in parts])[None]

    @staticmethod
    def _select_rows(hidden: torch.Tensor, indices: list[int]) -> torch.Tensor:
        if indices == list(range(hidden.shape[0])):  # decode: every row, in order
            return hidden
        return hidden.index_select(0, host_to_device(indices, torch.long, hidden.device))


def _unknown(seq_id: int) -> ValueError:
    return ValueError(f"sequence {seq_id} is not known to the worker (never sent, or freed)")


def _widen(packed: torch.Tensor, width: int) -> torch.Tensor:
    """Packed samples [n, 3 + 2k] -> [n, width] with zero columns after the k top ids and
    after the k top logprobs (unpack_sample reads the first k of each)."""
    if packed.shape[1] == width:
        return packed
    k, extra = (packed.shape[1] - 3) // 2, (width - packed.shape[1]) // 2
    pad = packed.new_zeros(packed.shape[0], extra)
    return torch.cat([packed[:, : 3 + k], pad, packed[:, 3 + k:], pad], dim=1)


def _stack_packed(steps: list[SampledBatch]) -> torch.Tensor:
    """[num_steps, samples, width]: every step's packed samples, one tensor to move."""
    if len(steps) == 1:
        return steps[0].packed[None]
    return torch.stack([s.packed for s in steps])


def _plain_rows(batch: StepBatch, spec_seq_ids: set[int]) -> list[int]:
    """The bitmask's rows (indices among the batch's sampled rows) as indices among the
    sampled rows that are not speculative: a speculative step samples those first."""
    sampled = [s for s, do in zip(batch.seq_ids, batch.do_sample) if do]
    plain = {s: i for i, s in enumerate(s for s in sampled if s not in spec_seq_ids)}
    if any(sampled[r] in spec_seq_ids for r in batch.token_bitmask_rows):
        raise ValueError("a constrained row (token_bitmask) cannot be speculative")
    return [plain[sampled[r]] for r in batch.token_bitmask_rows]
