"""ModelRunner: turns a SchedulerOutput into one model forward and samples the next tokens.

Inputs are prepared once per step on the host, then copied once to each device that holds
layers (PagedAttentionInputMetadata.to); a layer reads its own device's copy.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from pagedllm.engine.scheduler import SchedulerOutput
from pagedllm.engine.sequence import SequenceGroup, SequenceStatus
from pagedllm.layers.metadata import PagedAttentionInputMetadata
from pagedllm.layers.sampler import Sampler, SampleResult, SamplingRow, compute_prompt_logprobs


@dataclass
class ModelInput:
    input_ids: torch.Tensor
    metadata: dict[torch.device, PagedAttentionInputMetadata]
    # Flat token indices whose logits we need, and what each is for.
    logits_indices: list[int]
    sample_rows: list[tuple[int, SamplingRow]]  # (seq_id, row); row i uses logits row i
    # request_id -> (first logits row, number of rows, the prompt tokens they predict, top-k)
    prompt_logprob_rows: dict[str, tuple[int, int, list[int], int]] = field(default_factory=dict)


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
        self.devices = list(dict.fromkeys(layer_devices))  # distinct, in layer order
        self.input_device = layer_devices[0]
        self.sampler = Sampler(eos_token_ids)

    def prepare_input(self, out: SchedulerOutput) -> ModelInput:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        prompt_indices: list[int] = []  # logits rows for prompt_logprobs come first,
        sample_indices: list[int] = []  # then one row per sampled sequence
        sample_rows: list[tuple[int, SamplingRow]] = []
        prompt_rows: dict[str, tuple[int, int, list[int], int]] = {}
        bs = self.block_size
        for scheduled in out.scheduled_seq_groups:
            group, chunk = scheduled.seq_group, scheduled.token_chunk_size
            params = group.sampling_params
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                start = seq.num_computed_tokens
                tokens = seq.get_token_ids()
                table = out.block_tables[seq.seq_id]
                first = len(ids)
                ids += tokens[start: start + chunk]
                positions += range(start, start + chunk)
                slots += [table[p // bs] * bs + p % bs for p in range(start, start + chunk)]
                query_lens.append(chunk)
                seq_lens.append(start + chunk)
                tables.append(table)
                prompt_len = seq.get_prompt_len()
                if params.prompt_logprobs is not None and start + 1 < prompt_len:
                    # Logits at position p predict prompt token p + 1.
                    end = min(start + chunk, prompt_len - 1)
                    prompt_rows[group.request_id] = (
                        len(prompt_indices), end - start, tokens[start + 1: end + 1],
                        params.prompt_logprobs,
                    )
                    prompt_indices += range(first, first + end - start)
                if scheduled.do_sample:
                    sample_indices.append(first + chunk - 1)
                    sample_rows.append((seq.seq_id, self._sampling_row(group, seq)))
        meta = PagedAttentionInputMetadata.build(
            positions, slots, query_lens, seq_lens, tables, device=self.input_device
        )
        metadata = {self.input_device: meta}
        for device in self.devices:
            if device not in metadata:
                metadata[device] = meta.to(device)
        input_ids = torch.tensor(ids, dtype=torch.long).to(self.input_device, non_blocking=True)
        return ModelInput(
            input_ids, metadata, prompt_indices + sample_indices, sample_rows, prompt_rows
        )

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

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, kv_caches: list[torch.Tensor]) -> StepResult:
        inp = self.prepare_input(out)
        hidden = self.model(inp.input_ids, kv_caches, inp.metadata)
        if not inp.logits_indices:
            return StepResult({}, {})
        index = torch.tensor(inp.logits_indices, device=hidden.device)
        logits = self.model.compute_logits(hidden.index_select(0, index))
        prompt_logprobs = {}
        for request_id, (row, count, targets, k) in inp.prompt_logprob_rows.items():
            prompt_logprobs[request_id] = compute_prompt_logprobs(
                logits[row: row + count], targets, k
            )
        num_prompt_rows = len(inp.logits_indices) - len(inp.sample_rows)
        results = self.sampler(logits[num_prompt_rows:], [row for _, row in inp.sample_rows])
        samples = {seq_id: res for (seq_id, _), res in zip(inp.sample_rows, results)}
        return StepResult(samples, prompt_logprobs)
