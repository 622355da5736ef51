"""`pagedllm bench fp8`: FP8 weights (--quantization fp8) at Llama-3-8B's linear shapes.

For each linear (qkv, o, gate_up, down) and batch rows M in (1, 4, 16, 64, 256, 512, 2,048,
8,192; decode batches to prefill chunks): the error
of FP8Linear against its fp32 emulation (the same quantized operands) and against bf16
F.linear, and the times (triton.testing.do_bench) of bf16 F.linear, the skinny Triton kernel
on the FP8 weight (M <= 16), _scaled_mm with per-row activation quantization (the Triton
quantize_rows kernel + torch._scaled_mm, with fast accumulation and without), and what
FP8Linear picks; weight GB/s and TFLOP/s. These are
single eager calls: a Triton launch from Python costs tens of microseconds, so small
kernels read slow here; decode runs them inside CUDA graphs (scripts/gpu_gemv_tune.py times
them that way). tests/gpu/test_fp8.py asserts the errors; the end-to-end figures are
`pagedllm bench decode-8b --quantization fp8` and `throughput-8b --quantization fp8`.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedllm.entrypoints.usage import Parser

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (1, 4, 16, 64, 256, 512, 2048, 8192)
MAX_ERR_VS_EMULATION, MAX_REL_ERR_VS_BF16 = 2e-2, 0.08


def make_linear(n: int, k: int):
    """A seeded bf16 linear on CUDA and its FP8Linear."""
    from pagedllm.layers.fp8_linear import FP8Linear

    torch.manual_seed(0)
    linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    return linear, FP8Linear.from_linear(linear)


def errors(linear, fp8, x: torch.Tensor) -> tuple[float, float]:
    """(max error against the fp32 emulation relative to its largest value, relative norm
    error against bf16 F.linear) of fp8(x)."""
    from pagedllm.layers import fp8_linear

    wq, ws = fp8.qweight, fp8.weight_scale
    got = fp8(x).float()
    if x.shape[0] <= fp8_linear.SMALL_BATCH_ROWS:  # weight-only: bf16 x, dequantized weight
        emulated = x.float() @ (wq.float() * ws.view(-1, 1)).T
    else:
        emulated = fp8_linear.fp8_matmul_reference(x, wq, ws).float()
    bf16 = F.linear(x, linear.weight).float()
    err = ((got - emulated).abs().max() / emulated.abs().max()).item()
    return err, ((got - bf16).norm() / bf16.norm()).item()


def check_and_time() -> list[dict]:
    import triton.testing

    from pagedllm.kernels import triton_fp8, triton_gemv

    rows = []
    for name, (n, k) in SHAPES.items():
        linear, fp8 = make_linear(n, k)
        wq, ws = fp8.qweight, fp8.weight_scale
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            err, rel_bf16 = errors(linear, fp8, x)
            t_bf16 = triton.testing.do_bench(lambda: F.linear(x, linear.weight))
            t_fp8 = triton.testing.do_bench(lambda: fp8(x))
            t_fast, t_slow = (triton.testing.do_bench(
                lambda: fp8._scaled_mm(*triton_fp8.quantize_rows(x), x.dtype, fast_accum=fast))
                for fast in (True, False))
            t_skinny = (triton.testing.do_bench(
                lambda: triton_gemv.skinny_matmul(x, wq, ws.view(-1)))
                if m <= triton_gemv.MAX_ROWS else None)
            row = {"linear": name, "n": n, "k": k, "m": m, "max_err_vs_emulation": err,
                   "rel_err_vs_bf16": rel_bf16, "bf16_us": t_bf16 * 1e3, "fp8_us": t_fp8 * 1e3,
                   "scaled_mm_fast_accum_us": t_fast * 1e3, "scaled_mm_us": t_slow * 1e3,
                   "skinny_us": None if t_skinny is None else t_skinny * 1e3,
                   "fp8_weight_gb_s": n * k / (t_fp8 * 1e-3) / 1e9,
                   "bf16_weight_gb_s": 2 * n * k / (t_bf16 * 1e-3) / 1e9,
                   "fp8_tflop_s": 2 * m * n * k / (t_fp8 * 1e-3) / 1e12,
                   "bf16_tflop_s": 2 * m * n * k / (t_bf16 * 1e-3) / 1e12,
                   "ok": err < MAX_ERR_VS_EMULATION and rel_bf16 < MAX_REL_ERR_VS_BF16}
            rows.append(row)
            w8 = "-" if t_skinny is None else f"{t_skinny * 1e3:8.1f}"
            print(f"{name:8s} m={m:5d}  bf16 {t_bf16 * 1e3:8.1f} us  fp8 {t_fp8 * 1e3:8.1f} us  "
                  f"(skinny {w8}, scaled_mm fast {t_fast * 1e3:8.1f} / promoted "
                  f"{t_slow * 1e3:8.1f})  speedup {t_bf16 / t_fp8:5.2f}x  "
                  f"{row['bf16_tflop_s']:6.1f} / {row['fp8_tflop_s']:6.1f} TFLOP/s  "
                  f"err {err:.1e}  vs bf16 {rel_bf16:.3f}  {'ok' if row['ok'] else 'FAIL'}",
                  flush=True)
        del linear, fp8
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str]) -> int:
    parser = Parser(prog="pagedllm bench fp8", description=__doc__.split(": ", 1)[1].split("\n\n")[0])
    parser.add_argument("--out", default=None, help="JSON file for the rows")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("FP8 weights need CUDA, which is not available here")
    from pagedllm.layers import fp8_linear

    print(f"device: {torch.cuda.get_device_name()}; FP8 small-batch rows: "
          f"{fp8_linear.SMALL_BATCH_ROWS}", flush=True)
    rows = check_and_time()
    ok = all(r["ok"] for r in rows)
    print(f"fp8 kernel checks: {'all passed' if ok else 'FAILED'}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"kernels": rows}, indent=2) + "\n")
    return 0 if ok else 1
