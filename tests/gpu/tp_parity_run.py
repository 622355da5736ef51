"""Run by tests/gpu/test_tp.py in a process of its own (under torchrun for one rank inside an
NCCL group): the greedy fp32 outputs (tokens, top-2 logprobs) of a random 30-layer Llama,
saved to --model-dir the first time (same seed, same weights every time), CUDA graphs and
multi-step on, written to --out as JSON.

    python tests/gpu/tp_parity_run.py --tp N --model-dir DIR --out tokens.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

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
    rng = random.Random(0)
    prefix = [rng.randrange(3, 32000) for _ in range(40)]
    out = []
    for i in range(NUM_PROMPTS):
        tail = [rng.randrange(3, 32000) for _ in range(rng.randint(8, 120))]
        out.append(prefix + tail if i % 2 else tail)
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    from pagedllm import LLM, SamplingParams

    folder = Path(args.model_dir)
    if int(os.environ.get("RANK", "0")) == 0:
        build_model(folder)
    else:  # torchrun's other ranks wait for rank 0 to write it
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


if __name__ == "__main__":
    sys.exit(main())
