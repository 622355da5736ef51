"""DeviceMap: which device holds each decoder layer.

A map is a list of DeviceGroups: runs of consecutive layers on one device. Spec:
"cuda:0:20,cuda:1:12" or "cuda:0:20,cpu:12" (DEVICE:LAYERS, in layer order), or "auto"
(see plan_auto). The embedding sits with the first group; the final norm and LM head with
the last. Groups stay distinct even on one physical device ("cpu:10,cpu:10,cpu:10" has three
groups, three caches, three metadata objects and two boundaries), which is how CI exercises
the multi-device path without GPUs; a move onto the device a tensor is already on copies no
data, so real copies happen once per distinct device.

Every move of hidden states or input metadata between groups goes through
DeviceMap.transfer, so there is one place to read (and, in tests, to count) them.
"""
from __future__ import annotations

import contextlib

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

from pagedllm.kernels.metadata import PagedAttentionInputMetadata
from pagedllm.worker.memory import module_bytes

T = TypeVar("T")
GiB, MiB = 1 << 30, 1 << 20


@dataclass(frozen=True)
class DeviceGroup:
    index: int
    device: torch.device
    start: int  # first layer
    end: int  # one past the last layer

    @property
    def layers(self) -> range:
        return range(self.start, self.end)

    @property
    def num_layers(self) -> int:
        return self.end - self.start


@dataclass
class DeviceMap:
    groups: list[DeviceGroup]

    # ------------------------------------------------------------ construction
    @classmethod
    def from_counts(cls, counts: Sequence[tuple[torch.device, int]]) -> "DeviceMap":
        """Groups from (device, number of layers) pairs, in layer order."""
        groups, start = [], 0
        for device, n in counts:
            if n < 1:
                raise ValueError(
                    f"device map gives {device} {n} layers; each entry needs at least 1"
                )
            groups.append(DeviceGroup(len(groups), torch.device(device), start, start + n))
            start += n
        if not groups:
            raise ValueError("device map is empty")
        return cls(groups)

    @classmethod
    def single(cls, device: torch.device, num_layers: int) -> "DeviceMap":
        return cls.from_counts([(device, num_layers)])

    @classmethod
    def from_layer_devices(cls, layer_devices: Sequence[torch.device]) -> "DeviceMap":
        """One group per run of consecutive layers on the same device."""
        counts: list[tuple[torch.device, int]] = []
        for d in layer_devices:
            if counts and counts[-1][0] == d:
                counts[-1] = (d, counts[-1][1] + 1)
            else:
                counts.append((d, 1))
        return cls.from_counts(counts)

    @classmethod
    def parse(cls, spec: str, num_layers: int) -> "DeviceMap":
        """An explicit map, "DEVICE:LAYERS,DEVICE:LAYERS,..." ("auto" is plan_auto's)."""
        counts = []
        for part in spec.split(","):
            name, sep, count = part.strip().rpartition(":")
            if not sep or not name or not count.isdigit() or int(count) < 1:
                raise ValueError(
                    f"device map entry {part.strip()!r} must look like DEVICE:LAYERS, "
                    f"e.g. cuda:0:20 or cpu:12"
                )
            counts.append((check_device(name), int(count)))
        placed = sum(n for _, n in counts)
        if placed != num_layers:
            raise ValueError(
                f"device map {spec!r} places {placed} layers but the model has {num_layers}"
            )
        return cls.from_counts(counts)

    # ---------------------------------------------------------------- queries
    @property
    def num_layers(self) -> int:
        return self.groups[-1].end

    @property
    def layer_devices(self) -> list[torch.device]:
        return [g.device for g in self.groups for _ in g.layers]

    @property
    def devices(self) -> list[torch.device]:
        """Distinct physical devices, in layer order."""
        return list(dict.fromkeys(g.device for g in self.groups))

    @property
    def input_device(self) -> torch.device:
        return self.groups[0].device

    @property
    def output_device(self) -> torch.device:
        return self.groups[-1].device

    def layers_on(self, device: torch.device) -> int:
        return sum(g.num_layers for g in self.groups if g.device == device)

    def spec(self) -> str:
        return ",".join(f"{g.device}:{g.num_layers}" for g in self.groups)

    # -------------------------------------------------------------- execution
    def run_model(self, model: nn.Module, input_ids: torch.Tensor, kv_caches: list[torch.Tensor],
                  metadata) -> torch.Tensor:
        """A model's forward, group by group: embed, each group's layers on its device (the
        state crosses devices only at a boundary), the final norm. The model provides
        embed(ids) -> state, run_layers(layers, state, kv_caches, meta) -> state and
        final_norm(state) -> hidden, where a state is a tuple of tensors (or None)."""
        state = model.embed(input_ids)
        for group, meta in zip(self.groups, self.distribute(metadata)):
            if group.index > 0:  # a boundary of the map: the only place hidden states move
                state = self.transfer(state, group)
            with on_device(group.device):
                state = model.run_layers(group.layers, state, kv_caches, meta)
        with on_device(self.output_device):  # the final norm may be a Triton kernel too
            return model.final_norm(state)

    # -------------------------------------------------------------- transfers
    def distribute(
        self,
        metadata: PagedAttentionInputMetadata
        | dict[torch.device, PagedAttentionInputMetadata]
        | list[PagedAttentionInputMetadata],
    ) -> list[PagedAttentionInputMetadata]:
        """One metadata per group: the first group's is the one built for the step, each later
        group gets one copy. A list is taken as already distributed; a device-keyed dict
        contributes its input-device entry."""
        if isinstance(metadata, list):
            if len(metadata) != len(self.groups):
                raise ValueError(
                    f"got {len(metadata)} metadata for {len(self.groups)} device groups"
                )
            return metadata
        if isinstance(metadata, dict):
            metadata = metadata[self.input_device]
        return [metadata] + [self.transfer(metadata, g) for g in self.groups[1:]]

    def transfer(self, value: T, group: DeviceGroup) -> T:
        """Move a tensor, metadata or a tuple of them (None passes) onto `group`'s device."""
        return _move(value, group.device)


