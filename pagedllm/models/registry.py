"""Architecture name -> model class."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from pagedllm.config import ModelConfig


def model_class(architecture: str) -> type[nn.Module]:
    if architecture in ("llama", "mistral", "qwen2", "qwen3"):
        from pagedllm.models.llama import LlamaForCausalLM

        return LlamaForCausalLM
    if architecture == "bloom":
        from pagedllm.models.bloom import BloomForCausalLM

        return BloomForCausalLM
    raise ValueError(f"unsupported architecture {architecture!r}")


def build_model(config: ModelConfig) -> nn.Module:
    return model_class(config.architecture)(config)


def build_empty_model(config: ModelConfig, dtype: torch.dtype) -> nn.Module:
    """The model's modules on the meta device in `dtype`: no memory and no random init (the
    parameters get their values only after placement, and nn.init.normal_ on meta imports
    torch._dynamo, 2-4 s)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"), _no_init():
            return build_model(config)
    finally:
        torch.set_default_dtype(previous)


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    names = [n for n in dir(nn.init) if n.endswith("_") and not n.startswith("_")]
    saved = {n: getattr(nn.init, n) for n in names}
    for n in names:
        setattr(nn.init, n, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(nn.init, n, fn)
