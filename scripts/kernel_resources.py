"""Registers, spills and key-loop instructions of the decode attention kernel, compiled for
an H100 / H200 on any machine (no GPU: Triton's compiler and the ptxas and cuobjdump of its
wheel run on the CPU).

For each launch choice (keys per step, warps, stages) and cache dtype, the kernel is compiled as
`triton_paged_attention` launches it at Llama-3-8B's shape (32 query / 8 KV heads,
head_dim 128, 4 splits; pagedllm/benchmarks/triton_launches.py) and cuobjdump reports its
registers per thread and its stack (the bytes each thread spills to local memory). A choice
that spills is a candidate to time against the others on a GPU (`GPU_CHECK_STEPS=decode-tune`,
or `sharegpt` with PAGEDLLM_DECODE_BLOCK_N / PAGEDLLM_DECODE_NUM_WARPS set).

--loop also counts the SASS instructions of one pass of the key loop (the longest backward
branch), with the most frequent opcodes: what a change to the loop body costs in issued
instructions. Fewer is not always faster (docs/benchmarks.md: an FP8 variant with 17% fewer
ran 7-20% slower), so a candidate is still timed on a GPU.

    python scripts/kernel_resources.py [--block-n 64 128] [--warps 4 8] [--stages 2 3]
        [--prefetch] [--loop]
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not the interpreter's

import torch  # noqa: E402
import triton  # noqa: E402

from pagedllm.benchmarks.triton_launches import compile_decode_kernel, kv_buffers  # noqa: E402
from pagedllm.kernels import triton_attention  # noqa: E402

CACHES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                         "cuobjdump")


def cuobjdump(cubin: bytes, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([CUOBJDUMP, flag, f.name], capture_output=True, text=True,
                              check=True).stdout


def loop_opcodes(sass: str) -> collections.Counter:
    """Opcodes (without modifiers or predicates) of the instructions from the target of the
    longest backward branch to that branch: one pass of the kernel's main loop."""
    lines = [(int(a, 16), ins) for a, ins in
             re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    spans = [(int(m.group(1), 16), at) for at, ins in lines
             if (m := re.search(r"\bBRA\b.*?0x([0-9a-f]+)", ins)) and int(m.group(1), 16) < at]
    if not spans:
        return collections.Counter()
    lo, hi = max(spans, key=lambda span: span[1] - span[0])
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0].split(".")[0]
                               for at, ins in lines if lo <= at <= hi)


def resources(cache: str, block_n: int, warps: int, loop: bool = False,
              stages: int | None = None, prefetch: bool = False) -> str:
    """The decode kernel's registers, stack, shared memory and K/V buffers, launched with
    these constants; with `loop`, its key loop's instructions a pass and the six most
    frequent opcodes."""
    asm = compile_decode_kernel(CACHES[cache], block_n, warps, stages, prefetch)
    cubin = asm["cubin"]
    line = " ".join(re.findall(r"(?:REG|STACK):\d+", cuobjdump(cubin, "-res-usage")))
    buffers = "/".join(map(str, kv_buffers(asm["ttgir"])))
    line += f" SHARED:{asm['shared']} K/V buffers:{buffers}"
    if loop:
        opcodes = loop_opcodes(cuobjdump(cubin, "-sass"))
        top = " ".join(f"{op} {n}" for op, n in opcodes.most_common(6))
        line += f"  loop: {sum(opcodes.values())} instructions a pass ({top})"
    return line


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block-n", type=int, nargs="+", default=[64, 128])
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--loop", action="store_true",
                   help="also count the key loop's SASS instructions a pass")
    p.add_argument("--stages", type=int, nargs="+", default=[None],
                   help="pipeline stages (default: the engine's for each cache)")
    p.add_argument("--prefetch", action="store_true",
                   help="PAGEDLLM_DECODE_PREFETCH=1: the next tile's block ids a step ahead")
    args = p.parse_args()
    print(f"triton {triton.__version__}, decode kernel for sm_90 (registers per thread, "
          f"stack bytes per thread); the engine launches BLOCK_N "
          f"{triton_attention.DECODE_BLOCK_N}, {triton_attention.DECODE_NUM_WARPS} warps")
    for cache in CACHES:
        for block_n in args.block_n:
            for warps in args.warps:
                for stages in args.stages:
                    shown = f", {stages} stages" if stages else ""
                    print(f"  {cache} cache, BLOCK_N {block_n:>3}, {warps} warps{shown}: "
                          f"{resources(cache, block_n, warps, args.loop, stages, args.prefetch)}",
                          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
