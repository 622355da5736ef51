"""RMSNorms folded into the GEMVs of a one-row decode step (kernels/triton_gemv.RmsInput).

A decoder layer at one row runs, on CUDA: norm, qkv GEMV, rotary + cache write, attention,
o GEMV, residual add + norm, gate_up GEMV, SiLU-and-mul, down GEMV, residual add. Folded,
the o and down GEMVs add the residual and write the next norm's input (h * g and the sums of
h^2), the qkv and gate_up GEMVs scale their outputs by 1/rms, gate_up applies silu(gate) *
up itself, and qkv rotates q and k and writes k and v to the cache (rope: not for models
with per-head q/k norms, which go between): the norm, activation and rotary kernels between
them are gone, and a step runs its attention over the cache.

A step folds when every projection is a plain Linear in x's dtype or an FP8Linear (both
through the skinny kernel at one row), without tensor parallelism (the residual is added
after the all-reduce there) or adapter rows (their updates go between the GEMV and the add),
on the Triton backend.

On by default; PAGEDLLM_FOLD_NORMS=0 runs the norm, activation and rotary kernels instead
(scripts/gpu_check.sh's decode-8b-nofold steps time the two), PAGEDLLM_FOLD_ROPE=0 keeps
only the rotary kernel (to tell the two folds apart).
"""
from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from pagedllm.distributed import parallel_state as ps
from pagedllm.kernels.metadata import PagedAttentionInputMetadata
from pagedllm.layers import fp8_linear, linear
from pagedllm.layers.fp8_linear import FP8Linear
from pagedllm.layers.lora import lora_active
from pagedllm.layers.norms import RMSNorm

ENABLED = os.environ.get("PAGEDLLM_FOLD_NORMS", "1") != "0"
ROPE = os.environ.get("PAGEDLLM_FOLD_ROPE", "1") != "0"


def foldable(norms: list[RMSNorm], producers: list[nn.Module], consumers: list[nn.Module],
             gated: list[nn.Module]) -> bool:
    """Whether these modules can fold (checked once per model: what they are does not change
    after loading). Producers add the residual, gated consumers ([gate | up]) the SiLU."""
    if not ENABLED or any(n.backend.name != "triton" for n in norms):
        return False
    if not all(_skinny_at_one_row(p) for p in producers + consumers + gated):
        return False
    from pagedllm.kernels.triton_gemv import gates  # Triton only where it runs

    return all(gates(_weight(p)[0]) for p in gated)


def rope_foldable(qkv_proj: nn.Module, head_dim: int, qk_norm: bool) -> bool:
    """Whether a [q | k | v] projection (of a foldable model) can also fold the rotary
    embedding and the cache write: no per-head norms after it, whole pairs per block."""
    from pagedllm.kernels.triton_gemv import ropes  # Triton only where it runs

    return ROPE and not qk_norm and ropes(_weight(qkv_proj)[0], head_dim)


def folded_qkv(qkv_proj: nn.Module, x, num_heads: int, num_kv_heads: int, rope: Any,
               kv_cache: torch.Tensor, meta: PagedAttentionInputMetadata) -> torch.Tensor:
    """The one-row [q | k | v] product with the rotary embedding (rope: RotaryTables) and
    the cache write folded: q [1, num_heads * head_dim], rotated; k and v in kv_cache."""
    from pagedllm.kernels.triton_gemv import RopeCache

    fold = RopeCache(num_heads, num_kv_heads, meta.positions, meta.slot_mapping,
                     rope.cos_sin_cache(kv_cache.device), kv_cache)
    return folded_linear(qkv_proj, x, rope=fold)[0]


def folds(x: torch.Tensor) -> bool:
    """Whether this forward (x: the step's hidden rows) folds, given foldable modules."""
    return (x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16)
            and not lora_active() and not ps.is_initialized())


def folded_linear(proj: nn.Module, x, **folds):
    """proj's one-row GEMV with folds (triton_gemv.folded_matmul's keywords): (out, RmsInput
    of the next norm or None). x: a [1, K] row or an RmsInput."""
    from pagedllm.kernels.triton_gemv import folded_matmul  # Triton only where it runs

    weight, scale = _weight(proj)
    return folded_matmul(x, weight, scale, bias=proj.bias, **folds)


def _weight(proj: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight the skinny kernel reads, and its FP8 scales."""
    if isinstance(proj, FP8Linear):
        return proj.qweight, proj.weight_scale.view(-1)
    return proj.weight, None


def _skinny_at_one_row(proj: nn.Module) -> bool:
    """The projection's one-row forward is the skinny kernel (layers/linear.py,
    layers/fp8_linear.py)."""
    if isinstance(proj, FP8Linear):
        return fp8_linear.SMALL_BATCH_ROWS >= 1
    return (isinstance(proj, linear.Linear) and linear.SKINNY_MAX_ROWS >= 1
            and proj.weight.dtype in (torch.bfloat16, torch.float16)
            and proj.weight.is_contiguous())
