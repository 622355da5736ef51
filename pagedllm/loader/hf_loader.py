"""Hugging Face model directories: config.json and *.safetensors (one file, or indexed shards)."""
from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pagedllm.config import ModelConfig
from pagedllm.loader.errors import ModelLoadError, first_line
from pagedllm.loader.source import WeightIterator

INDEX_FILE = "model.safetensors.index.json"


def read_json(path: Path, where: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ModelLoadError(where, f"cannot read {path.name} ({first_line(e)})") from e
    except json.JSONDecodeError as e:
        raise ModelLoadError(where, f"{path.name} is not valid JSON ({first_line(e)})") from e
    if not isinstance(data, dict):
        raise ModelLoadError(where, f"{path.name} is not a JSON object")
    return data


def config_from_hf_json(config_file: Path, where: str) -> ModelConfig:
    """ModelConfig from config.json, with generation_config.json's end-of-sequence ids merged in."""
    hf = read_json(config_file, where)
    try:
        config = ModelConfig.from_hf_config(hf)
    except KeyError as e:
        raise ModelLoadError(where, f"{config_file.name} has no {e.args[0]!r}") from e
    except (ValueError, TypeError) as e:
        raise ModelLoadError(where, first_line(e)) from e
    generation = config_file.with_name("generation_config.json")
    if generation.is_file():
        eos = read_json(generation, where).get("eos_token_id")
        extra = eos if isinstance(eos, list) else [] if eos is None else [eos]
        config.eos_token_ids = list(dict.fromkeys([*config.eos_token_ids, *map(int, extra)]))
    return config


def load_hf_dir(folder: str) -> tuple[ModelConfig, WeightIterator]:
    """Validate config and every safetensors header up front; the iterator only reads tensors."""
    root = Path(folder)
    config = config_from_hf_json(root / "config.json", folder)
    files = safetensors_files(root, folder)
    names = {str(f): _tensor_names(f) for f in files}
    return config, functools.partial(_iter_weights, names, config)


def safetensors_files(root: Path, where: str) -> list[Path]:
    index = root / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index, where).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(where, f"{INDEX_FILE} has no weight_map")
        files = [root / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(where, f"shard {f.name!r} listed in {INDEX_FILE} is missing")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            where, "no *.safetensors weights in this directory (only safetensors is supported)"
        )
    return files


def _tensor_names(file: Path) -> list[str]:
    try:
        with safe_open(str(file), framework="pt") as f:
            return list(f.keys())
    except Exception as e:  # SafetensorError: bad header, incomplete metadata, ...
        raise ModelLoadError(str(file), f"not a valid safetensors file ({first_line(e)})") from e


def hf_weight_name(name: str, config: ModelConfig) -> str:
    """Checkpoints saved from the base model (no LM head) lack the CausalLM prefix; add it."""
    prefix = "transformer." if config.architecture == "bloom" else "model."
    if name.startswith((prefix, "lm_head.")):
        return name
    return prefix + name


def _iter_weights(
    names: dict[str, list[str]], config: ModelConfig, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    for file, keys in names.items():
        try:
            with safe_open(file, framework="pt") as f:
                for key in keys:
                    name = hf_weight_name(key, config)
                    if name.endswith("rotary_emb.inv_freq"):  # a buffer some old checkpoints saved
                        continue
                    if name == "lm_head.weight" and config.tie_word_embeddings:
                        continue
                    yield name, f.get_tensor(key).to(dtype)
        except ModelLoadError:
            raise
        except Exception as e:
            raise ModelLoadError(file, f"cannot read tensors ({first_line(e)})") from e
