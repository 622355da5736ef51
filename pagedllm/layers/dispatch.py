"""Which kernels run a layer: Triton on CUDA; on the CPU in fp32, the C kernels
(kernels/cpu) and MKL-packed linears; pure torch anywhere else.

The choice is made per layer, once: when the layer is built (for the default device and
dtype) and again when the model is placed on its devices (`select`, from the weights around
each layer), never per call. A backend runs what its kernels take and hands anything else (a
strided tensor, a prompt chunk on the CPU) to the pure-torch code every backend inherits from
TorchBackend. A new backend is one class here and a line in `choose`.

The one test seam: `force(name)` makes `choose` give that backend to every layer built or
selected while it is in force (the pure-torch oracle, or Triton on CPU tensors under
TRITON_INTERPRET=1).
"""
from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.kernels import reference
from pagedllm.kernels.metadata import PagedAttentionInputMetadata
from pagedllm.layers.fp8_linear import FP8Rows


class TorchBackend:
    """Pure torch (kernels/reference.py): any device, any dtype."""

    name = "torch"
    packs_linears = False  # Linear keeps F.linear

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
        return reference.rms_norm(x, weight, eps, residual)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return reference.silu_and_mul(x)

    # The two layers that can hand an FP8 linear its input quantized
    # (layers/fp8_linear.py): here the plain layer, then the quantization.
    def rms_norm_fp8(self, x, weight, eps, residual=None):
        out = self.rms_norm(x, weight, eps, residual)
        if residual is None:
            return FP8Rows.quantize(out)
        return FP8Rows.quantize(out[0]), out[1]

    def silu_and_mul_fp8(self, x):
        return FP8Rows.quantize(self.silu_and_mul(x))

    def rotary_embedding(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         rope: Any, meta: PagedAttentionInputMetadata | None):
        """q [T, heads, head_dim], k [T, kv_heads, head_dim] rotated; rope: RotaryTables.
        With the step's metadata the cos/sin rows of the positions are looked up once per
        step, not once per layer."""
        if meta is None:
            cos, sin = rope.rows(positions, q.dtype)
        else:
            cos, sin = meta.step_cache(("rotary", rope, q.dtype),
                                       lambda: rope.rows(positions, q.dtype))
        return reference.rotate(q, cos, sin), reference.rotate(k, cos, sin)

    def paged_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        kv_cache: torch.Tensor, meta: PagedAttentionInputMetadata, scale: float,
                        sliding_window: int | None, alibi: torch.Tensor | None) -> torch.Tensor:
        """Write this step's K/V into the paged cache, then attend over it.
        q [T, heads, head_dim], k and v [T, kv_heads, head_dim]."""
        reference.write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        return reference.paged_attention(q, kv_cache, meta, scale, sliding_window, alibi,
                                         key=k, value=v)

    def rotary_paged_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               kv_cache: torch.Tensor, meta: PagedAttentionInputMetadata,
                               scale: float, sliding_window: int | None, rope: Any,
                               qk_norm: tuple[nn.Module, nn.Module] | None = None
                               ) -> torch.Tensor:
        """The rotary embedding of q and k at meta.positions (after their per-head RMSNorms
        qk_norm, Qwen3's q_norm and k_norm), then paged_attention."""
        if qk_norm is not None:
            q, k = qk_norm[0](q), qk_norm[1](k)
        q, k = self.rotary_embedding(meta.positions, q, k, rope, meta)
        return self.paged_attention(q, k, v, kv_cache, meta, scale, sliding_window, None)

    def cached_attention(self, q: torch.Tensor, kv_cache: torch.Tensor,
                         meta: PagedAttentionInputMetadata, scale: float,
                         sliding_window: int | None) -> torch.Tensor:
        """paged_attention whose K/V something else already wrote to the cache (a folded
        projection, layers/norm_fold.py)."""
        return reference.paged_attention(q, kv_cache, meta, scale, sliding_window, None)


class CpuBackend(TorchBackend):
    """The CPU in fp32: the C kernels where the library is built (kernels/cpu/build.py), and
    linears packed for MKL (layers/linear.py)."""

    name = "cpu"
    packs_linears = True

    @functools.cached_property
    def has_kernels(self) -> bool:
        return cpu_kernels.available()

    def rms_norm(self, x, weight, eps, residual=None):
        if self.has_kernels:
            return cpu_kernels.rms_norm(x, weight, eps, residual)
        return super().rms_norm(x, weight, eps, residual)

    def silu_and_mul(self, x):
        if self.has_kernels:
            return cpu_kernels.silu_and_mul(x)
        return super().silu_and_mul(x)

    def rotary_embedding(self, positions, q, k, rope, meta):
        if self.has_kernels and cpu_kernels.rows_contiguous(q, k):
            cpu_kernels.rotary_embedding_(positions, q, k, *rope.tables(q.device))
            return q, k
        return super().rotary_embedding(positions, q, k, rope, meta)

    def paged_attention(self, q, k, v, kv_cache, meta, scale, sliding_window, alibi):
        # The C decode kernel reads one query per sequence; prompt chunks attend through
        # the reference (SDPA), after the C kernel wrote their K/V.
        if not (self.has_kernels and cpu_kernels.rows_contiguous(k, v)):
            return super().paged_attention(q, k, v, kv_cache, meta, scale, sliding_window, alibi)
        cpu_kernels.write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        if cpu_kernels.is_decode_step(q, meta):
            return cpu_kernels.paged_attention_decode(q, kv_cache, meta, scale, sliding_window,
                                                      alibi)
        return reference.paged_attention(q, kv_cache, meta, scale, sliding_window, alibi,
                                         key=k, value=v)