def _move(value, device: torch.device):
    if value is None:
        return None
    if isinstance(value, tuple):
        return tuple(_move(v, device) for v in value)
    if isinstance(value, torch.Tensor):
        # Only host -> CUDA copies may be asynchronous: a copy to the host must be complete
        # before CPU code reads it, and one between two GPUs before the other GPU's stream
        # reads it.
        return value.to(device, non_blocking=device.type == "cuda" and value.device.type == "cpu")
    if isinstance(value, PagedAttentionInputMetadata):
        source = value.positions.device
        moved = value.to(device)  # its tensors move non_blocking
        if source.type == "cuda" and device.type != "cuda":
            torch.cuda.synchronize(source)
        return moved
    raise TypeError(f"cannot move a {type(value).__name__} between devices")


def check_device(name: str) -> torch.device:
    """A device the map may name: cpu, or cuda:N that exists here."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device map names an unknown device {name!r}") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = device.index or 0
        if index >= count:
            raise ValueError(
                f"device map names {name!r} but this machine has {count} CUDA device(s)"
            )
        return torch.device("cuda", index)
    if device.type != "cpu":
        raise ValueError(f"device map names an unsupported device {name!r} (use cuda:N or cpu)")
    return device


# ------------------------------------------------------------------ placement
@dataclass
class WeightSizes:
    """Bytes of the model's weights, as placement sees them."""

    layer_bytes: list[int]  # each decoder layer
    embed_bytes: int  # sits with the first layer
    head_bytes: int  # final norm and LM head, with the last layer

    @classmethod
    def of(cls, model: nn.Module) -> "WeightSizes":
        """Works on a model still on the meta device."""
        return cls(
            [module_bytes(layer) for layer in model.layers],
            module_bytes(model.embed_tokens),
            sum(module_bytes(m) for m in _head_modules(model)),
        )

    def per_group(self, device_map: DeviceMap) -> list[int]:
        sizes = [sum(self.layer_bytes[i] for i in g.layers) for g in device_map.groups]
        sizes[0] += self.embed_bytes
        sizes[-1] += self.head_bytes
        return sizes

    def per_device(self, device_map: DeviceMap) -> dict[torch.device, int]:
        sizes = {d: 0 for d in device_map.devices}
        for g, n in zip(device_map.groups, self.per_group(device_map)):
            sizes[g.device] += n
        return sizes


