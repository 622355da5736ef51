"""The gated MLP activation: silu(gate) * up on a fused [gate | up] projection, one kernel
(Triton on CUDA, C on the CPU in fp32; see layers/dispatch.py)."""
from __future__ import annotations

import torch

from pagedllm.layers.dispatch import Dispatched


class SiluAndMul(Dispatched):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., 2 * d] -> [..., d]."""
        return self.backend.silu_and_mul(x)