# PAGEDLLM_FOLD_QK_NORM=0: Qwen3's q and k norms as kernels of their own, not folded into
# the rotary and cache write (an A/B).
FOLD_QK_NORM = os.environ.get("PAGEDLLM_FOLD_QK_NORM", "1") != "0"


class TritonBackend(TorchBackend):
    """The Triton kernels (CUDA; CPU tensors too under TRITON_INTERPRET=1). None of them
    reads a device value on the host, so a decode step can be captured in a CUDA graph (the
    split count then comes fixed from the metadata)."""

    name = "triton"

    def rms_norm(self, x, weight, eps, residual=None):
        from pagedllm.kernels.triton_ops import triton_rms_norm

        return triton_rms_norm(x, weight, eps, residual)

    def silu_and_mul(self, x):
        from pagedllm.kernels.triton_ops import triton_silu_and_mul

        return triton_silu_and_mul(x)

    def rms_norm_fp8(self, x, weight, eps, residual=None):
        from pagedllm.kernels.triton_ops import triton_rms_norm_fp8

        q, scale, residual_out = triton_rms_norm_fp8(x, weight, eps, residual)
        rows = FP8Rows(q, scale, x.dtype, x.shape)
        return rows if residual is None else (rows, residual_out)

    def silu_and_mul_fp8(self, x):
        from pagedllm.kernels.triton_ops import triton_silu_and_mul_fp8

        q, scale = triton_silu_and_mul_fp8(x)
        return FP8Rows(q, scale, x.dtype, torch.Size((*x.shape[:-1], x.shape[-1] // 2)))

    def rotary_embedding(self, positions, q, k, rope, meta):
        if q.stride(-1) != 1 or k.stride(-1) != 1:
            return super().rotary_embedding(positions, q, k, rope, meta)
        from pagedllm.kernels.triton_ops import triton_rotary_embedding

        triton_rotary_embedding(positions, q, k, rope.cos_sin_cache(q.device))
        return q, k

    def paged_attention(self, q, k, v, kv_cache, meta, scale, sliding_window, alibi):
        from pagedllm.kernels.triton_attention import triton_paged_attention
        from pagedllm.kernels.triton_cache import triton_write_kv_cache

        triton_write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        return triton_paged_attention(q, kv_cache, meta, scale, sliding_window, alibi,
                                      num_splits=meta.num_splits)

    def rotary_paged_attention(self, q, k, v, kv_cache, meta, scale, sliding_window, rope,
                               qk_norm=None):
        cos_sin = rope.cos_sin_cache(q.device)
        strided = not all(t.stride(-1) == 1 for t in (q, k, v))
        # The norms fold into the rotary kernel where the rotation covers whole heads.
        fold = (qk_norm is not None and FOLD_QK_NORM and not strided
                and cos_sin.shape[-1] == q.shape[-1] and qk_norm[0].eps == qk_norm[1].eps)
        if qk_norm is not None and not fold:
            q, k = qk_norm[0](q), qk_norm[1](k)  # contiguous outputs
        if not all(t.stride(-1) == 1 for t in (q, k, v)):
            return super().rotary_paged_attention(q, k, v, kv_cache, meta, scale,
                                                  sliding_window, rope)
        from pagedllm.kernels.triton_cache import triton_rotary_write_kv_cache

        norms = (qk_norm[0].weight, qk_norm[1].weight, qk_norm[0].eps) if fold else None
        triton_rotary_write_kv_cache(meta.positions, q, k, v, kv_cache, meta.slot_mapping,
                                     cos_sin, norms)
        return self.cached_attention(q, kv_cache, meta, scale, sliding_window)

    def cached_attention(self, q, kv_cache, meta, scale, sliding_window):
        from pagedllm.kernels.triton_attention import triton_paged_attention

        return triton_paged_attention(q, kv_cache, meta, scale, sliding_window, None,
                                      num_splits=meta.num_splits)


Backend = TorchBackend
BACKENDS: dict[str, Backend] = {b.name: b for b in (TorchBackend(), CpuBackend(), TritonBackend())}
_forced: Backend | None = None


def choose(device: torch.device | str, dtype: torch.dtype) -> Backend:
    """The backend for layers whose weights are on `device` in `dtype`."""
    if _forced is not None:
        return _forced
    device = torch.device(device)
    if device.type == "cuda":
        return BACKENDS["triton"]
    if device.type == "cpu" and dtype == torch.float32:
        return BACKENDS["cpu"]
    return BACKENDS["torch"]


@contextlib.contextmanager
def force(name: str) -> Iterator[Backend]:
    """Tests: every layer built or selected inside gets backend `name`."""
    global _forced
    previous, _forced = _forced, BACKENDS[name]
    try:
        yield _forced
    finally:
        _forced = previous


class Dispatched(nn.Module):
    """A layer that computes through `self.backend`."""

    def __init__(self) -> None:
        super().__init__()
        self.backend = choose(torch.get_default_device(), torch.get_default_dtype())


def select(module: nn.Module, device: torch.device | None = None,
           dtype: torch.dtype | None = None) -> None:
    """Give every Dispatched layer in `module` the backend of the nearest weights: its own (or
    its children's), else those of the nearest module above it that has weights. Call once
    the weights are on their devices (placement does)."""
    first = next(module.parameters(), None)
    if first is not None:
        device, dtype = first.device, first.dtype
    if isinstance(module, Dispatched) and device is not None:
        module.backend = choose(device, dtype)
    for child in module.children():
        select(child, device, dtype)
