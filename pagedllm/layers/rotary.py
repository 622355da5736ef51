"""Rotary position embedding (the rotate-half layout Hugging Face Llama models use).

RotaryTables holds cos/sin of every position, built once per shape and shared by every layer
(and every model) of that shape; each layer's RotaryEmbedding applies them through its own
backend (layers/dispatch.py), which depends on the layer's device.
"""
from __future__ import annotations

import json
import math
import weakref
from typing import Any

import torch

from pagedllm.kernels.metadata import PagedAttentionInputMetadata
from pagedllm.layers.dispatch import Dispatched


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(is_mid, mid, scaled)
    elif kind != "default":
        raise ValueError(f"unsupported rope_scaling type {kind!r}")
    return inv_freq.float()


class RotaryTables:
    """cos and sin [max_position, head_dim] in float32 for accuracy: one table on the CPU,
    copied once to each device that asks (not per layer, not as module buffers)."""

    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: dict[str, Any] | None = None) -> None:
        inv_freq = _inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_position, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, inv_freq)
        self._tables = {torch.device("cpu"): (freqs.cos().repeat(1, 2), freqs.sin().repeat(1, 2))}
        self._cos_sin: dict[torch.device, torch.Tensor] = {}

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._tables:
            cos, sin = self._tables[torch.device("cpu")]
            self._tables[device] = (cos.to(device), sin.to(device))
        return self._tables[device]

    def cos_sin_cache(self, device: torch.device) -> torch.Tensor:
        """[max_position, head_dim]: cos | sin of the half-dim frequencies (the Triton layout)."""
        if device not in self._cos_sin:
            cos, sin = self._tables[torch.device("cpu")]
            half = cos.shape[-1] // 2
            self._cos_sin[device] = torch.cat((cos[:, :half], sin[:, :half]), dim=-1).to(device)
        return self._cos_sin[device]

    def rows(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-flipped sin [T, 1, head_dim] of each position (reference.rotate), in the
        activations' dtype: half-precision models rotate in half precision, as transformers
        does, instead of casting q and k to float32 and back in every layer."""
        cos, sin = self.tables(positions.device)
        half = cos.shape[-1] // 2
        sign = torch.ones(cos.shape[-1], device=positions.device)
        sign[:half] = -1
        return cos[positions].unsqueeze(1).to(dtype), (sin[positions] * sign).unsqueeze(1).to(dtype)


# One RotaryTables per shape while any layer holds it.
_shared_tables: weakref.WeakValueDictionary[tuple, RotaryTables] = weakref.WeakValueDictionary()


def shared_tables(head_dim: int, max_position: int, theta: float,
                  scaling: dict[str, Any] | None = None) -> RotaryTables:
    key = (head_dim, max_position, float(theta), json.dumps(scaling, sort_keys=True))
    tables = _shared_tables.get(key)
    if tables is None:
        tables = _shared_tables[key] = RotaryTables(head_dim, max_position, theta, scaling)
    return tables


class RotaryEmbedding(Dispatched):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.rope = shared_tables(head_dim, max_position, theta, scaling)

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rope.tables(device)

    def cos_sin_cache(self, device: torch.device) -> torch.Tensor:
        return self.rope.cos_sin_cache(device)

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        meta: PagedAttentionInputMetadata | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, heads, head_dim], k: [T, kv_heads, head_dim]. The Triton and C kernels rotate
        in place; the torch path returns new tensors. With the step's metadata (whose
        positions these are), the torch path looks up the positions' cos/sin rows once per
        step instead of once per layer."""
        return self.backend.rotary_embedding(positions, q, k, self.rope, meta)
