"""`pagedllm bench engine-state`: the cost of one GET /v1/engine/state snapshot on a busy engine.

A scheduler (no model) holds `num_seqs` running sequences in decode, their prompts sharing a
prefix so the pool has used, shared and cached blocks; each call builds the snapshot
(engine/state.py) and encodes it as JSON with orjson, as the route does. The snapshot runs on the engine's
thread between two steps, so its time is time the engine does not step.
"""
from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import asdict, dataclass

import orjson

from pagedllm.benchmarks.scheduler_bench import _cdiv, _step, percentile
from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.sequence import Sequence, SequenceGroup
from pagedllm.engine.state import engine_state
from pagedllm.entrypoints.usage import Parser, UsageError
from pagedllm.sampling_params import SamplingParams


@dataclass
class EngineStateBenchResult:
    num_seqs: int
    num_gpu_blocks: int
    num_calls: int
    mean_us: float  # snapshot + JSON encoding, per call
    p50_us: float
    p99_us: float
    snapshot_mean_us: float  # engine_state() alone
    json_bytes: int
    # CPU time of this thread per call: unlike the wall-clock figures it leaves out the time
    # other processes hold the core, so it is the steadier number on a busy machine.
    cpu_mean_us: float = 0.0
    cpu_p50_us: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def busy_scheduler(num_seqs: int, prompt_len: int, shared_len: int, num_gpu_blocks: int,
                   decode_steps: int, block_size: int = 16, seed: int = 0) -> Scheduler:
    """A scheduler with `num_seqs` sequences decoding, prompts sharing `shared_len` tokens."""
    rng = random.Random(seed)
    max_len = prompt_len + decode_steps + 64
    needed = num_seqs * (_cdiv(max_len, block_size) + 1)
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=8192, max_model_len=max_len),
        CacheConfig(block_size=block_size, enable_prefix_caching=True),
        num_gpu_blocks=max(num_gpu_blocks, needed), num_cpu_blocks=0,
    )
    shared = [rng.randrange(10000) for _ in range(shared_len)]
    params = SamplingParams(max_tokens=max_len, ignore_eos=True)
    tokens = [rng.randrange(10000) for _ in range(4099)]
    for i in range(num_seqs):
        prompt = shared + [rng.randrange(10000) for _ in range(prompt_len - shared_len)]
        scheduler.add_seq_group(SequenceGroup(f"bench-{i}", [Sequence(i, prompt, block_size)],
                                              params))
        if i == 0:  # computed first, so the others find the shared prefix in the cache
            _step(scheduler, tokens, 0)
    step = 1
    while step < decode_steps or len(scheduler.running) < num_seqs:
        _step(scheduler, tokens, 7 * step)
        step += 1
    return scheduler


def run_engine_state_bench(num_seqs: int = 256, prompt_len: int = 128, shared_len: int = 64,
                           num_gpu_blocks: int = 0, num_calls: int = 200,
                           seed: int = 0) -> EngineStateBenchResult:
    if num_seqs < 1 or num_calls < 1 or not 0 <= shared_len <= prompt_len:
        raise ValueError("need num_seqs >= 1, num_calls >= 1 and 0 <= shared_len <= prompt_len")
    scheduler = busy_scheduler(num_seqs, prompt_len, shared_len, num_gpu_blocks, 20, seed=seed)
    total_us, snapshot_us, cpu_us = [], [], []
    size = 0
    for _ in range(num_calls):
        cpu_start, start = time.thread_time_ns(), time.perf_counter_ns()
        state = engine_state(scheduler)
        middle = time.perf_counter_ns()
        size = len(orjson.dumps(state))
        end = time.perf_counter_ns()
        cpu_us.append((time.thread_time_ns() - cpu_start) / 1000)
        total_us.append((end - start) / 1000)
        snapshot_us.append((middle - start) / 1000)
    return EngineStateBenchResult(
        num_seqs=len(scheduler.running), num_gpu_blocks=scheduler.block_manager.num_total_gpu_blocks,
        num_calls=num_calls, mean_us=statistics.fmean(total_us),
        p50_us=percentile(total_us, 50), p99_us=percentile(total_us, 99),
        snapshot_mean_us=statistics.fmean(snapshot_us), json_bytes=size,
        cpu_mean_us=statistics.fmean(cpu_us), cpu_p50_us=percentile(cpu_us, 50),
    )


def main(argv: list[str]) -> int:
    p = Parser(prog="pagedllm bench engine-state", description=__doc__.split("\n")[0])
    p.add_argument("--num-seqs", type=int, default=256, help="running sequences (default 256)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--shared-len", type=int, default=64, help="prompt tokens all requests share")
    p.add_argument("--num-gpu-blocks", type=int, default=0,
                   help="pool size (default: just what the sequences need)")
    p.add_argument("--num-calls", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        result = run_engine_state_bench(args.num_seqs, args.prompt_len, args.shared_len,
                                        args.num_gpu_blocks, args.num_calls, args.seed)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    print(json.dumps(result.to_dict()))
    ms = {k: v / 1000 for k, v in result.to_dict().items() if k.endswith("_us")}
    print(f"engine-state: {result.num_seqs} running seqs, {result.num_gpu_blocks} GPU blocks: "
          f"{ms['cpu_mean_us']:.3f} ms CPU per call (p50 {ms['cpu_p50_us']:.3f}); wall "
          f"{ms['mean_us']:.3f} ms (p50 {ms['p50_us']:.3f}, p99 {ms['p99_us']:.3f}; snapshot "
          f"alone {ms['snapshot_mean_us']:.3f}); {result.json_bytes} bytes of JSON")
    return 0
