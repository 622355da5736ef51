"""Attention and elementwise kernels: pure-torch reference (CPU path, test oracle) and Triton (CUDA).

The Triton names load on first use, so the CPU path never imports triton (an optional
dependency: `pip install pagedllm[gpu]`).
"""
from __future__ import annotations

import importlib
import importlib.util

from pagedllm.kernels.reference import alibi_slopes, gather_kv, paged_attention, write_kv_cache

HAS_TRITON = importlib.util.find_spec("triton") is not None

_TRITON_EXPORTS = {
    "triton_write_kv_cache": "pagedllm.kernels.triton_cache",
    "triton_paged_attention": "pagedllm.kernels.triton_attention",
    "choose_num_splits": "pagedllm.kernels.triton_attention",
    "triton_rms_norm": "pagedllm.kernels.triton_ops",
    "triton_silu_and_mul": "pagedllm.kernels.triton_ops",
    "triton_rotary_embedding": "pagedllm.kernels.triton_ops",
}

__all__ = [
    "HAS_TRITON",
    "alibi_slopes",
    "gather_kv",
    "paged_attention",
    "write_kv_cache",
    *_TRITON_EXPORTS,
]


def __getattr__(name: str):
    module = _TRITON_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedllm.kernels' has no attribute {name!r}")
    if not HAS_TRITON:
        raise ImportError(f"pagedllm.kernels.{name} needs triton: pip install 'pagedllm[gpu]'")
    return getattr(importlib.import_module(module), name)
