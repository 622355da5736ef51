"""RMSNorms folded into the GEMVs of a one-row decode step (kernels/triton_gemv.RmsInput).

A decoder layer at one row runs, on CUDA: norm, qkv GEMV, attention, o GEMV, residual add +
norm, gate_up GEMV, SiLU-and-mul, down GEMV, residual add. Folded, the o and down GEMVs add
the residual and write the next norm's input (h * g and the sums of h^2), the qkv and
gate_up GEMVs scale their outputs by 1/rms, and gate_up applies silu(gate) * up itself: the
norm and activation kernels between them are gone.

A step folds when every projection is a plain Linear in x's dtype or an FP8Linear (both
through the skinny kernel at one row), without tensor parallelism (the residual is added
after the all-reduce there) or adapter rows (their updates go between the GEMV and the add),
on the Triton backend.

Off unless PAGEDLLM_FOLD_NORMS=1: the kernels pass their tests under Triton's interpreter
but have not yet been compiled and timed on a GPU (scripts/gpu_check.sh's decode-8b-fold
steps measure them against the default).
"""
from __future__ import annotations

import os

import torch
from torch import nn

from pagedllm.distributed import parallel_state as ps
from pagedllm.layers import fp8_linear, linear
from pagedllm.layers.fp8_linear import FP8Linear
from pagedllm.layers.lora import lora_active
from pagedllm.layers.norms import RMSNorm

ENABLED = os.environ.get("PAGEDLLM_FOLD_NORMS", "0") == "1"


def foldable(norms: list[RMSNorm], producers: list[nn.Module], consumers: list[nn.Module],
             gated: list[nn.Module]) -> bool:
    """Whether these modules can fold (checked once per model: what they are does not change
    after loading). Producers add the residual, gated consumers ([gate | up]) the SiLU: no
    bias (it would go after those)."""
    if not ENABLED or any(n.backend.name != "triton" for n in norms):
        return False
    if not all(_skinny_at_one_row(p) for p in producers + consumers + gated):
        return False
    from pagedllm.kernels.triton_gemv import gates  # Triton only where it runs

    return (all(p.bias is None for p in producers + gated)
            and all(gates(_weight(p)[0]) for p in gated))


def folds(x: torch.Tensor) -> bool:
    """Whether this forward (x: the step's hidden rows) folds, given foldable modules."""
    return (x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16)
            and not lora_active() and not ps.is_initialized())


def folded_linear(proj: nn.Module, x, **folds):
    """proj's one-row GEMV with folds (triton_gemv.folded_matmul's keywords): (out, RmsInput
    of the next norm or None). x: a [1, K] row or an RmsInput."""
    from pagedllm.kernels.triton_gemv import folded_matmul  # Triton only where it runs

    weight, scale = _weight(proj)
    out, rms = folded_matmul(x, weight, scale, **folds)
    if proj.bias is not None:  # plain consumers only (foldable)
        out = out + proj.bias
    return out, rms


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
