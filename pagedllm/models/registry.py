"""Architecture name -> model class."""
from __future__ import annotations

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
