"""Registers and spills of the decode attention kernel, compiled for an H100 / H200 on any
machine (no GPU: Triton's compiler and the ptxas of its wheel run on the CPU).

For each launch choice (keys per step, warps) and cache dtype, the kernel is compiled as
`triton_paged_attention` launches it at Llama-3-8B's shape (32 query / 8 KV heads,
head_dim 128, 4 splits; pagedllm/benchmarks/triton_launches.py) and cuobjdump reports its
registers per thread and its stack (the bytes each thread spills to local memory). A choice that spills is a candidate to time
against the others on a GPU (`GPU_CHECK_STEPS=decode-tune`, or `sharegpt` with
PAGEDLLM_DECODE_BLOCK_N / PAGEDLLM_DECODE_NUM_WARPS set).

    python scripts/kernel_resources.py [--block-n 64 128] [--warps 4 8]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not the interpreter's

import torch  # noqa: E402
import triton  # noqa: E402

from pagedllm.benchmarks.triton_launches import compile_decode_kernel  # noqa: E402
from pagedllm.kernels import triton_attention  # noqa: E402

CACHES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                         "cuobjdump")


def resources(cache: str, block_n: int, warps: int) -> str:
    """The decode kernel's registers and stack, launched with these constants."""
    cubin = compile_decode_kernel(CACHES[cache], block_n, warps)["cubin"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
    return " ".join(re.findall(r"(?:REG|STACK):\d+", usage))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block-n", type=int, nargs="+", default=[64, 128])
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    args = p.parse_args()
    print(f"triton {triton.__version__}, decode kernel for sm_90 (registers per thread, "
          f"stack bytes per thread); the engine launches BLOCK_N "
          f"{triton_attention.DECODE_BLOCK_N}, {triton_attention.DECODE_NUM_WARPS} warps")
    for cache in CACHES:
        for block_n in args.block_n:
            for warps in args.warps:
                print(f"  {cache} cache, BLOCK_N {block_n:>3}, {warps} warps: "
                      f"{resources(cache, block_n, warps)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
