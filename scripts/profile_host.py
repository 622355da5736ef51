"""Where the host's time goes in a generate() of `pagedllm bench structured`'s shape.

Runs one unconstrained batch and one with half of it under a JSON schema (or the free-text
regex), after a warm-up each, and times the engine's host phases with wrappers (exclusive
wall time: a wrapped call inside another counts for itself only). On CUDA the model calls
only queue kernels, so their rows are launch cost and the `wait` rows are the host idling
on the device; on the CPU the model rows are the compute itself. With --device-gaps (CUDA)
each row is instead the device time that passed inside the phase: where the phase queues
no work, the time the device sat idle waiting for the host there (no profiler's overhead).

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
import gc
import random
import threading
import time
import traceback
import warnings

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.workloads import STRUCTURED_JSON, STRUCTURED_TEXT
from pagedllm.sampling_params import StructuredOutputsParams

TOTALS: dict[str, float] = collections.defaultdict(float)
CALLS: collections.Counter = collections.Counter()
_stack: list[float] = []
# --device-gaps: per wrapped call on the engine's thread, CUDA events at its entry and exit
# and the index of the call it runs inside: (label, entry, exit, parent).
EVENTS: list[tuple[str, object, object, int]] = []
_open: list[int] = []
_device_gaps = False


def wrap(owner, name: str, label: str) -> None:
    inner_fn = getattr(owner, name)

    @functools.wraps(inner_fn)
    def timed(*args, **kwargs):
        return wrap_call(label, inner_fn, *args, **kwargs)

    setattr(owner, name, timed)


def wrap_call(label: str, fn, *args, **kwargs):
    """fn(*args, **kwargs), its exclusive wall time added to `label`'s row."""
    if threading.current_thread() is not threading.main_thread():
        # Another thread's time overlaps the engine's: its own row, out of the nesting.
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TOTALS[f"other thread: {label}"] += time.perf_counter() - start
            CALLS[f"other thread: {label}"] += 1
    if _device_gaps:
        return _call_between_events(label, fn, *args, **kwargs)
    start = time.perf_counter()
    _stack.append(0.0)
    try:
        return fn(*args, **kwargs)
    finally:
        elapsed = time.perf_counter() - start
        nested = _stack.pop()
        TOTALS[label] += elapsed - nested
        CALLS[label] += 1
        if _stack:
            _stack[-1] += elapsed


def _call_between_events(label: str, fn, *args, **kwargs):
    """fn(*args, **kwargs) between two CUDA events on the current stream. Where fn queues
    no device work, the device time between them is the device's idle time during the call:
    a busy device passes both events back to back."""
    import torch

    entry = torch.cuda.Event(enable_timing=True)
    entry.record()
    index = len(EVENTS)
    EVENTS.append((label, entry, None, _open[-1] if _open else -1))
    _open.append(index)
    try:
        return fn(*args, **kwargs)
    finally:
        _open.pop()
        exit_ = torch.cuda.Event(enable_timing=True)
        exit_.record()
        EVENTS[index] = (label, entry, exit_, EVENTS[index][3])


def report_device_gaps(name: str, wall: float) -> None:
    """Device time that passed inside each wrapped call, exclusive of the calls inside it.
    For calls that queue no device work (advance, fill, update, scheduling) it is the time
    the device sat idle while the host was there; for the ones that queue work (forward,
    sampler, mask) it also holds that work's device time."""
    import torch

    torch.cuda.synchronize()
    spans = [entry.elapsed_time(exit_) / 1e3 for _, entry, exit_, _ in EVENTS]
    exclusive = list(spans)
    for i, (_, _, _, parent) in enumerate(EVENTS):
        if parent >= 0:
            exclusive[parent] -= spans[i]
    totals: dict[str, float] = collections.defaultdict(float)
    for (label, _, _, _), seconds in zip(EVENTS, exclusive):
        totals[label] += seconds
    top = [(entry, exit_) for _, entry, exit_, parent in EVENTS if parent < 0]
    totals["(between wrapped calls)"] = sum(
        a[1].elapsed_time(b[0]) for a, b in zip(top, top[1:])) / 1e3
    first, last = EVENTS[0][1], EVENTS[-1][2]
    print(f"{name}: device time passed inside wrapped calls (wall {wall:.2f} s, device "
          f"{first.elapsed_time(last) / 1e3:.2f} s from the first call to the last)")
    for label, seconds in sorted(totals.items(), key=lambda kv: -kv[1])[:24]:
        print(f"  {label:32s} {seconds * 1e3:9.1f} ms")
    EVENTS.clear()


