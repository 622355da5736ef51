"""RMSNorm with the residual add folded in: one pass over the hidden states (a Triton kernel
on CUDA, a C kernel on the CPU in fp32; see layers/dispatch.py). In front of an FP8 linear
it can hand on its output quantized (layers/fp8_linear.py)."""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.dispatch import Dispatched
from pagedllm.layers.fp8_linear import FP8Rows, takes_fp8_rows


class RMSNorm(Dispatched):
    # Set where an FP8Linear alone reads the output (fp8_linear.fuse_input_quantization):
    # batches that linear would quantize come out as its FP8Rows.
    fp8_out = False

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | FP8Rows | tuple[torch.Tensor | FP8Rows, torch.Tensor]:
        """Without residual: norm(x). With it: (norm(x + residual), x + residual)."""
        if self.fp8_out and takes_fp8_rows(x):
            return self.backend.rms_norm_fp8(x, self.weight, self.eps, residual)
        return self.backend.rms_norm(x, self.weight, self.eps, residual)
