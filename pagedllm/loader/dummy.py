"""Dummy weights: a real model's shape (a preset or any config) filled with random values."""
from __future__ import annotations

import math
from pathlib import Path

import torch

PRESETS_DIR = Path(__file__).with_name("presets")
DEFAULT_PRESET = "smollm2-135m"


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def preset_config_file(name: str) -> Path | None:
    path = PRESETS_DIR / f"{name.lower()}.json"
    return path if path.is_file() else None


def _is_norm(name: str) -> bool:
    """'...input_layernorm.weight', '...q_norm.weight', Bloom's 'transformer.ln_f.weight'."""
    module = name.rsplit(".", 2)[-2] if "." in name else name
    return module.endswith("norm") or module.startswith("ln_")


@torch.no_grad()
def initialize_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Fill every parameter in place, on the device it already lives on.

    Norm scales are 1 and biases 0; other weights are uniform in [-1/sqrt(fan_in), 1/sqrt(fan_in)],
    which keeps activations near unit scale through many layers, also in bf16. A sharded
    layer (tensor parallelism) draws its full tensor and keeps its rank's slice, so the
    weights are the same at every tensor_parallel_size.
    """
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if param.device.type == "meta":
            continue
        if name.endswith("bias"):
            param.zero_()
        elif _is_norm(name):
            param.fill_(1.0)
        else:
            if param.device not in generators:
                generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
            module_name, _, leaf = name.rpartition(".")
            module = model.get_submodule(module_name)
            shape = module.full_shape(leaf) if hasattr(module, "full_shape") else param.shape
            bound = 1.0 / math.sqrt(shape[-1]) if len(shape) > 1 else 1e-2
            if getattr(module, "tp", 1) == 1:
                param.uniform_(-bound, bound, generator=generators[param.device])
                continue
            full = torch.empty(shape, dtype=param.dtype, device=param.device)
            full.uniform_(-bound, bound, generator=generators[param.device])
            param.copy_(module.shard_weight(leaf, full, None))
