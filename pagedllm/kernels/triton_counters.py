"""Counters for Triton kernels whose last program to finish a slice completes the reduction
(triton_gemv's split-K, triton_sampling's vocabulary chunks, triton_attention's decode
splits): one int32 per slice group, zero between launches because that last program resets
its own.

Each kernel gets its own buffer per device, allocated at its first (eager) call: never inside
a CUDA graph capture (the model's profiling run and each bucket's warm-up come first).
"""
from __future__ import annotations

import torch

_BUFFERS: dict[tuple[str, torch.device], torch.Tensor] = {}


def counters(kernel: str, device: torch.device, n: int) -> torch.Tensor:
    """At least n zeroed counters for `kernel` on `device`."""
    buf = _BUFFERS.get((kernel, device))
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{kernel}'s counters must be allocated before graph capture")
        buf = torch.zeros(max(n, 1 << 14), dtype=torch.int32, device=device)
        _BUFFERS[kernel, device] = buf
    return buf
