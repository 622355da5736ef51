"""Device mapping on CUDA: greedy parity of mapped runs against one GPU (fp32).

    python3 scripts/gpu_device_map.py [--out device_map.json]

A SmolLM2-135M-shaped random-weight model (see gpu_parity.py), 16 prompts x 32 greedy
tokens: the single-GPU run against `cuda:0:15,cpu:15` (CPU offload) and, with two GPUs,
`cuda:0:15,cuda:1:15`. Each must give identical tokens; the throughput of each run is
reported. The throughput comparisons at 8B scale use `pagedllm bench ... --device-map`.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_parity import SMOLLM2_SHAPE, compare, free, save_random_model  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402


def run(folder: str, prompts: list[list[int]], **engine) -> dict:
    llm = LLM(model=folder, seed=0, dtype="float32", **engine)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    result = {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "cumulative_logprob": [o.outputs[0].cumulative_logprob for o in outs],
        "output_tok_s": 32 * len(prompts) / elapsed,
        "kv_tokens": llm.engine.worker.num_gpu_blocks * llm.engine.block_size,
    }
    del llm, outs
    free()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(10000) for _ in range(rng.randint(8, 200))] for _ in range(16)]
    maps = {"cuda:0 (no map)": None, "cuda:0:15,cpu:15": "cuda:0:15,cpu:15"}
    if torch.cuda.device_count() >= 2:
        maps["cuda:0:15,cuda:1:15"] = "cuda:0:15,cuda:1:15"
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        save_random_model(folder, SMOLLM2_SHAPE)
        results = {name: run(folder, prompts, device_map=spec) for name, spec in maps.items()}
    base = results["cuda:0 (no map)"]
    ok = True
    for name, res in results.items():
        row = compare(f"{name} == cuda:0", res, base) if res is not base else {"check": name}
        row.update(output_tok_s=round(res["output_tok_s"], 1), kv_tokens=res["kv_tokens"])
        ok &= row.get("ok", True)
        rows.append(row)
        print(json.dumps(row))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
