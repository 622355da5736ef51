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

Kernels before the one right before a kernel have finished when it starts (that one waited
for them before it let this one launch), and so has every host copy before the step. So
before its wait a kernel may also read what those wrote: its step's inputs (sequence
lengths, block tables), and memory the kernel right before does not write.

PAGEDLLM_PDL=0 turns it off (to compare). Off on the interpreter (TRITON_INTERPRET=1: it
has no gdc ops) and before compute capability 9.0. The kernels take the flag as the
constexpr PDL; launch_kwargs gives both it and Triton's launch option.

PAGEDLLM_L2_PREFETCH=1 (an A/B, off by default until measured on a GPU; only with PDL):
before its wait, a kernel also asks L2 for what it will read first that the kernel before
does not write (`prefetch_l2`): the one-row GEMVs their weight slices, decode attention its
first key tile. L2 is where every SM's writes land, so a line prefetched while the kernel
before still writes it is read fresh after the wait.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

ENABLED = os.environ.get("PAGEDLLM_PDL", "1") != "0"
L2_PREFETCH = os.environ.get("PAGEDLLM_L2_PREFETCH", "0") == "1"


@functools.lru_cache(maxsize=None)
def enabled(device: torch.device) -> bool:
    if not ENABLED or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def launch_kwargs(device: torch.device) -> dict:
    """Keyword arguments for a launch of a kernel that takes `PDL: tl.constexpr`."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}


def l2_prefetch(device: torch.device) -> bool:
    """Whether kernels on this device prefetch into L2 before their PDL wait."""
    return L2_PREFETCH and enabled(device)


@triton.jit
def prefetch_l2(ptrs, nbytes):
    """Ask L2 for `nbytes` (a multiple of 16) at each of `ptrs` (16-byte aligned): one bulk
    prefetch per element (CUDA, sm_90 and later; nothing is read into registers)."""
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
        [ptrs, tl.full(ptrs.shape, 0, tl.int32) + nbytes], dtype=tl.int32, is_pure=False,
        pack=1)
