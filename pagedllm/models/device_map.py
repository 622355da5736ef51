"""DeviceMap: which device holds each decoder layer, and the walk that runs a model over
its device groups (the eager forward and each group's CUDA graph both go through `walk`).

A map is a list of DeviceGroups: runs of consecutive layers on one device. Spec:
"cuda:0:20,cuda:1:12" or "cuda:0:20,cpu:12" (DEVICE:LAYERS, in layer order), or "auto"
(the worker's placement plans it: worker/placement.py). The embedding sits with the first
group; the final norm and LM head with the last. Groups stay distinct even on one physical
device ("cpu:10,cpu:10,cpu:10" has three groups, three caches, three metadata objects and two
boundaries), which is how CI exercises the multi-device path without GPUs; a move onto the
device a tensor is already on copies no data, so real copies happen once per distinct device.

Every move of hidden states or input metadata between groups goes through
DeviceMap.transfer, so there is one place to read (and, in tests, to count) them.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from pagedllm.kernels.metadata import PagedAttentionInputMetadata

T = TypeVar("T")
S = TypeVar("S")


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
    def walk(self, state: S, run_group: Callable[[DeviceGroup, S], S],
             cross: Callable[[S, DeviceGroup], S] | None = None) -> S:
        """Run the groups in layer order: at each boundary `cross(state, group)` brings the
        state onto the next group (default: `transfer`; the only place a forward's state
        moves between devices), then `run_group(group, state)` runs with the group's device
        current (Triton launches on the current CUDA device, whatever its tensors' device)."""
        cross = cross or self.transfer
        for group in self.groups:
            if group.index > 0:
                state = cross(state, group)
            with on_device(group.device):
                state = run_group(group, state)
        return state

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


def on_device(device: torch.device):
    """Make `device` current while a group runs: Triton launches on the current CUDA device,
    whatever device its tensors are on."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
