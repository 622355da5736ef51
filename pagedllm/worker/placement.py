"""Placement: how much memory the model's weights take, where "auto" puts each layer, and
materialising a meta-device model on the map's devices (see models/device_map.py for the
map itself and the walk over it)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.layers import dispatch
from pagedllm.models.device_map import DeviceMap
from pagedllm.worker.memory import module_bytes

GiB, MiB = 1 << 30, 1 << 20


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
    """Materialise a meta-device model on the map's devices (weights still to be loaded) and
    pick each layer's kernels for its device (layers/dispatch.py)."""
    for g in device_map.groups:
        for i in g.layers:
            _to_empty(model.layers[i], g.device)
    _to_empty(model.embed_tokens, device_map.input_device)
    for m in _head_modules(model):
        _to_empty(m, device_map.output_device)
    model.device_map = device_map
    dispatch.select(model)  # each layer's kernels, for the device it now lives on


def _to_empty(module: nn.Module, device: torch.device) -> None:
    """nn.Module.to_empty with torch.empty: empty_like of a meta tensor runs torch's Python
    reference, whose first call imports sympy (about 1 s of a 135M model's load)."""
    module._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


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
