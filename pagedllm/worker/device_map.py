"""DeviceMap: which device holds each decoder layer.

Spec: "cuda:0:20,cuda:1:12" or "cuda:0:20,cpu:12" (device:layer-count, in layer order).
The embedding sits with the first layer; the final norm and LM head with the last.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DeviceMap:
    layer_devices: list[torch.device]

    @property
    def devices(self) -> list[torch.device]:
        return list(dict.fromkeys(self.layer_devices))

    def layers_on(self, device: torch.device) -> int:
        return sum(1 for d in self.layer_devices if d == device)

    @classmethod
    def single(cls, device: torch.device, num_layers: int) -> "DeviceMap":
        return cls([device] * num_layers)

    @classmethod
    def parse(cls, spec: str, num_layers: int) -> "DeviceMap":
        layer_devices: list[torch.device] = []
        for part in spec.split(","):
            name, sep, count = part.strip().rpartition(":")
            if not sep or not name or not count.isdigit() or int(count) < 1:
                raise ValueError(
                    f"device map entry {part.strip()!r} must look like DEVICE:LAYERS, "
                    f"e.g. cuda:0:20 or cpu:12"
                )
            layer_devices += [_check_device(name)] * int(count)
        if len(layer_devices) != num_layers:
            raise ValueError(
                f"device map {spec!r} places {len(layer_devices)} layers but the model has "
                f"{num_layers}"
            )
        return cls(layer_devices)


def _check_device(name: str) -> torch.device:
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
