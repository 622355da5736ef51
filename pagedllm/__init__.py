"""pagedllm: a readable LLM inference engine built around PagedAttention.

The names below load on first use, so `pagedllm --help` and `from pagedllm import
SamplingParams` do not pay for importing torch.
"""
from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

from pagedllm.startup import paused_gc as _paused_gc

# torch's import scans the entry points of every installed package for out-of-tree device
# backends; pagedllm runs on CPU and CUDA, which torch has built in. Set to 1 to scan.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

if TYPE_CHECKING:
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.lora.request import LoRARequest
    from pagedllm.outputs import CompletionOutput, EmbeddingRequestOutput, RequestOutput
    from pagedllm.pooling_params import PoolingParams
    from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

_EXPORTS = {
    "LLM": "pagedllm.entrypoints.llm",
    "SamplingParams": "pagedllm.sampling_params",
    "StructuredOutputsParams": "pagedllm.sampling_params",
    "RequestOutput": "pagedllm.outputs",
    "CompletionOutput": "pagedllm.outputs",
    "EmbeddingRequestOutput": "pagedllm.outputs",
    "PoolingParams": "pagedllm.pooling_params",
    "LoRARequest": "pagedllm.lora.request",
}

__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
    with _paused_gc(freeze=True):  # the first of these imports torch
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
