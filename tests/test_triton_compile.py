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
           "_row_threshold_kernel _shrink_kernel _silu_and_mul_fp8_kernel _silu_and_mul_kernel "
           "_skinny_kernel").split()


def test_triton_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "triton_compile_check.py")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if run.returncode == 2:
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("ok ") == 72 + 26, run.stdout  # attention: 6 dtypes x 2 x 2 x 3
    launched = {name for line in run.stdout.splitlines() for name in line.split(": ")[-1].split(", ")}
    assert launched == set(KERNELS), run.stdout


def test_every_triton_kernel_is_checked():
    """A new kernel joins KERNELS and a scenario of tests/triton_compile_check.py."""
    import re

    found = set()
    for path in (ROOT / "pagedllm" / "kernels").glob("triton_*.py"):
        found |= set(re.findall(r"@triton\.jit(?:\(.*\))?\ndef (_\w+_kernel)\(", path.read_text()))
    assert found == set(KERNELS)


@pytest.mark.parametrize("env, message", [
    ({"PAGEDLLM_DECODE_NUM_WARPS": "3"}, "PAGEDLLM_DECODE_NUM_WARPS must be 2, 4 or 8, got 3"),
    ({"PAGEDLLM_DECODE_BLOCK_N": "96"}, "PAGEDLLM_DECODE_BLOCK_N must be 16, 32, 64 or 128, got 96"),
    ({"PAGEDLLM_DECODE_NUM_WARPS": "8", "PAGEDLLM_DECODE_BLOCK_N": "64"}, "64 8"),
    ({"PAGEDLLM_FP8_ROW_BLOCK": "3000"},
     "PAGEDLLM_FP8_ROW_BLOCK must be a power of two from 1024 to 16384, got 3000"),
    ({"PAGEDLLM_FP8_ROW_BLOCK": "4096"}, "4096"),
    ({}, "128 4 16384 3 2"),
    ({"PAGEDLLM_DECODE_NUM_STAGES": "2"}, "128 4 16384 2 2"),
    ({"PAGEDLLM_DECODE_NUM_STAGES": "5"}, "PAGEDLLM_DECODE_NUM_STAGES must be 1, 2, 3 or 4, got 5"),
])
def test_launch_constants_from_the_environment(env, message):
    """The A/B variables of the decode kernel's launch (scripts/gpu_check.sh's sharegpt-w8,
    sharegpt-fp8-2stages) and of the FP8 SiLU-and-mul's row block (sharegpt-fp8-twopass):
    read at import, a value the kernel cannot take named in the error; the defaults printed
    last (the decode stages over an FP8 cache, then over bf16)."""
    code = ("from pagedllm.kernels import triton_attention as t, triton_ops as o; "
            "print(t.DECODE_BLOCK_N, t.DECODE_NUM_WARPS, o.FP8_ROW_BLOCK, "
            "t.decode_num_stages(1), t.decode_num_stages(2))")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PAGEDLLM_")},
           "PYTHONPATH": str(ROOT), **env}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env=env, timeout=300)
    assert message in (run.stdout if run.returncode == 0 else run.stderr)


DECODE_PTX_CHECK = """
import re, sys, torch
from pagedllm.benchmarks.triton_launches import compile_decode_kernel
for name, dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
    asm = compile_decode_kernel(dtype)
    ptx = asm["ptx"]
    print(name, len(re.findall(r"ld\\.shared\\.[bu]8", ptx)), len(re.findall(r"st\\.local", ptx)),
          len(re.findall(r"ldmatrix[.a-z0-9]*\\.trans", ptx)))
"""


def test_decode_kernel_reads_an_fp8_caches_values_without_byte_loads():
    """The FP8 cache's values are converted to 16 bits before the P @ V dot's transposing
    shared-memory read (triton_attention._values_operand): compiled for sm_90, the decode
    kernel has no 8-bit shared loads (there were 128 a thread per tile) and reads the
    values with the transposing ldmatrix, as over a bf16 cache; neither spills."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, "-c", DECODE_PTX_CHECK], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    counts = {name: tuple(map(int, rest)) for name, *rest in
              (line.split() for line in run.stdout.splitlines())}
    for name in ("bf16", "fp8"):
        byte_loads, spills, transposing = counts[name]
        assert (byte_loads, spills) == (0, 0), (name, counts)
        assert transposing > 0, (name, counts)


BUFFERS_CHECK = """
import torch
from pagedllm.benchmarks.triton_launches import compile_attention_kernel, kv_buffers
for name, dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
    for prefetch in (False, True):
        asm = compile_attention_kernel(dtype, DECODE_NUM_STAGES=3, DECODE_PREFETCH=prefetch)
        print("decode", name, int(prefetch), *kv_buffers(asm["ttgir"]))
for prefetch in (False, True):
    asm = compile_attention_kernel(torch.float8_e4m3fn, decode=False, PREFILL_PREFETCH=prefetch)
    print("prefill fp8", int(prefetch), *kv_buffers(asm["ttgir"]))
"""


def test_attention_prefetch_keeps_key_tiles_in_flight():
    """With the block table read in the loop, the pipeliner gives the decode kernel's K and V
    tiles one shared-memory buffer whatever the stages (the next tile's copy waits for the
    current tile's dots); PAGEDLLM_DECODE_PREFETCH (the next tile's block ids a step ahead)
    gives them stages - 1. Compiled for sm_90: the buffers of K and V, decode at 3 stages,
    and prefill over an FP8 cache (PAGEDLLM_PREFILL_PREFETCH adds a stage)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, "-c", BUFFERS_CHECK], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines() == [
        "decode bf16 0 1 1", "decode bf16 1 2 2", "decode fp8 0 1 1", "decode fp8 1 2 2",
        "prefill fp8 0 1 1", "prefill fp8 1 2 2"], run.stdout
