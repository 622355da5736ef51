"""LoRA on a projection: each token row of the flat batch adds its own adapter's low-rank
update to the base output, out[i] += (x[i] @ A_s^T) @ B_s^T with s the row's slot.

The per-row slots reach the layers through one context set around a model forward
(`lora_rows`), like the attention metadata but without threading it through every call:

    with lora_rows(row_slots):        # row_slots[i]: slot of token row i, -1 = base model
        hidden = model(input_ids, kv_caches, meta)

Invariant: inside the context every projection of the forward sees the same token rows in
the same order as input_ids (the Llama-family forward never reorders, drops or pads rows
between the embedding and the final norm), so row i of any projection's input is token i.
Outside a context, or when every row is the base model's, the projections skip LoRA.

A projection with adapters attached holds a LoRALayer as its `lora` attribute (None on the
class: the no-LoRA path is one attribute test). The layer's A/B tensors are views into the
adapter pool (pagedllm/lora/weights.py), one per fused part (q|k|v, gate|up), with the
adapter's scale folded into B and ranks zero-padded to max_lora_rank.

The torch path groups rows by slot (rows of the base skip it); it runs on any device and
is the oracle of the Triton pair (kernels/triton_lora.py: shrink and expand, each row
reading its slot from a device tensor), which CUDA inputs take unless
PAGEDLLM_LORA_TRITON=0. Neither is in the decode CUDA graphs yet: a step with adapter rows
runs eager (worker/model_runner.uses_graph).
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

USE_TRITON = os.environ.get("PAGEDLLM_LORA_TRITON", "1") != "0"


@dataclass
class LoRARows:
    """The adapter slot of each token row of one forward, grouped once for all layers."""

    slots: torch.Tensor  # [num_tokens] int64 on the CPU, -1 = the base model
    # (slot, its row indices), slots >= 0 only; indices None: the slot has every row
    groups: list[tuple[int, torch.Tensor | None]]
    _on_device: dict[torch.device, list[tuple[int, torch.Tensor | None]]] = field(
        default_factory=dict)

    @classmethod
    def build(cls, slots: torch.Tensor | list[int]) -> "LoRARows":
        slots = torch.as_tensor(slots, dtype=torch.long).cpu()
        values = slots.unique().tolist()
        if len(values) == 1:
            return cls(slots, [(values[0], None)] if values[0] >= 0 else [])
        return cls(slots, [(s, (slots == s).nonzero().view(-1)) for s in values if s >= 0])

    def slots_on(self, device: torch.device) -> torch.Tensor:
        """The per-row slots on `device` (moved once per device)."""
        key = ("slots", device)
        if key not in self._on_device:
            self._on_device[key] = self.slots.to(device)  # type: ignore[index]
        return self._on_device[key]  # type: ignore[index]

    def groups_on(self, device: torch.device) -> list[tuple[int, torch.Tensor | None]]:
        """The groups with their row indices on `device` (moved once per device)."""
        if device not in self._on_device:
            self._on_device[device] = [(s, None if rows is None else rows.to(device))
                                       for s, rows in self.groups]
        return self._on_device[device]


_current: LoRARows | None = None


@contextmanager
def lora_rows(slots: LoRARows | torch.Tensor | list[int] | None) -> Iterator[LoRARows | None]:
    """Set the per-row adapter slots for the forward run inside (None: base model only;
    a LoRARows built once serves every forward of a multi-step window)."""
    global _current
    previous = _current
    rows = slots if slots is None or isinstance(slots, LoRARows) else LoRARows.build(slots)
    _current = rows if rows is not None and rows.groups else None
    try:
        yield rows
    finally:
        _current = previous


def lora_active() -> bool:
    """Whether the forward being run has rows of some adapter (paths that bypass the
    projection modules, like the CPU's fused decode, must not run then)."""
    return _current is not None


class LoRALayer:
    """One projection's adapter slots: per fused part, A [max_loras, R, in] and
    B [max_loras, part_rows, R] (B scaled), zero where a slot's adapter leaves the part out."""

    def __init__(self, lora_a: list[torch.Tensor], lora_b: list[torch.Tensor]) -> None:
        self.lora_a, self.lora_b = lora_a, lora_b
        # which (slot, part) pairs hold a nonzero update; the others are skipped
        self.active = [[False] * len(lora_a) for _ in range(lora_a[0].shape[0])]

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        rows = _current
        if rows is None:
            return out
        x2 = x.reshape(-1, x.shape[-1])
        out2 = out.view(-1, out.shape[-1])
        if x.is_cuda and USE_TRITON:
            self._triton(rows, x2.contiguous(), out2)
            return out
        for slot, index in rows.groups_on(x.device):
            xs = x2 if index is None else x2.index_select(0, index)
            offset = 0
            for a, b, on in zip(self.lora_a, self.lora_b, self.active[slot]):
                size = b.shape[1]
                if on:  # this part's rows of the output get (x A^T) B^T
                    delta = ((xs @ a[slot].T) @ b[slot].T).to(out2.dtype)
                    part = out2.narrow(1, offset, size)
                    if index is None:
                        part.add_(delta)
                    else:
                        part.index_add_(0, index, delta)
                offset += size
        return out

    def _triton(self, rows: LoRARows, x2: torch.Tensor, out2: torch.Tensor) -> None:
        from pagedllm.kernels.triton_lora import lora_expand, lora_shrink

        slots = rows.slots_on(x2.device)
        used = [slot for slot, _ in rows.groups]
        offset = 0
        for part, (a, b) in enumerate(zip(self.lora_a, self.lora_b)):
            if any(self.active[slot][part] for slot in used):
                lora_expand(out2, lora_shrink(x2, a, slots), b, slots, offset)
            offset += b.shape[1]
