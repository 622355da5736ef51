"""ModelRunner: turns a SchedulerOutput into one model forward and samples the next tokens.

Inputs are gathered once per step on the host (StepBatch), then either copied into a
captured CUDA graph's static buffers (a decode step, see cuda_graphs.py) or built into
PagedAttentionInputMetadata on the input device (eager; the model's forward copies it once
to each later device group). Host-to-device copies go from pinned memory without
blocking, so the host never waits for the device before the sampler's one transfer back.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from pagedllm.engine.scheduler import SchedulerOutput
from pagedllm.engine.sequence import SequenceGroup, SequenceStatus
from pagedllm.kernels.metadata import PagedAttentionInputMetadata, host_to_device, slots_for
from pagedllm.layers.sampler import Sampler, SampleResult, SamplingRow, compute_prompt_logprobs
from pagedllm.worker.cuda_graphs import DecodeCUDAGraphs
from pagedllm.models.device_map import DeviceMap


@dataclass
class StepBatch:
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
    # request_id -> (first logits row, number of rows, the prompt tokens they predict, top-k)
    prompt_logprob_rows: dict[str, tuple[int, int, list[int], int]] = field(default_factory=dict)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)

    def next_decode_step(self, block_size: int) -> "StepBatch":
        """The same decode batch one token further on (multi-step): positions, context lengths
        and slots advance by one, in blocks the scheduler reserved ahead. The input ids of
        the new step are the last step's samples, still on the device."""
        positions = [p + 1 for p in self.positions]
        return StepBatch(
            input_ids=self.input_ids,  # placeholders of the right length
            positions=positions,
            slot_mapping=[t[p // block_size] * block_size + p % block_size
                          for t, p in zip(self.block_tables, positions)],
            query_lens=self.query_lens,
            seq_lens=[n + 1 for n in self.seq_lens],
            block_tables=self.block_tables,
            logits_indices=self.logits_indices,
            sample_rows=self.sample_rows,
        )


@dataclass
class ModelInput:
    """The eager forward's device inputs."""

    input_ids: torch.Tensor
    metadata: dict[torch.device, PagedAttentionInputMetadata]


@dataclass
class StepResult:
    samples: dict[int, list[SampleResult]]  # seq_id -> samples (best_of at a first sample)
    # request_id -> per predicted prompt token: (logprob, rank, top-k)
    prompt_logprobs: dict[str, list[tuple[float, int, dict[int, float]]]]


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        block_size: int,
        eos_token_ids: list[int],
        layer_devices: list[torch.device],
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.layer_devices = layer_devices
        self.input_device = layer_devices[0]
        self.sampler = Sampler(eos_token_ids)
        self.graphs: DecodeCUDAGraphs | None = None  # set by enable_cuda_graphs

    def enable_cuda_graphs(self, max_num_seqs: int, max_model_len: int, num_kv_heads: int,
                           head_dim: int, dtype: torch.dtype) -> DecodeCUDAGraphs:
        """Set up decode graphs (static buffers now; capture once the KV cache exists)."""
        self.graphs = DecodeCUDAGraphs(self.model, DeviceMap.from_layer_devices(self.layer_devices),
                                       max_num_seqs, max_model_len, self.block_size,
                                       num_kv_heads, head_dim, dtype)
        return self.graphs

    # ----------------------------------------------------------------- inputs
    def gather(self, out: SchedulerOutput) -> StepBatch:
        b = StepBatch()
        prompt_indices: list[int] = []
        sample_indices: list[int] = []
        bs = self.block_size
        for scheduled in out.scheduled_seq_groups:
            group, chunk = scheduled.seq_group, scheduled.token_chunk_size
            params = group.sampling_params
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                start = seq.num_computed_tokens
                table = out.block_tables[seq.seq_id]
                first = len(b.input_ids)
                b.input_ids += seq.token_slice(start, start + chunk)
                b.positions += range(start, start + chunk)
                b.slot_mapping += slots_for(table, start, start + chunk, bs)
                b.query_lens.append(chunk)
                b.seq_lens.append(start + chunk)
                b.block_tables.append(table)
                prompt_len = seq.get_prompt_len()
                if params.prompt_logprobs is not None and start + 1 < prompt_len:
                    # Logits at position p predict prompt token p + 1.
                    end = min(start + chunk, prompt_len - 1)
                    b.prompt_logprob_rows[group.request_id] = (
                        len(prompt_indices), end - start, seq.token_slice(start + 1, end + 1),
                        params.prompt_logprobs,
                    )
                    prompt_indices += range(first, first + end - start)
                if scheduled.do_sample:
                    sample_indices.append(first + chunk - 1)
                    b.sample_rows.append((seq.seq_id, self._sampling_row(group, seq)))
        b.logits_indices = prompt_indices + sample_indices
        return b

    def prepare_input(self, b: StepBatch, input_ids: torch.Tensor | None = None) -> ModelInput:
        """The eager path's device tensors, on the input device (the model's forward copies
        the metadata once to each later device group). `input_ids`: already on the device."""
        meta = PagedAttentionInputMetadata.build(
            b.positions, b.slot_mapping, b.query_lens, b.seq_lens, b.block_tables,
            device=self.input_device,
        )
        if input_ids is None:
            input_ids = host_to_device(b.input_ids, torch.long, self.input_device)
        return ModelInput(input_ids.to(self.input_device), {self.input_device: meta})

    @staticmethod
    def _sampling_row(group: SequenceGroup, seq) -> SamplingRow:
        first_sample = seq.get_output_len() == 0 and group.num_seqs() == 1
        return SamplingRow(
            params=group.sampling_params,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_token_ids,
            num_samples=group.max_num_samples if first_sample else 1,
            generator=seq.generator,
        )

    # ---------------------------------------------------------------- execution
    def uses_graph(self, b: StepBatch) -> bool:
        return self.graphs is not None and self.graphs.can_run(
            b.max_query_len, len(b.input_ids), len(b.query_lens)
        )

    def forward(self, b: StepBatch, kv_caches: list[torch.Tensor],
                input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states of every token of the step, [num_tokens, hidden]. `input_ids`, when
        given, replaces b.input_ids with a device tensor (multi-step)."""
        if self.uses_graph(b):
            ids = b.input_ids if input_ids is None else input_ids
            return self.graphs.run(ids, b.positions, b.slot_mapping, b.seq_lens, b.block_tables)
        inp = self.prepare_input(b, input_ids)
        return self.model(inp.input_ids, kv_caches, inp.metadata)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, kv_caches: list[torch.Tensor]) -> StepResult:
        b = self.gather(out)
        hidden = self.forward(b, kv_caches)
        if not b.logits_indices:
            return StepResult({}, {})
        logits = self.model.compute_logits(self._select_rows(hidden, b.logits_indices))
        prompt_logprobs = {}
        for request_id, (row, count, targets, k) in b.prompt_logprob_rows.items():
            prompt_logprobs[request_id] = compute_prompt_logprobs(
                logits[row: row + count], targets, k
            )
        num_prompt_rows = len(b.logits_indices) - len(b.sample_rows)
        results = self.sampler(logits[num_prompt_rows:], [row for _, row in b.sample_rows])
        samples = {seq_id: res for (seq_id, _), res in zip(b.sample_rows, results)}
        return StepResult(samples, prompt_logprobs)

    @torch.inference_mode()
    def execute_multi_step(self, out: SchedulerOutput, kv_caches: list[torch.Tensor],
                           num_steps: int) -> list[StepResult]:
        """`num_steps` decode steps of one batch, back to back on the device: each step's
        samples are the next step's input ids without a trip to the host, and all steps'
        results come back in one transfer at the end. The scheduler reserved the slots; the
        batch is decode-only, one sample per row, no row reads its output history (see
        LLMEngine._multi_step_size)."""
        b = self.gather(out)
        rows = [row for _, row in b.sample_rows]
        batches = []
        input_ids = None
        for step in range(num_steps):
            if step:
                b = b.next_decode_step(self.block_size)
            hidden = self.forward(b, kv_caches, input_ids)
            batch = self.sampler.sample(self.model.compute_logits(hidden), rows)
            batches.append(batch)
            input_ids = batch.token_ids
        packed = torch.cat([x.packed for x in batches]).cpu().tolist()
        n = len(rows)
        results = []
        for step, batch in enumerate(batches):
            samples = batch.results(packed[step * n: (step + 1) * n])
            results.append(StepResult(
                {seq_id: res for (seq_id, _), res in zip(b.sample_rows, samples)}, {}))
        return results

    @staticmethod
    def _select_rows(hidden: torch.Tensor, indices: list[int]) -> torch.Tensor:
        if indices == list(range(hidden.shape[0])):  # decode: every row, in order
            return hidden
        return hidden.index_select(0, host_to_device(indices, torch.long, hidden.device))