def install(llm: LLM, mask_threads: int | None = None) -> None:
    from pagedllm.contract import StepResult
    from pagedllm.engine.core import EngineCore
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.worker import model_runner as mr

    engine = llm.engine
    wrap(LLMEngine, "add_request", "engine.add_request")
    for name in ("_schedule_and_launch", "_launch_ahead", "_launch", "_forget"):
        wrap(EngineCore, name, f"engine.{name}")
    for name in ("schedule", "schedule_continuation", "update_from_output",
                 "free_finished_seq_groups"):
        wrap(type(engine.scheduler), name, f"scheduler.{name}")
    wrap(type(engine.output_processor), "process", "outputs.process")
    wrap(type(engine.batch_builder), "build", "batch_builder.build")
    wrap(StepResult, "samples", "StepResult.samples")
    wrap(type(engine.structured), "advance", "structured.advance")
    for name in ("start_fill", "finish_fill"):
        wrap(type(engine.structured), name, f"structured.{name}")
    engine.structured._executor = _TimedExecutor(mask_threads)
    for name in ("gather", "apply", "prepare_input"):
        wrap(mr.ModelRunner, name, f"runner.{name}")
    wrap(mr.ModelRunner, "forward", "model: forward")
    wrap(engine.worker.model, "compute_logits", "model: compute_logits")
    wrap(mr.DecodeWindow, "sample_with_bitmask", "model: sample_with_bitmask")
    wrap(type(engine.worker.runner.sampler), "sample", "model: sampler.sample")
    wrap(mr.FlatBatch, "next_decode_step", "model: next_decode_step")
    wrap(mr._HostCopy, "__init__", "model: samples copy queued")
    wrap(mr._HostCopy, "get", "wait: samples to the host")
    # Finer rows inside `model: forward` and `model: sampler.sample` (module functions are
    # looked up by name at each call, so wrapping them in their module times every call).
    from pagedllm.layers import sampler as sm
    from pagedllm.worker import cuda_graphs as cg

    wrap(cg, "pad_decode_batch", "graphs: pad_decode_batch")
    wrap(cg.DecodeBatch, "pinned", "graphs: pin inputs")
    wrap(cg.StaticMetadata, "load", "graphs: copy inputs")
    wrap(cg.DecodeCUDAGraphs, "_replay", "graphs: replay")
    wrap(type(engine.worker.model), "forward", "model: eager forward")
    for name in ("_sample_with_triton", "_pack_logprobs", "_sample_rows"):
        wrap(sm, name, f"sampler: {name}")


class _TimedExecutor:
    """llguidance's executor (an extension type, so not wrappable in place), timed."""

    def __init__(self, threads: int | None) -> None:
        import llguidance

        from pagedllm.engine.structured_output import _usable_cpus

        self._inner = llguidance.LLExecutor(threads or min(32, _usable_cpus()))

    def unsafe_compute_mask_ptr(self, *args):
        wrap_call("llguidance: executor fill", self._inner.unsafe_compute_mask_ptr, *args)


def show_syncs() -> None:
    """Warn (once per place) where the host synchronizes with the device unasked."""
    import torch

    seen: set[str] = set()

    def show(message, category, filename, lineno, file=None, line=None):
        stack = [f"{f.filename.split('pagedllm/')[-1]}:{f.lineno} {f.name}"
                 for f in traceback.extract_stack()[:-2] if "pagedllm" in f.filename]
        key = " <- ".join(reversed(stack[-4:]))
        if key not in seen:
            seen.add(key)
            print(f"sync: {message} at {key}")

    warnings.showwarning = show
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")


_gc_start = [0.0]


