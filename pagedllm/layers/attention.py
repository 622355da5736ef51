"""PagedAttention: write this step's K/V into the paged cache, then attend over it.

The kernels are the layer's backend's (layers/dispatch.py): Triton on CUDA; on the CPU in
fp32 the C kernels write the cache and run decode-only steps, the pure-torch reference
(SDPA) runs prompt chunks; pure torch anywhere else.
"""
from __future__ import annotations

from typing import Any

import torch

from pagedllm.kernels.metadata import PagedAttentionInputMetadata
from pagedllm.layers.dispatch import Dispatched


class PagedAttention(Dispatched):
    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        sliding_window: int | None = None,
        alibi_slopes: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        # Plain tensors copied per device on first use (not buffers: models are built on the
        # meta device and materialised per layer with to_empty, which would wipe them).
        self._alibi = {torch.device("cpu"): alibi_slopes.float().cpu()} if alibi_slopes is not None else None

    def alibi_slopes(self, device: torch.device) -> torch.Tensor | None:
        if self._alibi is None:
            return None
        if device not in self._alibi:
            self._alibi[device] = self._alibi[torch.device("cpu")].to(device)
        return self._alibi[device]

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads * head_dim]
        k: torch.Tensor,  # [T, num_kv_heads * head_dim]
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: PagedAttentionInputMetadata,
        rope: Any = None,
        qk_norm: tuple[torch.nn.Module, torch.nn.Module] | None = None,
    ) -> torch.Tensor:
        """rope (layers/rotary.RotaryTables): rotate q and k at meta.positions first, where
        the backend can in the same kernel that writes K and V to the cache; qk_norm (two
        per-head RMSNorms, Qwen3's q_norm and k_norm; with rope only): applied before the
        rotation, in that kernel too where the backend can."""
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if rope is not None:
            if self._alibi is not None:
                raise ValueError("a layer takes either rotary embeddings or ALiBi, not both")
            out = self.backend.rotary_paged_attention(q, k, v, kv_cache, meta, self.scale,
                                                      self.sliding_window, rope, qk_norm)
        else:
            if qk_norm is not None:
                raise ValueError("q and k norms come with rotary embeddings here")
            out = self.backend.paged_attention(q, k, v, kv_cache, meta, self.scale,
                                               self.sliding_window, self.alibi_slopes(q.device))
        return out.reshape(-1, self.num_heads * self.head_dim)

    def over_cache(self, q: torch.Tensor, kv_cache: torch.Tensor,
                   meta: PagedAttentionInputMetadata) -> torch.Tensor:
        """The attention of q ([T, num_heads * head_dim], rotated) over a cache that already
        holds this step's K/V (written by a folded projection, layers/norm_fold.py)."""
        q = q.view(-1, self.num_heads, self.head_dim)
        out = self.backend.cached_attention(q, kv_cache, meta, self.scale, self.sliding_window)
        return out.reshape(-1, self.num_heads * self.head_dim)
