"""Linear layers whose CPU fp32 weights can be prepacked for MKL's GEMM.

MKL can lay a GEMM's weight matrix out once in its own blocked format (`cblas_sgemm_pack`)
and skip that work on every call; torch exposes it as the `mkl::_mkl_linear` op, the one its
own compiler uses for frozen CPU models. The packed copy takes 2-16x the memory of the
weight it packs (more for small matrices), and packing a model takes seconds. Measured on an
AMD EPYC (AVX2, 2 threads, SmolLM2-135M, 32 decoding sequences), only the LM head gains (4-5%
more tokens per CPU-second); the other linears do not. So the worker packs the head lazily,
on the first batched decode step (pack_head_when_batched), and every linear only when
PAGEDLLM_MKL_PACK=all. Prompt batches keep F.linear. Anywhere else (CUDA, other dtypes:
where the backend of layers/dispatch.py does not pack, or without MKL) a Linear is nn.Linear.

On CUDA, a batch of one row (batch-1 decode) in bf16/fp16 goes through
kernels/triton_gemv.skinny_matmul: one kernel streaming the weight, where cuBLAS adds a
split-K reduction kernel to its small GEMVs (measured at Llama-3-8B's shapes on an H200:
119 vs 123 us per layer and LM head share; cuBLAS is ahead from 4 rows on).
PAGEDLLM_SKINNY_ROWS=0 keeps cuBLAS for every batch.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed import parallel_state as ps
from pagedllm.distributed.communication import all_gather
from pagedllm.layers import dispatch
from pagedllm.layers.lora import LoRALayer

logger = logging.getLogger(__name__)


def _mkl_ops_available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def pack_for_mkl(weight: torch.Tensor) -> torch.Tensor | None:
    """MKL's packed copy of a CPU fp32 [out, in] weight, or None where packing does not apply.

    The packed layout does not depend on the batch size it was packed for (checked here on
    a few sizes against F.linear), so one copy serves every batch: `linear` passes each call's
    own row count as the op's batch size, which takes its packed path."""
    if not dispatch.choose(weight.device, weight.dtype).packs_linears or not _mkl_ops_available():
        return None
    weight = weight.detach().contiguous()
    packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, 32)
    for rows in (1, 7, 64):
        x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows))
        got, want = torch.ops.mkl._mkl_linear(x, packed, weight, None, rows), F.linear(x, weight)
        # A wrong layout gives unrelated numbers; a right one differs by rounding at most.
        if (got - want).abs().max() > 1e-4 * want.abs().max():
            logger.warning("MKL's packed GEMM disagrees with F.linear: weights stay unpacked")
            return None
    return packed


# Above this many rows (prompt batches) the packed GEMM measured slower than F.linear here.
MAX_PACKED_ROWS = 128
SKINNY_MAX_ROWS = min(int(os.environ.get("PAGEDLLM_SKINNY_ROWS", "1")), 16)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; on CUDA through the skinny kernel for a few rows, on the CPU through MKL's
    packed weight where there is one and the batch is small."""
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype:
        return _skinny_linear(x, weight, bias)
    if packed is None or x.device.type != "cpu" or x.dtype != torch.float32:
        return F.linear(x, weight, bias)
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if rows.shape[0] > MAX_PACKED_ROWS:
        return F.linear(x, weight, bias)
    out = torch.ops.mkl._mkl_linear(rows, packed, weight, bias, rows.shape[0])
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], weight.shape[0])


def _skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                   ) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] > SKINNY_MAX_ROWS or rows.shape[0] == 0 or not weight.is_contiguous():
        return F.linear(x, weight, bias)
    from pagedllm.kernels.triton_gemv import skinny_matmul  # Triton only where it runs

    out = skinny_matmul(rows, weight)
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """nn.Linear that uses a packed copy of its weight once `prepack()` made one."""

    packed: torch.Tensor | None = None
    lora: "LoRALayer | None" = None  # adapters attached by pagedllm/lora (layers/lora.py)

    def prepack(self) -> bool:
        self.packed = pack_for_mkl(self.weight)
        return self.packed is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is not None and self.lora.joins(x):
            return self.lora.joint_forward(x, linear)  # one row: the shrink in the GEMV
        out = linear(x, self.weight, self.bias, self.packed)
        return out if self.lora is None else self.lora(x, out)


def prepack_model(model: nn.Module) -> int:
    """Pack every Linear of the model whose weight is CPU fp32, and the input embedding when
    it doubles as the LM head (tied embeddings); the number of weights packed."""
    count = sum(m.prepack() for m in model.modules() if isinstance(m, Linear))
    if getattr(model, "lm_head", True) is None and isinstance(model.embed_tokens, nn.Embedding):
        count += prepack_head(model)
    return count


def prepack_head(model: nn.Module) -> bool:
    """Pack the LM head (the input embedding when tied); whether it was packed."""
    if model.lm_head is not None:
        return model.lm_head.prepack()
    model.packed_tied_head = pack_for_mkl(model.embed_tokens.weight)
    return model.packed_tied_head is not None


def compute_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """fp32 logits from the model's LM head, or from its input embedding when tied. Under
    tensor parallelism each rank holds a slice of the vocabulary: the slices are gathered,
    so every rank gets the whole row (and samples the same tokens).

    With model.pack_head_when_batched set, the first call of 2 to MAX_PACKED_ROWS rows packs
    the head first (a single sequence gains nothing from it)."""
    head = model.lm_head if model.lm_head is not None else model.embed_tokens
    if not isinstance(head, (nn.Linear, nn.Embedding)):  # quantized (gguf_linear, fp8_linear)
        device = next(head.buffers()).device
        forward = head if model.lm_head is not None else head.as_lm_head
        return forward(hidden.to(device)).float()
    if getattr(model, "pack_head_when_batched", False) and 2 <= hidden.shape[0] <= MAX_PACKED_ROWS:
        model.pack_head_when_batched = False
        prepack_head(model)
    if model.lm_head is not None:
        weight, packed = model.lm_head.weight, model.lm_head.packed
    else:
        weight, packed = model.embed_tokens.weight, getattr(model, "packed_tied_head", None)
    logits = linear(hidden.to(weight.device), weight, packed=packed)
    if ps.is_initialized():
        logits = all_gather(logits, dim=-1)[..., :model.config.vocab_size]
    return logits.float()
