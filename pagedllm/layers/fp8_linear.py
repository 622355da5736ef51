"""FP8 weights on CUDA (`--quantization fp8`): half the bytes of bf16 for every decode step.

Each decoder linear's weight is stored in FP8 E4M3 with one fp32 scale per output channel
(w ~= q * scale[n], scale = max|w[n]| / 448). Two kernels, by batch size:
  up to 16 rows (decode): kernels/triton_gemv.skinny_matmul reads the FP8 weight and the bf16
      activations as they are (weight-only quantization: the bytes are what decode pays for);
  more rows: the activations are quantized per row on the fly (dynamic scales, the same rule)
      and torch._scaled_mm multiplies FP8 x FP8 on the tensor cores, both scales applied to
      its fp32 accumulators, output bf16: vLLM's dynamic FP8 scheme.
The LM head stays bf16. On the CPU (tests) the second form runs with torch ops.

Where an FP8 linear alone reads the output of an RMSNorm or of SiLU-and-mul (a decoder
layer's qkv, gate_up and down projections), that layer quantizes its own output rows in the
same kernel and hands FP8Rows on (fuse_input_quantization): the quantization pass over the
activations, a kernel per linear, is gone. PAGEDLLM_FP8_FUSED_QUANT=0 turns it off.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from pagedllm.layers.lora import LoRALayer

# Batches of up to this many rows (at most 16, the kernel's block) take the weight-only
# kernel; PAGEDLLM_FP8_SMALL_BATCH=0 sends every batch to torch._scaled_mm (to compare the
# two on a GPU).
SMALL_BATCH_ROWS = min(int(os.environ.get("PAGEDLLM_FP8_SMALL_BATCH", "16")), 16)
# torch._scaled_mm with fast accumulation: the tensor cores' FP8 accumulators are not
# promoted to fp32 every 128 K steps, as in vLLM's CUTLASS FP8 kernels on Hopper. The
# per-row-scaled kernel is much slower with promotion (pytorch/pytorch#147971; the FP8 mix
# measured in docs/benchmarks.md), and the FP8 tests' error bounds hold either way.
# PAGEDLLM_FP8_FAST_ACCUM=0 promotes (gpu-check's sharegpt-fp8-promoted, an A/B).
FAST_ACCUM = os.environ.get("PAGEDLLM_FP8_FAST_ACCUM", "1") != "0"
FUSE_INPUT_QUANT = os.environ.get("PAGEDLLM_FP8_FUSED_QUANT", "1") != "0"
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
_MIN_SCALE = 1e-12  # an all-zero row gets a tiny scale instead of dividing by zero


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (FP8 [M, K], fp32 scales [M, 1]) with x ~= q * scale, per row."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_(min=_MIN_SCALE)
    return (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


@dataclass(frozen=True)
class FP8Rows:
    """Activations quantized per row for an FP8Linear by the layer that computed them:
    x ~= q * scale."""
    q: torch.Tensor  # [rows, K] float8_e4m3fn
    scale: torch.Tensor  # [rows, 1] fp32
    dtype: torch.dtype  # of x: the linear's output dtype
    shape: torch.Size  # of x

    @classmethod
    def quantize(cls, x: torch.Tensor) -> "FP8Rows":
        return cls(*quantize_rows(x.reshape(-1, x.shape[-1])), x.dtype, x.shape)


def takes_fp8_rows(x: torch.Tensor) -> bool:
    """Whether an FP8Linear multiplies x's rows quantized: every batch but the small ones,
    which the weight-only kernel multiplies in x's dtype on CUDA."""
    return x.numel() > SMALL_BATCH_ROWS * x.shape[-1]


def fp8_matmul_reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor
                         ) -> torch.Tensor:
    """What FP8Linear computes, in plain fp32 ops: quantized activations times the
    dequantized weight. The oracle of the tests."""
    xq, xs = quantize_rows(x.reshape(-1, x.shape[-1]))
    out = (xq.float() * xs) @ (qweight.float() * scale.view(-1, 1)).T
    return out.to(x.dtype).reshape(*x.shape[:-1], qweight.shape[0])


class FP8Linear(nn.Module):
    """y = x . W^T (+ bias) with W in FP8 E4M3 and per-output-channel scales."""

    lora: "LoRALayer | None" = None  # adapters attached by pagedllm/lora (layers/lora.py)

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("weight_scale", scale.float().reshape(1, -1).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "FP8Linear":
        qweight, scale = quantize_rows(linear.weight.detach())
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(qweight, scale.view(-1), bias)

    def forward(self, x: "torch.Tensor | FP8Rows") -> torch.Tensor:
        if isinstance(x, FP8Rows):  # quantized by the layer before (then without LoRA)
            out = self._scaled_mm(x.q, x.scale, x.dtype)
        else:
            out = self._matmul(x.reshape(-1, self.in_features))
        if self.bias is not None:
            out = out + self.bias
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.lora is None else self.lora(x, out)

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        if not rows.is_cuda:
            return self._scaled_mm(*quantize_rows(rows), rows.dtype)
        from pagedllm.kernels import triton_fp8, triton_gemv  # Triton only where it runs

        if not takes_fp8_rows(rows):
            return triton_gemv.skinny_matmul(rows, self.qweight, self.weight_scale.view(-1))
        return self._scaled_mm(*triton_fp8.quantize_rows(rows), rows.dtype)

    def _scaled_mm(self, xq: torch.Tensor, xs: torch.Tensor, dtype: torch.dtype,
                   fast_accum: bool = FAST_ACCUM) -> torch.Tensor:
        return torch._scaled_mm(xq, self.qweight.t(), scale_a=xs, scale_b=self.weight_scale,
                                out_dtype=dtype, use_fast_accum=fast_accum)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8_e4m3"


def supports(linear: nn.Linear) -> bool:
    """_scaled_mm takes K and N in multiples of 16, and bf16 output with per-row scales."""
    return (linear.in_features % 16 == 0 and linear.out_features % 16 == 0
            and linear.weight.dtype == torch.bfloat16)


def quantize_linears(model: nn.Module, skip: tuple[str, ...] = ()) -> int:
    """Replace every supported nn.Linear not named in skip by its FP8Linear; the count."""
    swaps = [(name, m) for name, m in model.named_modules()
             if isinstance(m, nn.Linear) and name.rpartition(".")[2] not in skip and supports(m)]
    for name, m in swaps:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, FP8Linear.from_linear(m))
    return len(swaps)


def fuse_input_quantization(model: nn.Module) -> int:
    """Let every layer whose output only an FP8Linear (without LoRA) reads quantize that
    output itself (its `fp8_out`): the pairs come from the modules' `fp8_input_pairs()`.
    The number of layers set."""
    fused = 0
    for module in model.modules():
        pairs = getattr(module, "fp8_input_pairs", None)
        for producer, consumer in pairs() if pairs is not None else ():
            if type(consumer) is FP8Linear and consumer.lora is None:
                producer.fp8_out = True
                fused += 1
    return fused