def _head_modules(model: nn.Module) -> list[nn.Module]:
    return [model.norm] + ([model.lm_head] if model.lm_head is not None else [])


def place_model(model: nn.Module, device_map: DeviceMap) -> None:
    """Materialise a meta-device model on the map's devices (weights still to be loaded)."""
    for g in device_map.groups:
        for i in g.layers:
            model.layers[i].to_empty(device=g.device)
    model.embed_tokens.to_empty(device=device_map.input_device)
    for m in _head_modules(model):
        m.to_empty(device=device_map.output_device)
    model.device_map = device_map


def check_weights_fit(weights: dict[torch.device, int], free: dict[torch.device, int]) -> None:
    """A clear error, before any allocation, when a device cannot hold its weights."""
    for device, need in weights.items():
        if need > free[device]:
            raise ValueError(
                f"device map puts {need / GiB:.2f} GiB of weights on {device}, which has "
                f"{free[device] / GiB:.2f} GiB free"
            )


def describe(device_map: DeviceMap, weights: list[int], kv_bytes: list[int],
             free: dict[torch.device, int]) -> list[str]:
    """One line per group for the startup log."""
    return [
        f"device group {g.index} on {g.device}: layers {g.start}-{g.end - 1} ({g.num_layers}), "
        f"weights {w / MiB:.1f} MiB, KV cache {kv / MiB:.1f} MiB; {g.device} has "
        f"{free[g.device] / GiB:.2f} GiB free"
        for g, w, kv in zip(device_map.groups, weights, kv_bytes)
    ]


@dataclass
class PlacementInputs:
    """What plan_auto needs to know, all in bytes."""

    weights: WeightSizes
    kv_block_bytes: int  # one KV block of one layer
    activation_peak: int  # working memory of a forward, on every device that holds layers
    min_blocks: int  # the smallest useful shared KV cache, in blocks


def plan_auto(free_memory: Sequence[tuple[torch.device, int]], p: PlacementInputs) -> DeviceMap:
    """Place layers by the usable memory of each device (given in fill order, CPU last).

    Devices are filled in order; each reserves its weights, the KV blocks of its layers and
    an activation peak. All devices share one block count, so the accelerators get the
    largest block count at which they hold every layer (which spreads layers as far as that
    pays). Only where the accelerators cannot hold the model with `min_blocks` does the CPU
    take the rest.
    """
    accelerators = [(d, f) for d, f in free_memory if d.type != "cpu"]
    if accelerators and _fill(accelerators, p, p.min_blocks) is not None:
        lo, hi = p.min_blocks, max(f for _, f in accelerators) // max(p.kv_block_bytes, 1)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _fill(accelerators, p, mid) is not None:
                lo = mid
            else:
                hi = mid - 1
        return DeviceMap.from_counts(_fill(accelerators, p, lo))
    counts = _fill(free_memory, p, p.min_blocks)
    if counts is None:
        shown = ", ".join(f"{d} {f / GiB:.2f} GiB" for d, f in free_memory)
        w = p.weights
        need = sum(w.layer_bytes) + w.embed_bytes + w.head_bytes
        raise ValueError(
            f"device map 'auto' cannot fit the model: {need / GiB:.2f} GiB of weights plus a "
            f"KV cache of {p.min_blocks} blocks and activations, with usable memory {shown}"
        )
    return DeviceMap.from_counts(counts)


def _fill(
    free_memory: Sequence[tuple[torch.device, int]], p: PlacementInputs, num_blocks: int
) -> list[tuple[torch.device, int]] | None:
    """Greedy in device order; None when some layers are left over."""
    w = p.weights
    num_layers = len(w.layer_bytes)
    counts, start = [], 0
    for device, free in free_memory:
        used = p.activation_peak + (w.embed_bytes if start == 0 else 0)
        end = start
        while end < num_layers:
            cost = w.layer_bytes[end] + num_blocks * p.kv_block_bytes
            cost += w.head_bytes if end == num_layers - 1 else 0
            if used + cost > free:
                break
            used += cost
            end += 1
        if end > start:
            counts.append((device, end - start))
            start = end
        if start == num_layers:
            return counts
    return None


def on_device(device: torch.device):
    """Make `device` current while a group runs: Triton launches on the current CUDA device,
    whatever device its tensors are on."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
