"""Every Triton kernel compiles for a CUDA target at the launches its wrappers make, checked
on the CPU.

Triton's interpreter (the CPU tests) runs code that its compiler refuses: a helper whose
branches return other dtypes, an atomic on a bf16 pointer. Each broke every launch of a
kernel on the GPU once while the CPU suite passed. tests/triton_compile_check.py runs the
compiler's front end (Python -> TTIR, no GPU needed) in a process of its own, since this
one may have imported the kernels interpreted."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install 'pagedllm[gpu]')")

ROOT = Path(__file__).resolve().parent.parent


KERNELS = ("_apply_bitmask_kernel _check_kernel _expand_kernel _paged_decode_kernel "
           "_paged_prefill_kernel _quantize_rows_kernel _race_kernel _reshape_and_cache_kernel "
           "_rms_norm_kernel _rotary_and_cache_kernel _rotary_neox_kernel _row_stats_kernel "
           "_row_threshold_kernel _shrink_kernel _silu_and_mul_kernel _skinny_kernel").split()


def test_triton_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "triton_compile_check.py")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if run.returncode == 2:
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("ok ") == 72 + 17, run.stdout  # attention: 6 dtypes x 2 x 2 x 3
    launched = {name for line in run.stdout.splitlines() for name in line.split(": ")[-1].split(", ")}
    assert launched == set(KERNELS), run.stdout


def test_every_triton_kernel_is_checked():
    """A new kernel joins KERNELS and a scenario of tests/triton_compile_check.py."""
    import re

    found = set()
    for path in (ROOT / "pagedllm" / "kernels").glob("triton_*.py"):
        found |= set(re.findall(r"@triton\.jit\ndef (_\w+_kernel)\(", path.read_text()))
    assert found == set(KERNELS)
