"""Skinny matmuls (kernels/triton_gemv.py) against cuBLAS at Llama-3-8B's decode shapes.

    python3 scripts/gpu_gemv_tune.py [--rows 1,4,16] [--sweep] [--wtypes fp8] [--shapes o,down]

For each linear (qkv, o, gate_up, down, lm_head), rows M and weight type (bf16, fp8): the
result against an fp32 reference, then the time per call inside a CUDA graph of back-to-back
calls cycling over copies of the weight that together outgrow the L2 cache (as a decode
step reads each weight once): cuBLAS (F.linear, bf16 only), the kernel's default config,
and with --sweep (one row only) every config of a small grid (the best three printed). GB/s = weight bytes / time.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedllm.kernels import triton_gemv  # noqa: E402
from pagedllm.kernels.triton_gemv import SkinnyConfig  # noqa: E402
from pagedllm.layers.fp8_linear import quantize_rows  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "lm_head": (128256, 4096)}
L2_FLUSH_BYTES = 512 << 20
CALLS = 24


def graph_time_us(fn, copies: int) -> float:
    """Mean time of one call in a CUDA graph of CALLS calls, call i on weight copy i % copies."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(copies):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(CALLS):
            fn(i % copies)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / CALLS)
    del g
    return best


def sweep_configs() -> list[SkinnyConfig]:
    grid = itertools.product((16, 32), (256, 512, 1024), (4, 8), (2, 4, 8))
    return [SkinnyConfig(n, k, w, p) for n, k, w, p in grid]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="1,4,16")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--sweep-out", help="append every swept config's time to this file")
    p.add_argument("--wtypes", default="bf16,fp8")
    args = p.parse_args()
    failed = False
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        torch.manual_seed(0)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q, s = quantize_rows(w)
        s = s.view(-1).contiguous()
        for wtype in args.wtypes.split(","):
            weight = w if wtype == "bf16" else q
            nbytes = weight.numel() * weight.element_size()
            copies = max(1, -(-L2_FLUSH_BYTES // nbytes))
            weights = [weight] + [weight.clone() for _ in range(copies - 1)]
            scale = None if wtype == "bf16" else s
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = x.float() @ (w.float() if wtype == "bf16" else q.float() * s[:, None]).T
                got = triton_gemv.skinny_matmul(x, weight, scale).float()
                err = ((got - ref).abs().max() / ref.abs().max()).item()
                ok = err < 1e-2
                failed |= not ok
                line = f"{name:8s} {wtype} m={m:2d} err {err:.1e} {'ok' if ok else 'FAIL'}"
                if wtype == "bf16":
                    t = graph_time_us(lambda i: F.linear(x, weights[i]), copies)
                    line += f"  cublas {t:7.1f} us {nbytes / t / 1e3:6.0f} GB/s"
                t = graph_time_us(lambda i: triton_gemv.skinny_matmul(x, weights[i], scale),
                                  copies)
                line += f"  skinny {t:7.1f} us {nbytes / t / 1e3:6.0f} GB/s"
                if args.sweep and m == 1:
                    timed = []
                    for c in sweep_configs():
                        try:
                            timed.append((graph_time_us(
                                lambda i: triton_gemv.skinny_matmul(x, weights[i], scale,
                                                                    config=c), copies), c))
                        except Exception as e:  # noqa: BLE001 (a config the GPU cannot run)
                            print(f"  skip {c}: {type(e).__name__}")
                    timed.sort(key=lambda tc: tc[0])
                    if args.sweep_out:
                        with open(args.sweep_out, "a") as f:
                            for t, c in timed:
                                f.write(f"{name} {wtype} {c.block_n} {c.block_k} "
                                        f"{c.num_warps} {c.programs_per_sm} {t:.2f}\n")
                    line += "  best " + "; ".join(
                        f"{t:.1f} us {nbytes / t / 1e3:.0f} GB/s n{c.block_n} k{c.block_k} "
                        f"w{c.num_warps} p{c.programs_per_sm}" for t, c in timed[:3])
                print(line, flush=True)
            del weights
            torch.cuda.empty_cache()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
