"""The gated MLP activation: silu(gate) * up on a fused [gate | up] projection, one kernel
(Triton on CUDA, C on the CPU in fp32; see layers/dispatch.py); quantized for an FP8 linear
where one reads it (layers/fp8_linear.py)."""
from __future__ import annotations

import torch

from pagedllm.layers.dispatch import Dispatched
from pagedllm.layers.fp8_linear import FP8Rows, takes_fp8_rows


class SiluAndMul(Dispatched):
    fp8_out = False  # as RMSNorm's: the output quantized for the FP8Linear reading it

    def forward(self, x: torch.Tensor) -> torch.Tensor | FP8Rows:
        """[..., 2 * d] -> [..., d]."""
        if self.fp8_out and takes_fp8_rows(x):
            return self.backend.silu_and_mul_fp8(x)
        return self.backend.silu_and_mul(x)
