"""The gated MLP activation: silu(gate) * up on a fused [gate | up] projection."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.kernels import cpu as cpu_kernels


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * d] -> [..., d]. One fused kernel: Triton on CUDA, C on the CPU in fp32;
    torch ops elsewhere."""
    if x.is_cuda:
        from pagedllm.kernels.triton_ops import triton_silu_and_mul

        return triton_silu_and_mul(x)
    if cpu_kernels.applies(x):
        return cpu_kernels.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
