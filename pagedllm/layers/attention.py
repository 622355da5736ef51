"""PagedAttention: write this step's K/V into the paged cache, then attend over it.

CUDA tensors go to the Triton kernels. On the CPU, decode-only steps go to the C kernel
(kernels/cpu) when it is built, everything else to the pure-torch reference. Neither
reads device values on the host, so a decode step can be captured in a CUDA graph (the split
count then comes fixed from the metadata).
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.kernels import reference
from pagedllm.kernels.metadata import PagedAttentionInputMetadata


def use_triton(q: torch.Tensor) -> bool:
    """The Triton kernels for CUDA tensors (tests also route CPU tensors to them when Triton
    runs in its interpreter)."""
    return q.is_cuda


def _triton_ops():
    from pagedllm.kernels import triton_attention, triton_cache

    return triton_cache.triton_write_kv_cache, triton_attention.triton_paged_attention


class PagedAttention(nn.Module):
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
    ) -> torch.Tensor:
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        alibi = self.alibi_slopes(q.device)
        if use_triton(q):
            write, attend = _triton_ops()
            write(k, v, kv_cache, meta.slot_mapping)
            out = attend(q, kv_cache, meta, self.scale, self.sliding_window, alibi,
                         num_splits=meta.num_splits)
        else:
            in_c = cpu_kernels.applies(q, k, v, kv_cache) and cpu_kernels.rows_contiguous(k, v)
            (cpu_kernels if in_c else reference).write_kv_cache(k, v, kv_cache, meta.slot_mapping)
            if in_c and cpu_kernels.is_decode_step(q, meta):
                out = cpu_kernels.paged_attention_decode(q, kv_cache, meta, self.scale,
                                                         self.sliding_window, alibi)
            else:
                out = reference.paged_attention(q, kv_cache, meta, self.scale,
                                                self.sliding_window, alibi, key=k, value=v)
        return out.reshape(-1, self.num_heads * self.head_dim)
