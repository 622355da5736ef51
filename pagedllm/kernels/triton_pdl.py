"""Programmatic dependent launch (PDL, Hopper and later) for the kernels of a decode step.

A kernel launched with PDL may start while the kernel before it on the stream is still
running: its programs get resident, do what does not depend on that kernel (a GEMV loads
its first weight tile), then `gdc_wait()` until that kernel has finished and its writes are
visible. Each such kernel also calls `gdc_launch_dependents()` once it has waited, so the
next kernel's programs can start during its own tail. A batch-1 decode step is ~450 short
kernels; PDL hides their launch latency and each GEMV's ramp-up behind the kernel before.

The invariant every kernel launched with PDL keeps: every program calls gdc_wait()
unconditionally before it reads anything an earlier kernel wrote or writes anything (an
output buffer may be memory an earlier kernel still reads), and before it returns. That
makes the wait transitive: a kernel that has finished had waited for the one before it.

PAGEDLLM_PDL=0 turns it off (to compare). Off on the interpreter (TRITON_INTERPRET=1: it
has no gdc ops) and before compute capability 9.0. The kernels take the flag as the
constexpr PDL; launch_kwargs gives both it and Triton's launch option.
"""
from __future__ import annotations

import functools
import os

import torch

ENABLED = os.environ.get("PAGEDLLM_PDL", "1") != "0"


@functools.lru_cache(maxsize=None)
def enabled(device: torch.device) -> bool:
    if not ENABLED or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def launch_kwargs(device: torch.device) -> dict:
    """Keyword arguments for a launch of a kernel that takes `PDL: tl.constexpr`."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}
