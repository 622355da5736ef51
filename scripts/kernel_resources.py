"""Registers and spills of the decode attention kernel, compiled for an H100 / H200 on any
machine (no GPU: Triton's compiler and the ptxas of its wheel run on the CPU).

For each launch choice (keys per step, warps) and cache dtype, the kernel is compiled as
`triton_paged_attention` launches it at Llama-3-8B's shape (32 query / 8 KV heads,
head_dim 128, 4 splits) and cuobjdump reports its registers per thread and its stack (the
bytes each thread spills to local memory). A choice that spills is a candidate to time
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

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from pagedllm.kernels import triton_attention  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
CACHES = {"bf16": ("bf16", False), "fp8": ("fp8e4nv", True)}  # cache type, dots in fp16


def resources(cache: str, block_n: int, warps: int) -> str:
    cache_type, fp16_dots = CACHES[cache]
    kernel = triton_attention._paged_decode_kernel
    types = {"out_ptr": "*bf16", "q_ptr": "*bf16", "cache_ptr": f"*{cache_type}",
             "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32",
             "count_ptr": "*i32", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
             "alibi_ptr": "*fp32", "qk_scale": "fp32"}
    constexprs = dict(BLOCK_SIZE=16, GROUP=4, GROUP_PAD=16, HEAD_DIM=128, BLOCK_N=block_n,
                      NUM_SPLITS=4, USE_WINDOW=False, USE_ALIBI=False, DOT_PRECISION="tf32",
                      FP16_DOTS=fp16_dots, PDL=True)
    signature = {name: types.get(name, "i32") for name in kernel.arg_names}
    signature.update({name: "constexpr" for name in constexprs})
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs),
                              target=TARGET, options={"num_warps": warps,
                                                      "num_stages": triton_attention.DECODE_NUM_STAGES})
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                             "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True,
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
