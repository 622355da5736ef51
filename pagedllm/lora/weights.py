"""LoRAWeights: the fixed pool of max_loras adapter slots every adapted projection reads.

For each projection (qkv_proj, o_proj, gate_up_proj, down_proj of every layer) and each of
its fused parts, A [max_loras, max_lora_rank, in] and B [max_loras, part_rows,
max_lora_rank] on the projection's device, allocated once. An adapter of rank r < R fills
the first r ranks of its slot and leaves the rest zero, so every slot computes with R.
Loading an adapter copies it into a slot; evicting zeroes the slot. Which adapter a token
row uses is its slot index (row_slots; -1 = the base model), set for a forward with
layers/lora.lora_rows.
"""
from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import torch
from torch import nn

from pagedllm.distributed import parallel_state as ps
from pagedllm.layers.linear import Linear
from pagedllm.layers.lora import LoRALayer
from pagedllm.lora.adapter import LoRAAdapter

# Our names of the projections PEFT's q/k/v/o/gate/up/down map onto (models/llama.py).
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class LoRAWeights:
    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int,
                 dtype: torch.dtype | None = None) -> None:
        if max_loras < 1 or max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {max_loras} and "
                             f"{max_lora_rank}")
        if ps.tp_size() > 1:
            raise ValueError("LoRA with tensor_parallel_size > 1 is not supported yet")
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        dtype = dtype or next(p.dtype for p in model.parameters() if p.is_floating_point())
        self.layers: dict[str, LoRALayer] = {}
        for name, module in model.named_modules():
            if name.rpartition(".")[2] in PROJECTIONS:
                self.layers[name] = _attach(module, max_loras, max_lora_rank, dtype)
        self.slot_ids: list[int | None] = [None] * max_loras  # lora_int_id held per slot

    def slot_of(self, lora_int_id: int) -> int | None:
        return self.slot_ids.index(lora_int_id) if lora_int_id in self.slot_ids else None

    def free_slot(self) -> int | None:
        return self.slot_of(None)  # type: ignore[arg-type]

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy `adapter` into `slot` (what it held before is replaced)."""
        if adapter.rank > self.max_lora_rank:
            raise ValueError(f"LoRA adapter {adapter.name!r} has rank {adapter.rank}, above "
                             f"max_lora_rank {self.max_lora_rank}")
        self.evict(slot)
        for name, parts in adapter.weights.items():
            layer = self.layers[name]
            for part, ab in enumerate(parts):
                if ab is None:
                    continue
                a, b = ab
                layer.lora_a[part][slot, :adapter.rank].copy_(a)
                layer.lora_b[part][slot, :, :adapter.rank].copy_(b)
                layer.active[slot][part] = True
        self.slot_ids[slot] = adapter.int_id

    def evict(self, slot: int) -> None:
        for layer in self.layers.values():
            for part in range(len(layer.lora_a)):
                if layer.active[slot][part]:
                    layer.lora_a[part][slot].zero_()
                    layer.lora_b[part][slot].zero_()
                    layer.active[slot][part] = False
        self.slot_ids[slot] = None

    def row_slots(self, lora_int_ids: Sequence[int | None]) -> torch.Tensor:
        """The slot of each token row from its adapter id (None or 0: the base model)."""
        slots = []
        for lora_id in lora_int_ids:
            slot = -1 if not lora_id else self.slot_of(lora_id)
            if slot is None:
                raise ValueError(f"LoRA adapter id {lora_id} is not loaded in a slot")
            slots.append(slot)
        return torch.tensor(slots, dtype=torch.long)

    def detach(self, model: nn.Module) -> None:
        """Take the adapters off the model's projections."""
        for name in self.layers:
            model.get_submodule(name).lora = None


# The joint weight (layers/lora.LoRALayer) is made where its extra rows, every slot's A,
# add at most this share to the base weight: the single-row GEMV reads them all.
JOINT_MAX_SHARE = 1 / 16


def _attach(module: nn.Module, max_loras: int, rank: int, dtype: torch.dtype) -> LoRALayer:
    device = next(chain(module.parameters(), module.buffers())).device
    part_sizes = list(getattr(module, "part_sizes", None) or [module.out_features])
    n, k = module.out_features, module.in_features
    extra = max_loras * len(part_sizes) * rank
    joint = None
    if (isinstance(module, Linear) and module.bias is None and module.weight.dtype == dtype
            and extra <= JOINT_MAX_SHARE * n):
        joint = torch.zeros(n + extra, k, dtype=dtype, device=device)
        joint[:n].copy_(module.weight.detach())
        module.weight.data = joint[:n]  # the base weight is now a view of the joint one
        lora_a = joint[n:].view(max_loras, len(part_sizes) * rank, k)
    else:
        lora_a = torch.zeros(max_loras, len(part_sizes) * rank, k, dtype=dtype, device=device)
    lora_b = torch.zeros(max_loras, n, rank, dtype=dtype, device=device)
    module.lora = LoRALayer(lora_a, lora_b, part_sizes, joint)
    return module.lora
