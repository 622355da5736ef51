"""Greedy parity of the CUDA path against the CPU path, and of CUDA graphs against eager.

    python3 scripts/gpu_parity.py [--out parity.json]

A SmolLM2-135M-shaped Llama (30 layers, hidden 576, 9/3 heads of 64, intermediate 1536,
vocab 49152, rope theta 1e5, tied embeddings) with seeded random weights is saved with
transformers' save_pretrained and loaded like any checkpoint. Then:

- 16 prompts x 32 greedy tokens: CUDA fp32 (eager and graphs) must give the CPU fp32 tokens;
- 16 prompts with 2..32 tokens each (the batch shrinks, so replays pad to buckets): the same;
- async scheduling (the default on CUDA) against --no-async-scheduling, fp32 graphs: the same
  tokens;
- speculative decoding (n-gram, k = 4; the verification runs as decode rows through the
  graphs) against plain decoding, fp32: the same tokens, with some rows verified;
- bf16 on CUDA, graphs vs eager: agreement reported (a bucket's GEMMs may round differently
  from the unpadded batch's, so bf16 is not required to match token for token);
- decode latency at batch 1, eager vs graphs.

Exits 1 when a required match fails. `--small` shrinks the model for a CPU-only smoke run.
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedllm import LLM, SamplingParams  # noqa: E402

SMOLLM2_SHAPE = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
    tie_word_embeddings=True, max_position_embeddings=2048, rms_norm_eps=1e-5,
    bos_token_id=1, eos_token_id=2,
)
SMALL_SHAPE = dict(SMOLLM2_SHAPE, vocab_size=512, hidden_size=64, intermediate_size=128,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def save_random_model(folder: str, shape: dict, seed: int = 0) -> None:
    import transformers

    config = transformers.LlamaConfig(**shape)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    saved = json.loads((Path(folder) / "config.json").read_text())
    theta = saved.get("rope_theta") or (saved.get("rope_parameters") or {}).get("rope_theta")
    if theta != shape["rope_theta"]:
        raise SystemExit(f"saved config lost rope_theta: {saved}")


def generate(folder: str, prompts, max_tokens: list[int], **engine) -> dict:
    llm = LLM(model=folder, seed=0, **engine)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    graphs = llm.engine.worker.runner.graphs
    result = {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "cumulative_logprob": [o.outputs[0].cumulative_logprob for o in outs],
        "graph_replays": graphs.num_replays if graphs is not None else 0,
        "kv_tokens": llm.engine.worker.num_gpu_blocks * llm.engine.block_size,
        "spec_verified_rows": llm.engine.get_stats().spec_num_verified_rows,
    }
    del llm, outs
    free()
    return result


def decode_latency(folder: str, **engine) -> float:
    """Milliseconds per token for one sequence (128 tokens), after a warm-up."""
    llm = LLM(model=folder, seed=0, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate([[9, 10, 11, 12]], params, use_tqdm=False)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    del llm
    free()
    return 1000 * elapsed / 128


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def compare(name: str, a: dict, b: dict) -> dict:
    pairs = list(zip(a["tokens"], b["tokens"]))
    same_seqs = sum(x == y for x, y in pairs)
    same_tokens = sum(p == q for x, y in pairs for p, q in zip(x, y))
    total = sum(len(x) for x, _ in pairs)
    diffs = [abs(p - q) for (x, y), p, q in zip(pairs, a["cumulative_logprob"],
                                                 b["cumulative_logprob"]) if x == y]
    return {"check": name, "identical_seqs": f"{same_seqs}/{len(pairs)}",
            "identical_tokens": f"{same_tokens}/{total}", "ok": same_seqs == len(pairs),
            "max_abs_dlogprob": max(diffs, default=float("nan"))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--small", action="store_true", help="a tiny model (CPU smoke run)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    shape = SMALL_SHAPE if args.small else SMOLLM2_SHAPE
    rng = random.Random(0)
    prompts = [[rng.randrange(3, shape["vocab_size"]) for _ in range(rng.randint(4, 64))]
               for _ in range(16)]
    fixed = [32] * 16
    varied = [2 + 2 * i for i in range(16)]  # 2..32: the decode batch shrinks step by step
    cpu = dict(device="cpu", dtype="float32", kv_cache_memory=256 << 20)
    gpu = dict(device="cuda", gpu_memory_utilization=0.3, max_num_seqs=64)

    rows, results = [], {}
    with tempfile.TemporaryDirectory() as folder:
        t0 = time.perf_counter()
        save_random_model(folder, shape)
        print(f"saved a random {shape['num_hidden_layers']}-layer model in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        for label, lens in (("16x32", fixed), ("16x2..32", varied)):
            r = {"cpu fp32": generate(folder, prompts, lens, **cpu)}
            if cuda:
                r["cuda fp32 eager"] = generate(folder, prompts, lens, dtype="float32",
                                                enforce_eager=True, **gpu)
                r["cuda fp32 graphs"] = generate(folder, prompts, lens, dtype="float32", **gpu)
                r["cuda fp32 graphs sync"] = generate(folder, prompts, lens, dtype="float32",
                                                      async_scheduling=False, **gpu)
                rows.append(compare(f"{label} cuda eager == cpu (fp32)",
                                    r["cuda fp32 eager"], r["cpu fp32"]))
                rows.append(compare(f"{label} cuda graphs == cpu (fp32)",
                                    r["cuda fp32 graphs"], r["cpu fp32"]))
                rows.append(compare(f"{label} cuda graphs == eager (fp32)",
                                    r["cuda fp32 graphs"], r["cuda fp32 eager"]))
                rows.append(compare(f"{label} cuda async == sync scheduling (fp32)",
                                    r["cuda fp32 graphs"], r["cuda fp32 graphs sync"]))
                r["cuda fp32 graphs ngram"] = generate(
                    folder, prompts, lens, dtype="float32", **gpu,
                    speculative_config={"method": "ngram", "num_speculative_tokens": 4})
                row = compare(f"{label} cuda speculative == plain (fp32)",
                              r["cuda fp32 graphs ngram"], r["cuda fp32 graphs"])
                verified = r["cuda fp32 graphs ngram"]["spec_verified_rows"]
                row["ok"] = row["ok"] and verified > 0
                row["check"] += f" [{verified} verified rows]"
                rows.append(row)
                replays = r["cuda fp32 graphs"]["graph_replays"]
                rows.append({"check": f"{label} graphs replayed (fp32)", "ok": replays > 0,
                             "identical_seqs": f"{replays} replays",
                             "identical_tokens": "", "max_abs_dlogprob": float("nan")})
            results[label] = r
            print(f"{label}: done", flush=True)
        if cuda:
            eager = generate(folder, prompts, varied, dtype="bfloat16", enforce_eager=True, **gpu)
            graphs = generate(folder, prompts, varied, dtype="bfloat16", **gpu)
            row = compare("16x2..32 cuda graphs vs eager (bf16, info)", graphs, eager)
            row["ok"] = None  # reported, not required
            rows.append(row)
            results["bf16"] = {"eager": eager, "graphs": graphs}
            latency = {
                "eager": decode_latency(folder, dtype="bfloat16", enforce_eager=True, **gpu),
                "graphs": decode_latency(folder, dtype="bfloat16", **gpu),
            }
            results["latency_ms_per_token"] = latency
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "results": results}, indent=1))

    print(f"\n{'check':48s} {'seqs':>12s} {'tokens':>10s} {'max|dlogp|':>11s}  result")
    for row in rows:
        verdict = {True: "PASS", False: "FAIL", None: "info"}[row["ok"]]
        print(f"{row['check']:48s} {row['identical_seqs']:>12s} {row['identical_tokens']:>10s} "
              f"{row['max_abs_dlogprob']:11.2e}  {verdict}")
    if cuda:
        lat = results["latency_ms_per_token"]
        print(f"batch-1 decode, bf16: eager {lat['eager']:.2f} ms/token, graphs "
              f"{lat['graphs']:.2f} ms/token ({lat['eager'] / lat['graphs']:.1f}x)")
    else:
        print("no CUDA here: only the CPU path ran")
    return 0 if all(row["ok"] is not False for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
