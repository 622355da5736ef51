"""WorkerLoRA: the worker's side of LoRA. It keeps a host copy of every adapter the engine
registered (checked against the model as it is added), copies adapters into the device
slots the batches name (StepBatch.lora_loads), and turns each batch's per-row slots into
per-token rows for the forward (layers/lora.lora_rows)."""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.contract import LoRASlotLoad, StepBatch
from pagedllm.layers.lora import LoRARows
from pagedllm.lora import LoRAAdapter, LoRARequest, LoRAWeights, load_adapter


class WorkerLoRA:
    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int) -> None:
        self.model, self.max_lora_rank = model, max_lora_rank
        self.weights = LoRAWeights(model, max_loras, max_lora_rank)
        self.adapters: dict[int, LoRAAdapter] = {}  # lora_int_id -> host copy

    def add(self, request: LoRARequest) -> None:
        """Read and check the adapter (a ValueError naming what is wrong), keep it on the host."""
        self.adapters[request.lora_int_id] = load_adapter(request, self.model,
                                                          self.max_lora_rank)

    def remove(self, lora_int_id: int) -> None:
        self.adapters.pop(lora_int_id, None)

    def apply(self, batch: StepBatch) -> LoRARows | None:
        """Load the batch's adapters into their slots; its token rows' slots (None: every
        row is the base model's). A row's tokens are its num_scheduled_tokens, in order."""
        for slot, load in batch.lora_loads:
            self.weights.load(slot, self._adapter(load))
        if not batch.lora_slots:
            return None
        slots = torch.tensor(batch.lora_slots, dtype=torch.long)
        counts = torch.tensor(batch.num_scheduled_tokens, dtype=torch.long)
        return LoRARows.build(slots.repeat_interleave(counts))

    def _adapter(self, load: LoRASlotLoad) -> LoRAAdapter:
        adapter = self.adapters.get(load.lora_int_id)
        if adapter is None:  # unloaded while requests still ran under it
            request = LoRARequest(load.lora_name, load.lora_int_id, load.lora_path)
            adapter = load_adapter(request, self.model, self.max_lora_rank)
        return adapter
