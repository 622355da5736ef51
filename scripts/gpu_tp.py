"""Tensor parallelism on CUDA (scripts/gpu_check.sh runs it; issue 18's GPU acceptance).

    python scripts/gpu_tp.py generate --tp N --model-dir DIR --out tokens.json
        greedy fp32 outputs (tokens, top-2 logprobs) of a random 30-layer Llama, saved to
        DIR the first time (same seed, same weights every time), CUDA graphs and multi-step
        on; under `torchrun --nproc-per-node 1` it runs one rank inside an NCCL group (the
        all-reduces run for real, inside the decode graphs).
    python scripts/gpu_tp.py compare A.json B.json
        the tokens are equal except after a near-tie of A's (as tests/test_tensor_parallel.py)
    python scripts/gpu_tp.py allreduce-share --tp N
        Llama-3-8B preset (dummy bf16), batch-1 decode, eager: the share of GPU kernel time
        spent in NCCL kernels on rank 0 (where a TP decode step's time goes)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

TIE_GAP = 1e-3
NUM_PROMPTS, MAX_TOKENS = 16, 32


def build_model(folder: Path) -> None:
    import torch
    import transformers

    if (folder / "config.json").exists():
        return
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=30,
        num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048,
        tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder, safe_serialization=True)


def prompts() -> list[list[int]]:
    import random

    rng = random.Random(0)
    prefix = [rng.randrange(3, 32000) for _ in range(40)]
    out = []
    for i in range(NUM_PROMPTS):
        tail = [rng.randrange(3, 32000) for _ in range(rng.randint(8, 120))]
        out.append(prefix + tail if i % 2 else tail)
    return out


def generate(args: argparse.Namespace) -> int:
    from pagedllm import LLM, SamplingParams

    folder = Path(args.model_dir)
    if int(os.environ.get("RANK", "0")) == 0:
        build_model(folder)
    else:  # torchrun's other ranks wait for rank 0 to write it
        import time
        while not (folder / "model.safetensors").exists():
            time.sleep(1)
        time.sleep(2)
    llm = LLM(str(folder), dtype="float32", tensor_parallel_size=args.tp,
              max_model_len=512, gpu_memory_utilization=0.5)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2, ignore_eos=True)
    outs = llm.generate(prompts(), params, use_tqdm=False)
    data = [{"tokens": o.outputs[0].token_ids,
             "top2": [sorted((lp.logprob for lp in step.values()), reverse=True)[:2]
                      for step in o.outputs[0].logprobs]} for o in outs]
    Path(args.out).write_text(json.dumps(data))
    print(f"generate: tp={args.tp} world={os.environ.get('WORLD_SIZE', '-')} "
          f"{sum(len(d['tokens']) for d in data)} tokens -> {args.out}")
    llm.engine.shutdown()
    return 0


def compare(args: argparse.Namespace) -> int:
    a, b = (json.loads(Path(p).read_text()) for p in (args.a, args.b))
    equal, ties, bad = 0, 0, []
    for i, (x, y) in enumerate(zip(a, b)):
        for j, (s, t) in enumerate(zip(x["tokens"], y["tokens"])):
            if s != t:
                gap = x["top2"][j][0] - x["top2"][j][1]
                if gap < TIE_GAP:
                    ties += 1
                else:
                    bad.append((i, j, round(gap, 4)))
                break
        else:
            equal += x["tokens"] == y["tokens"]
    ok = not bad and len(a) == len(b) and ties <= 2
    print(f"check tp-parity {Path(args.a).stem} vs {Path(args.b).stem}: "
          f"{'PASS' if ok else 'FAIL'}: {equal}/{len(a)} sequences identical, {ties} parted at "
          f"a near-tie (< {TIE_GAP}), {len(bad)} parted with a margin {bad[:3]}")
    return 0 if ok else 1


def allreduce_share(args: argparse.Namespace) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from pagedllm import LLM, SamplingParams

    llm = LLM("llama-3-8b", load_format="dummy", dtype="bfloat16", tensor_parallel_size=args.tp,
              enforce_eager=True, max_model_len=2048, num_scheduler_steps=1)
    prompt = [list(range(100, 612))]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    llm.generate(prompt, params, use_tqdm=False)  # warm-up
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompt, params, use_tqdm=False)
        torch.cuda.synchronize()
    total = nccl = 0.0
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if e.device_type.name != "CUDA":
            continue
        total += t
        nccl += t if "nccl" in e.key.lower() else 0
    print(f"allreduce-share: tp={args.tp}: NCCL kernels {nccl / 1e3:.1f} ms of "
          f"{total / 1e3:.1f} ms GPU kernel time on rank 0 ({nccl / max(total, 1):.1%}), "
          f"batch-1 decode of 64 tokens after a 512-token prompt, eager")
    llm.engine.shutdown()
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate")
    g.add_argument("--tp", type=int, default=1)
    g.add_argument("--model-dir", required=True)
    g.add_argument("--out", required=True)
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    s = sub.add_parser("allreduce-share")
    s.add_argument("--tp", type=int, default=2)
    args = p.parse_args()
    return {"generate": generate, "compare": compare, "allreduce-share": allreduce_share}[
        args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
