"""Rotary position embedding (the rotate-half layout Hugging Face Llama models use)."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.kernels.metadata import PagedAttentionInputMetadata


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


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        inv_freq = _inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_position, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, inv_freq)
        # [max_position, head_dim], float32 for accuracy. One model-wide table, copied once
        # to each device that holds layers (not per layer, not as module buffers).
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

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        meta: PagedAttentionInputMetadata | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, heads, head_dim], k: [T, kv_heads, head_dim]. On CUDA, and by the C kernel on
        the CPU in fp32, rotated in place.
        With the step's metadata (whose positions these are), the CPU path looks up the
        positions' cos/sin rows once per step instead of once per layer."""
        if q.is_cuda and q.stride(-1) == 1 and k.stride(-1) == 1:
            from pagedllm.kernels.triton_ops import triton_rotary_embedding

            triton_rotary_embedding(positions, q, k, self.cos_sin_cache(q.device))
            return q, k
        if cpu_kernels.applies(q, k) and cpu_kernels.rows_contiguous(q, k):
            cpu_kernels.rotary_embedding_(positions, q, k, *self.tables(q.device))
            return q, k
        if meta is None:
            cos, sin = self._rows(positions, q.dtype)
        else:
            cos, sin = meta.step_cache(("rotary", self, q.dtype),
                                       lambda: self._rows(positions, q.dtype))
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def _rows(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-flipped sin [T, 1, head_dim] of each position (see _rotate), in the
        activations' dtype: half-precision models rotate in half precision, as transformers
        does, instead of casting q and k to float32 and back in every layer."""
        cos, sin = self.tables(positions.device)
        half = cos.shape[-1] // 2
        sign = torch.ones(cos.shape[-1], device=positions.device)
        sign[:half] = -1
        return cos[positions].unsqueeze(1).to(dtype), (sin[positions] * sign).unsqueeze(1).to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) * sin = [x2, x1] * [-sin, sin]
    (exactly the same products: negating a factor is exact)."""
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # [x2, x1]
    return x * cos + swapped * signed_sin
