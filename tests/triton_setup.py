"""Triton tests run compiled on CUDA and in Triton's interpreter on the CPU.

Import this before any pagedllm.kernels.triton_* module: triton.jit picks interpreted or
compiled kernels when a kernel module is first imported, so TRITON_INTERPRET=1 must be set
(when there is no GPU) before that. A test module importing this is skipped when triton is
not installed.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (pip install 'pagedllm[gpu]')")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"


def skip_unless_runnable(kernel) -> None:
    """Skip the calling test module when `kernel` was compiled (imported by an earlier module
    before TRITON_INTERPRET was set) but the tensors are on the CPU, where it cannot run."""
    from triton.runtime.interpreter import InterpretedFunction

    if DEVICE == "cpu" and not isinstance(kernel, InterpretedFunction):
        pytest.skip("Triton kernels were imported without TRITON_INTERPRET=1; run with "
                    "TRITON_INTERPRET=1", allow_module_level=True)