def time_gc(phase: str, info: dict) -> None:
    """Collector passes, per generation, as rows of the report."""
    if phase == "start":
        _gc_start[0] = time.perf_counter()
        return
    elapsed = time.perf_counter() - _gc_start[0]
    label = f"gc: generation {info['generation']} passes"
    main = threading.current_thread() is threading.main_thread()
    if not main:
        label = f"other thread: {label}"
    TOTALS[label] += elapsed
    CALLS[label] += 1
    if _stack and main:
        _stack[-1] += elapsed


def report(name: str, tokens: int, wall: float) -> None:
    waits = sum(v for k, v in TOTALS.items() if k.startswith("wait"))
    print(f"{name}: {tokens} tokens in {wall:.2f} s = {tokens / wall:.0f} tok/s; host waited on "
          f"the device {waits:.2f} s, busy {wall - waits:.2f} s "
          f"({1e6 * (wall - waits) / tokens:.1f} us/token)")
    for label, seconds in sorted(TOTALS.items(), key=lambda kv: -kv[1]):
        print(f"  {label:32s} {seconds * 1e3:9.1f} ms {CALLS[label]:7d} calls "
              f"{1e6 * seconds / tokens:7.2f} us/token")
    rest = wall - sum(v for k, v in TOTALS.items() if not k.startswith("other thread"))
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
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--constrained-only", action="store_true", help="skip the unconstrained run")
    p.add_argument("--unconstrained-only", action="store_true", help="skip the constrained run")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--mask-threads", type=int, default=None,
                   help="llguidance's mask-filling threads (default: the engine's)")
    p.add_argument("--show-syncs", action="store_true",
                   help="CUDA: print where the host waits on the device unasked")
    p.add_argument("--device-gaps", action="store_true",
                   help="CUDA: instead of host times, the device time that passes inside each "
                        "wrapped call (two CUDA events per call; no profiler)")
    args = p.parse_args()
    kwargs = dict(load_format=args.load_format, dtype=args.dtype, enable_prefix_caching=False,
                  max_num_seqs=args.batch)
    for key in ("model", "device", "tokenizer", "kv_cache_memory", "num_scheduler_steps",
                "async_scheduling", "max_num_batched_tokens"):
        if getattr(args, key) is not None:
            kwargs[key] = getattr(args, key)
    llm = LLM(**kwargs)
    if args.device_gaps and not next(llm.engine.worker.model.parameters()).is_cuda:
        p.error("--device-gaps needs a CUDA device")
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 30000) for _ in range(rng.randint(args.min_input_len,
                                                                      args.max_input_len))]
               for _ in range(args.batch)]
    constraint = (StructuredOutputsParams(json=STRUCTURED_JSON) if args.constraint == "json"
                  else StructuredOutputsParams(regex=STRUCTURED_TEXT))
    n = args.max_tokens
    plain = SamplingParams(temperature=args.temperature, top_p=args.top_p, ignore_eos=True,
                           max_tokens=n)
    constrained = SamplingParams(temperature=args.temperature, max_tokens=n,
                                 min_tokens=n if args.constraint == "text" else 0,
                                 structured_outputs=constraint)
    half = args.batch // 2
    runs = [("unconstrained", [plain] * args.batch),
            (f"{half}/{args.batch} constrained", [constrained] * half + [plain] * (args.batch - half))]
    if args.constrained_only and args.unconstrained_only:
        p.error("--constrained-only and --unconstrained-only leave no run")
    if args.constrained_only:
        runs = runs[1:]
    if args.unconstrained_only:
        runs = runs[:1]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, structured_outputs=constraint),
                 use_tqdm=False)
    install(llm, args.mask_threads)
    gc.callbacks.append(time_gc)
    if args.show_syncs:
        show_syncs()
    global _device_gaps
    for name, params in runs:
        llm.generate(prompts, params, use_tqdm=False)  # warm-up: this shape once
        TOTALS.clear()
        CALLS.clear()
        EVENTS.clear()
        _device_gaps = args.device_gaps
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        _device_gaps = False
        if args.device_gaps:
            report_device_gaps(name, wall)
        else:
            report(name, sum(len(o.outputs[0].token_ids) for o in outs), wall)


if __name__ == "__main__":
    main()
