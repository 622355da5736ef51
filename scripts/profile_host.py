"""Where the host's time goes in a generate() of `pagedllm bench structured`'s shape.

Runs one unconstrained batch and one with half of it under a JSON schema (or the free-text
regex), after a warm-up each, and times the engine's host phases with wrappers (exclusive
wall time: a wrapped call inside another counts for itself only). On CUDA the model calls
only queue kernels, so their rows are launch cost and the `wait` rows are the host idling
on the device; on the CPU the model rows are the compute itself.

  python scripts/profile_host.py --model qwen3-0.6b --load-format dummy --dtype bfloat16 \
      --device cuda --tokenizer .whl/smollm2-tokenizer --batch 256 --max-tokens 256
  python scripts/profile_host.py --batch 8 --max-tokens 32   # the default model, CPU

A model folder with a one-layer, 16-wide config.json and the default tokenizer, loaded with
--load-format dummy --tokenizer FOLDER --num-scheduler-steps 8 --async-scheduling, makes
the CPU's model rows small: a proxy for the host's costs at GPU batch sizes.
"""
from __future__ import annotations

import argparse
import collections
import functools
import random
import time

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.workloads import STRUCTURED_JSON, STRUCTURED_TEXT
from pagedllm.sampling_params import StructuredOutputsParams

TOTALS: dict[str, float] = collections.defaultdict(float)
CALLS: collections.Counter = collections.Counter()
_stack: list[float] = []


def wrap(owner, name: str, label: str) -> None:
    inner_fn = getattr(owner, name)

    @functools.wraps(inner_fn)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        _stack.append(0.0)
        try:
            return inner_fn(*args, **kwargs)
        finally:
            elapsed = time.perf_counter() - start
            nested = _stack.pop()
            TOTALS[label] += elapsed - nested
            CALLS[label] += 1
            if _stack:
                _stack[-1] += elapsed

    setattr(owner, name, timed)


def install(llm: LLM) -> None:
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.worker import model_runner as mr
    from pagedllm.worker.inputs import StepResult

    engine = llm.engine
    for name in ("_update", "add_request", "_make_output", "_launch"):
        wrap(LLMEngine, name, f"engine.{name}")
    for name in ("schedule", "schedule_continuation", "free_finished_seq_groups"):
        wrap(type(engine.scheduler), name, f"scheduler.{name}")
    wrap(type(engine.batch_builder), "build", "batch_builder.build")
    wrap(StepResult, "samples", "StepResult.samples")
    wrap(type(engine.structured), "advance", "structured.advance")
    wrap(type(engine.structured), "fill_bitmask", "structured.fill_bitmask")
    for name in ("gather", "apply", "prepare_input"):
        wrap(mr.ModelRunner, name, f"runner.{name}")
    wrap(mr.ModelRunner, "forward", "model: forward")
    wrap(engine.worker.model, "compute_logits", "model: compute_logits")
    wrap(mr.DecodeWindow, "sample_with_bitmask", "model: sample_with_bitmask")
    wrap(mr._HostCopy, "get", "wait: samples to the host")


def report(name: str, tokens: int, wall: float) -> None:
    waits = sum(v for k, v in TOTALS.items() if k.startswith("wait"))
    print(f"{name}: {tokens} tokens in {wall:.2f} s = {tokens / wall:.0f} tok/s; host waited on "
          f"the device {waits:.2f} s, busy {wall - waits:.2f} s "
          f"({1e6 * (wall - waits) / tokens:.1f} us/token)")
    for label, seconds in sorted(TOTALS.items(), key=lambda kv: -kv[1]):
        print(f"  {label:32s} {seconds * 1e3:9.1f} ms {CALLS[label]:7d} calls "
              f"{1e6 * seconds / tokens:7.2f} us/token")
    rest = wall - sum(TOTALS.values())
    print(f"  {'(not wrapped)':32s} {rest * 1e3:9.1f} ms {'':13s} {1e6 * rest / tokens:7.2f} us/token")
    TOTALS.clear()
    CALLS.clear()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default=None)
    p.add_argument("--tokenizer")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--min-input-len", type=int, default=100)
    p.add_argument("--max-input-len", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--constraint", choices=["json", "text"], default="json")
    p.add_argument("--num-scheduler-steps", type=int, default=None,
                   help="default: the engine's (8 on CUDA, 1 on the CPU)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes (CPU)")
    args = p.parse_args()
    kwargs = dict(load_format=args.load_format, dtype=args.dtype, enable_prefix_caching=False,
                  max_num_seqs=args.batch)
    for key in ("model", "device", "tokenizer", "kv_cache_memory", "num_scheduler_steps",
                "async_scheduling"):
        if getattr(args, key) is not None:
            kwargs[key] = getattr(args, key)
    llm = LLM(**kwargs)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 30000) for _ in range(rng.randint(args.min_input_len,
                                                                      args.max_input_len))]
               for _ in range(args.batch)]
    constraint = (StructuredOutputsParams(json=STRUCTURED_JSON) if args.constraint == "json"
                  else StructuredOutputsParams(regex=STRUCTURED_TEXT))
    n = args.max_tokens
    plain = SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n)
    constrained = SamplingParams(temperature=args.temperature, max_tokens=n,
                                 min_tokens=n if args.constraint == "text" else 0,
                                 structured_outputs=constraint)
    half = args.batch // 2
    runs = [("unconstrained", [plain] * args.batch),
            (f"{half}/{args.batch} constrained", [constrained] * half + [plain] * (args.batch - half))]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, structured_outputs=constraint),
                 use_tqdm=False)
    install(llm)
    for name, params in runs:
        llm.generate(prompts, params, use_tqdm=False)  # warm-up: this shape once
        TOTALS.clear()
        CALLS.clear()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        report(name, sum(len(o.outputs[0].token_ids) for o in outs), wall)


if __name__ == "__main__":
    main()
