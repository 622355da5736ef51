"""RMSNorm with the residual add folded in (one pass over the hidden states: one Triton
kernel on CUDA, one C kernel on the CPU in fp32)."""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.kernels import cpu as cpu_kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With it: (norm(x + residual), x + residual)."""
        if x.is_cuda:  # one fused kernel for the add, the norm and the scale
            from pagedllm.kernels.triton_ops import triton_rms_norm

            return triton_rms_norm(x, self.weight, self.eps, residual)
        if cpu_kernels.applies(x, self.weight, *([residual] if residual is not None else [])):
            return cpu_kernels.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
