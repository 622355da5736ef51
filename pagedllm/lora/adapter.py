"""PEFT LoRA adapters: adapter_config.json + adapter_model.safetensors, checked against the
base model and mapped onto its projections.

PEFT names a tensor after the Hugging Face module it adapts
(`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`); the model's own
weight_target maps that module onto ours and the part of a fused projection it fills
(q_proj -> qkv_proj part 0, up_proj -> gate_up_proj part 1). Each part keeps its own A and
B: the update of a fused projection is the concatenation of its parts' updates, which is
what layers/lora.py computes.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from pagedllm.lora.request import LoRARequest

SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE, WEIGHTS_FILE, PICKLE_FILE = (
    "adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
# PEFT options that change what the adapter computes beyond x @ A^T @ B^T * scale, and the
# value each must have here.
PLAIN_LORA = {"bias": "none", "use_dora": False, "modules_to_save": None, "rank_pattern": {},
              "alpha_pattern": {}, "fan_in_fan_out": False, "lora_bias": False,
              "trainable_token_indices": None, "target_parameters": None,
              "layer_replication": None, "alora_invocation_tokens": None}
TENSOR_NAME = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


@dataclass
class LoRAAdapter:
    """An adapter in our module names: for each adapted projection, one (A [r, in],
    B [part_rows, r] with the scale folded in) per fused part, None where it is left out."""

    name: str
    int_id: int
    rank: int
    scale: float
    weights: dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]]


def load_adapter(request: LoRARequest, model: nn.Module, max_lora_rank: int) -> LoRAAdapter:
    """Read and check a PEFT adapter for `model`; a ValueError naming what is wrong."""
    name, path = request.lora_name, Path(request.lora_path)
    config = _read_config(name, path)
    rank = int(config.get("r", 0))
    if rank > max_lora_rank:
        raise ValueError(f"LoRA adapter {name!r} has rank {rank}, above max_lora_rank "
                         f"{max_lora_rank}")
    alpha = float(config.get("lora_alpha", rank))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pairs = _pair_tensors(name, load_file(str(path / WEIGHTS_FILE)))
    weights: dict[str, list] = {}
    for hf_module, (a_key, a, b_key, b) in pairs.items():
        ours, part, module = _target(name, model, hf_module, a_key)
        in_features = module.in_features
        part_sizes = list(getattr(module, "part_sizes", None) or [module.out_features])
        _check_shape(name, a_key, a, (rank, in_features))
        _check_shape(name, b_key, b, (part_sizes[part], rank))
        parts = weights.setdefault(ours, [None] * len(part_sizes))
        parts[part] = (a.float(), b.float() * scale)
    return LoRAAdapter(name, request.lora_int_id, rank, scale, weights)


def _read_config(name: str, path: Path) -> dict:
    if not path.is_dir():
        raise ValueError(f"LoRA adapter {name!r}: path {str(path)!r} is not a directory")
    if not (path / CONFIG_FILE).is_file():
        raise ValueError(f"LoRA adapter {name!r}: {path} has no {CONFIG_FILE}")
    if not (path / WEIGHTS_FILE).is_file():
        if (path / PICKLE_FILE).is_file():
            raise ValueError(
                f"LoRA adapter {name!r}: {path} has {PICKLE_FILE} (a pickle, not loaded); "
                f"save it as {WEIGHTS_FILE} (save_pretrained(safe_serialization=True))")
        raise ValueError(f"LoRA adapter {name!r}: {path} has no {WEIGHTS_FILE}")
    config = json.loads((path / CONFIG_FILE).read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type {config['peft_type']!r} is not "
                         f"supported (only LORA)")
    for option, plain in PLAIN_LORA.items():
        value = config.get(option, plain)
        if value != plain and not (plain is None and not value):
            raise ValueError(f"LoRA adapter {name!r}: {option}={value!r} is not supported")
    targets = config.get("target_modules") or []
    if isinstance(targets, list):  # a string is a regex: the tensors' names are checked
        for target in targets:
            if target not in SUPPORTED_TARGETS:
                raise ValueError(_unsupported_target(name, target))
    return config


def _unsupported_target(name: str, target: str) -> str:
    return (f"LoRA adapter {name!r} targets {target!r}, which pagedllm does not adapt "
            f"(supported: {', '.join(SUPPORTED_TARGETS)})")


def _pair_tensors(name: str, tensors: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """HF module name -> (A's key, A, B's key, B)."""
    found: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    for key, tensor in tensors.items():
        match = TENSOR_NAME.match(key)
        if match is None:
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA A or B "
                             f"weight")
        found.setdefault(match["module"], {})[match["ab"]] = (key, tensor)
    pairs = {}
    for module, ab in found.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: {module!r} has lora_{''.join(ab)} "
                             f"but no lora_{'B' if 'A' in ab else 'A'}")
        pairs[module] = (*ab["A"], *ab["B"])
    return pairs


def _target(name: str, model: nn.Module, hf_module: str, key: str
            ) -> tuple[str, int, nn.Module]:
    """Our module for a PEFT module name, the part of it the tensor fills, and the module."""
    hf_name = hf_module.removeprefix("base_model.model.")
    leaf = hf_name.rpartition(".")[2]
    if leaf not in SUPPORTED_TARGETS:
        raise ValueError(_unsupported_target(name, leaf))
    target = model.weight_target(hf_name + ".weight")
    ours = None if target is None else target[0].removesuffix(".weight")
    try:
        module = model.get_submodule(ours) if ours else None
    except AttributeError:
        module = None
    if module is None or not hasattr(module, "in_features"):
        raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} adapts {hf_name!r}, which "
                         f"the base model does not have")
    return ours, target[1] or 0, module


def _check_shape(name: str, key: str, tensor: torch.Tensor, want: tuple[int, int]) -> None:
    if tuple(tensor.shape) != want:
        raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} has shape "
                         f"{tuple(tensor.shape)}, the base model needs {want}")
