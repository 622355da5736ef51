"""RMSNorm with the residual add folded in: one pass over the hidden states (a Triton kernel
on CUDA, a C kernel on the CPU in fp32; see layers/dispatch.py)."""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.dispatch import Dispatched


class RMSNorm(Dispatched):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With it: (norm(x + residual), x + residual)."""
        return self.backend.rms_norm(x, self.weight, self.eps, residual)
