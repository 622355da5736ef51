"""A model's own sampling defaults (vLLM's `--generation-config auto`): a Hugging Face
directory's generation_config.json, or a GGUF file's `general.sampling.*` metadata.

The result maps SamplingParams names to values; a request's own value always wins.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pagedllm.loader.errors import ModelLoadError

# generation_config.json key -> SamplingParams field (the keys vLLM reads).
HF_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# llama.cpp's GGUF sampling metadata -> SamplingParams field.
GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
             "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
             "general.sampling.penalty_repeat": "repetition_penalty"}


def generation_defaults(path: str | None) -> dict[str, Any]:
    """The sampling defaults a model file or directory states ({} when it states none)."""
    if path is None:
        return {}
    p = Path(path)
    if p.is_dir():
        return _from_json(p / "generation_config.json") if (
            p / "generation_config.json").is_file() else {}
    if p.suffix == ".gguf" and p.is_file():
        return _from_gguf(p)
    return {}


def _from_json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(str(file), f"cannot read the generation config ({exc})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(str(file), "the generation config is not a JSON object")
    return {name: data[key] for key, name in HF_KEYS.items() if data.get(key) is not None}


def _from_gguf(file: Path) -> dict[str, Any]:
    from pagedllm.loader.gguf_loader import open_gguf

    reader = open_gguf(str(file))
    out = {}
    for key, name in GGUF_KEYS.items():
        field = reader.fields.get(key)
        if field is not None:
            value = field.contents()
            out[name] = int(value) if name == "top_k" else float(value)
    return out
