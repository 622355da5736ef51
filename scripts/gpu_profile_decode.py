"""Where a decode step's GPU time goes, kernel by kernel (decode-8b's shape by default).

    python3 scripts/gpu_profile_decode.py [--quantization fp8] [--eager] [--tokens 64]
    python3 scripts/gpu_profile_decode.py --model qwen3-0.6b --batch 256 --temperature 0.6

Dummy bf16 weights, --batch prompts of 512 tokens, greedy unless --temperature. After a
warm-up the generation of --tokens tokens per prompt runs under torch.profiler (CUDA
activity: kernels inside CUDA graph replays are listed one by one). Prints the kernels by
total time with their count per decode step, the sum of kernel time per step against the
wall time per step (the difference is the GPU idling between kernels or waiting for the
host). Prefill is included (once per prompt).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedllm import LLM, SamplingParams  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quantization", default=None)
    p.add_argument("--eager", action="store_true")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.0)
    args = p.parse_args()
    from torch.profiler import ProfilerActivity, profile

    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", max_model_len=2048,
              enforce_eager=args.eager, quantization=args.quantization)
    prompt = [list(range(100 + i, 612 + i)) for i in range(args.batch)]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.tokens,
                            ignore_eos=True)
    llm.generate(prompt, params, use_tqdm=False)  # warm-up (graphs captured)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(prompt, params, use_tqdm=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompt, params, use_tqdm=False)
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        if e.device_type.name != "CUDA":
            continue
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        rows.append((t, e.count, e.key))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    n = args.tokens
    label = (f"{args.model} batch {args.batch} T={args.temperature} "
             f"{args.quantization or 'bf16'}{' eager' if args.eager else ''}")
    print(f"profile-decode {label}: wall {wall / n * 1e3:.3f} ms/step unprofiled "
          f"({n * args.batch / wall:.1f} tok/s incl. prefill); kernels {total / n / 1e3:.3f} "
          f"ms/step (prefill included)")
    for t, count, key in rows[:args.top]:
        print(f"  {t / n:9.1f} us/step {count / n:7.2f}/step {t / max(total, 1):6.1%}  "
              f"{key[:110]}")
    llm.engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
