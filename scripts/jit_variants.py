"""Which Triton kernel variants an engine run launches, and which of a kernel's arguments
change the variant from one step to another, on any machine (no GPU needed).

Triton's JIT compiles one variant of a kernel per set of constexprs and per class of each
integer argument it specializes (1, a multiple of 16, other) and of each tensor's alignment.
A variant first launched mid-run is compiled there (or loaded from Triton's cache) while the
device idles: `bench --profile` counts those on a GPU. Here an engine runs the ShareGPT-like
mix (`bench sharegpt`'s lengths, scaled by --num-requests) on CPU tensors with the Triton
backend, and each launch records its variant (pagedllm/benchmarks/triton_launches.py)
instead of running, so the tokens are garbage but the launches are the engine's. The model
has one layer with Llama-3-8B's attention (32 query / 8 KV heads of 128) and a small hidden
size and vocabulary. There are no CUDA graphs on the CPU: every decode step is eager here,
where on a GPU the captured sizes compile at start-up.

    python scripts/jit_variants.py [--num-requests 300] [--max-num-seqs 256]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # the JIT's launches, intercepted, not the interpreter's

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.benchmarks.triton_launches import intercepted_launches, variant_key  # noqa: E402
from pagedllm.benchmarks.workloads import (  # noqa: E402
    SHAREGPT_SIGMA_INPUT, SHAREGPT_SIGMA_OUTPUT, lognormal_lengths, warm_up,
)
from pagedllm.layers import dispatch  # noqa: E402

MODEL = {"architectures": ["LlamaForCausalLM"], "vocab_size": 1024, "hidden_size": 256,
         "intermediate_size": 512, "num_hidden_layers": 1, "num_attention_heads": 32,
         "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 4096,
         "eos_token_id": 2}


def report(first_seen: dict[str, dict[tuple, str]]) -> list[str]:
    """Per kernel: its variants, those first launched in the run, and the parameters whose
    part of the key differs between variants (with the values met)."""
    lines = []
    for name, variants in sorted(first_seen.items()):
        in_run = sum(phase == "run" for phase in variants.values())
        lines.append(f"{name}: {len(variants)} variants, {in_run} first launched in the run")
        parts: dict[str, set] = collections.defaultdict(set)
        for key in variants:
            for param, part in key:
                parts[param].add(repr(part))
        for param, values in parts.items():
            if len(values) > 1:
                lines.append(f"  {param}: {', '.join(sorted(values))}")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=300)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    n = args.num_requests
    prompts = [[rng.randrange(3, 1000) for _ in range(length)]
               for length in lognormal_lengths(rng, n, 290, SHAREGPT_SIGMA_INPUT, (4, 2048))]
    params = [SamplingParams(temperature=0.8, top_p=0.95, ignore_eos=True, max_tokens=length)
              for length in lognormal_lengths(rng, n, 220, SHAREGPT_SIGMA_OUTPUT, (2, 1024))]
    first_seen: dict[str, dict[tuple, str]] = collections.defaultdict(dict)
    phase = "start"

    def on_launch(fn, launch_args, kwargs) -> None:
        first_seen[fn.fn.__name__].setdefault(variant_key(fn, launch_args, kwargs), phase)

    with tempfile.TemporaryDirectory() as folder, dispatch.force("triton"), \
            intercepted_launches(on_launch):
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(MODEL, f)
        llm = LLM(model=folder, load_format="dummy", dtype="bfloat16", device="cpu",
                  max_num_seqs=args.max_num_seqs, kv_cache_memory=2 << 30,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  enable_prefix_caching=False)
        warm_up(llm, vocab=MODEL["vocab_size"])  # as `bench sharegpt` before its timed run
        phase = "run"
        llm.generate(prompts, params, use_tqdm=False)
    print("\n".join(report(first_seen)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
