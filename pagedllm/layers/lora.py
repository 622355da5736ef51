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
is the oracle of the Triton pair (kernels/triton_lora.py: one segmented shrink and one
expand per projection for all its parts, rows sorted by slot on the device), which CUDA
inputs take unless PAGEDLLM_LORA_TRITON=0. The pair reads the parts' A and B stacked, so
the layer holds them stacked and the per-part tensors are views of them.

Inside a decode CUDA graph the rows are a StaticLoRARows: device buffers of the sorted
rows and the slots' segment starts that the runner fills before each replay; the graph
launches the pair on every adapted projection, whatever the step's slots (a slot's zero
B adds nothing), since nothing host-side may pick kernels inside a graph.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

USE_TRITON = os.environ.get("PAGEDLLM_LORA_TRITON", "1") != "0"


def segments(slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Host rows grouped by slot for the Triton pair: perm, the row indices sorted by slot
    (stable, base rows first), and starts [num_slots + 1]: slot s's rows are
    perm[starts[s]:starts[s + 1]]."""
    ordered, perm = torch.sort(slots, stable=True)
    starts = torch.searchsorted(ordered, torch.arange(num_slots + 1, dtype=slots.dtype))
    return perm, starts


@dataclass
class LoRARows:
    """The adapter slot of each token row of one forward, grouped once for all layers."""

    slots: torch.Tensor  # [num_tokens] int64 on the CPU, -1 = the base model
    # (slot, its row indices), slots >= 0 only; indices None: the slot has every row
    groups: list[tuple[int, torch.Tensor | None]]
    _on_device: dict = field(default_factory=dict)
    static = False  # a graph's rows (StaticLoRARows) launch on every projection

    @classmethod
    def build(cls, slots: torch.Tensor | list[int]) -> "LoRARows":
        slots = torch.as_tensor(slots, dtype=torch.long).cpu()
        values = slots.unique().tolist()
        if len(values) == 1:
            return cls(slots, [(values[0], None)] if values[0] >= 0 else [])
        return cls(slots, [(s, (slots == s).nonzero().view(-1)) for s in values if s >= 0])

    @property
    def has_adapters(self) -> bool:
        return bool(self.groups)

    def segments_on(self, device: torch.device, num_slots: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """perm and starts (`segments`) on `device`, made once per device."""
        key = ("segments", device, num_slots)
        if key not in self._on_device:
            self._on_device[key] = tuple(t.to(device) for t in segments(self.slots, num_slots))
        return self._on_device[key]

    def groups_on(self, device: torch.device) -> list[tuple[int, torch.Tensor | None]]:
        """The groups with their row indices on `device` (moved once per device)."""
        if device not in self._on_device:
            self._on_device[device] = [(s, None if rows is None else rows.to(device))
                                       for s, rows in self.groups]
        return self._on_device[device]


class StaticLoRARows:
    """The rows of a captured decode graph: per device, a sorted-rows buffer [max_rows] and
    a segment-starts buffer [num_slots + 1] (int64) that the graph's LoRA kernels read;
    `load` fills them with a step's slots before a replay. `num_rows`: the bucket being
    captured or replayed (its rows are the buffers' first num_rows)."""

    static = True
    has_adapters = True

    def __init__(self, devices: list[torch.device], max_rows: int, num_slots: int) -> None:
        self.num_slots, self.num_rows = num_slots, max_rows
        i64 = dict(dtype=torch.int64)
        # keyed by the tensors' own device: "cuda" given here is "cuda:0" on the inputs
        perms = [torch.zeros(max_rows, device=d, **i64) for d in devices]
        self.perm = {t.device: t for t in perms}
        self.starts = {t.device: torch.zeros(num_slots + 1, device=t.device, **i64)
                       for t in perms}
        self.loaded: tuple[object, int] | None = None  # (the slots last loaded, bucket)

    def segments_on(self, device: torch.device, num_slots: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        if num_slots != self.num_slots:
            raise ValueError(f"a projection has {num_slots} LoRA slots, the graphs "
                             f"{self.num_slots}")
        return self.perm[device][: self.num_rows], self.starts[device]

    def load(self, slots: torch.Tensor, bucket: int) -> None:
        """Copy a step's per-row slots (host int64, -1 = base), padded with -1 to `bucket`
        rows, into every device's buffers as segments; the same tensor again is a no-op."""
        if self.loaded is not None and self.loaded[0] is slots and self.loaded[1] == bucket:
            return
        padded = torch.full((bucket,), -1, dtype=torch.int64)
        padded[: len(slots)] = slots
        perm, starts = segments(padded, self.num_slots)
        pin = any(d.type == "cuda" for d in self.perm)
        if pin:  # pinned once for every device: the copies can then be asynchronous
            perm, starts = perm.pin_memory(), starts.pin_memory()
        for d in self.perm:
            self.perm[d][:bucket].copy_(perm, non_blocking=d.type == "cuda")
            self.starts[d].copy_(starts, non_blocking=d.type == "cuda")
        self.num_rows, self.loaded = bucket, (slots, bucket)


_current: LoRARows | StaticLoRARows | None = None


@contextmanager
def lora_rows(slots: LoRARows | StaticLoRARows | torch.Tensor | list[int] | None
              ) -> Iterator[LoRARows | StaticLoRARows | None]:
    """Set the per-row adapter slots for the forward run inside (None: base model only;
    a LoRARows built once serves every forward of a multi-step window)."""
    global _current
    previous = _current
    rows = slots if slots is None or isinstance(slots, (LoRARows, StaticLoRARows)) \
        else LoRARows.build(slots)
    _current = rows if rows is not None and rows.has_adapters else None
    try:
        yield rows
    finally:
        _current = previous


def lora_active() -> bool:
    """Whether the forward being run has rows of some adapter (paths that bypass the
    projection modules, like the CPU's fused decode, must not run then)."""
    return _current is not None


def num_lora_slots(model: torch.nn.Module) -> int:
    """The adapter slots of the model's projections (0: no adapters attached)."""
    return max((m.lora.num_slots for m in model.modules()
                if getattr(m, "lora", None) is not None), default=0)


class LoRALayer:
    """One projection's adapter slots: per fused part, A [max_loras, R, in] and
    B [max_loras, part_rows, R] (B scaled), zero where a slot's adapter leaves the part out.
    They are views of a_stacked [max_loras, parts*R, in] and b_stacked [max_loras,
    out, R] (the parts' columns in order), which the Triton pair reads.

    `joint`, where pagedllm/lora made one: [out + max_loras*parts*R, in], the base weight's
    rows (the projection's weight is a view of them) followed by a_stacked's. A forward of
    one token row then runs the shrink inside the base GEMV, for every slot at once, and
    only the expand on top (`joint_forward`): one kernel fewer per projection at the
    batch-1 decode, where each launch costs more than the bytes it reads."""

    def __init__(self, a_stacked: torch.Tensor, b_stacked: torch.Tensor,
                 part_sizes: list[int], joint: torch.Tensor | None = None) -> None:
        self.a_stacked, self.b_stacked, self.joint = a_stacked, b_stacked, joint
        rank = a_stacked.shape[1] // len(part_sizes)
        self.lora_a = list(a_stacked.split(rank, dim=1))
        self.lora_b = list(b_stacked.split(part_sizes, dim=1))
        self.num_slots = a_stacked.shape[0]
        self.part_ends = torch.tensor(part_sizes).cumsum(0).tolist()
        # which (slot, part) pairs hold a nonzero update; the others are skipped
        self.active = [[False] * len(part_sizes) for _ in range(self.num_slots)]

    @classmethod
    def of_parts(cls, lora_a: list[torch.Tensor], lora_b: list[torch.Tensor]) -> "LoRALayer":
        """A layer over copies of per-part A [slots, R, in] and B [slots, rows, R]."""
        return cls(torch.cat(lora_a, dim=1), torch.cat(lora_b, dim=1),
                   [b.shape[1] for b in lora_b])

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        rows = _current
        if rows is None:
            return out
        x2 = x.reshape(-1, x.shape[-1])
        out2 = out.view(-1, out.shape[-1])
        if self._on_triton(rows, x):
            if self._runs(rows):
                perm, starts = rows.segments_on(x2.device, self.num_slots)
                kernels = _kernels()
                y = kernels.lora_shrink(x2.contiguous(), self.a_stacked, perm, starts,
                                        len(self.lora_a))
                kernels.lora_expand(out2, y, self.b_stacked, perm, starts, self.part_ends)
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

    def joins(self, x: torch.Tensor) -> bool:
        """Whether this forward takes `joint_forward`: one token row, adapter rows in the
        forward, the Triton path, a joint weight."""
        rows = _current
        return (self.joint is not None and rows is not None and x.numel() == x.shape[-1]
                and self._on_triton(rows, x) and self._runs(rows))

    def joint_forward(self, x: torch.Tensor, matmul) -> torch.Tensor:
        """The base output plus the row's adapter update: matmul(x, joint) gives the base
        columns and every slot's x A^T; the expand adds the row's slot's part into the
        base columns in place. The result is a view of one row, contiguous as a row."""
        n = self.b_stacked.shape[1]
        both = matmul(x.reshape(1, x.shape[-1]), self.joint)
        out, y = both[:, :n], both[:, n:]
        perm, starts = _current.segments_on(x.device, self.num_slots)
        _kernels().lora_expand(out, y, self.b_stacked, perm, starts, self.part_ends,
                               y_per_slot=True)
        return out.view(*x.shape[:-1], n)

    @staticmethod
    def _on_triton(rows: LoRARows | StaticLoRARows, x: torch.Tensor) -> bool:
        return rows.static or (x.is_cuda and USE_TRITON)

    def _runs(self, rows: LoRARows | StaticLoRARows) -> bool:
        """Eager, a projection no used slot adapts is skipped (a host decision a graph
        cannot make: there the kernels always run; a slot's zero B adds nothing)."""
        return rows.static or any(any(self.active[slot]) for slot, _ in rows.groups)


def _kernels():
    from pagedllm.kernels import triton_lora  # Triton only where it runs

    return triton_lora
