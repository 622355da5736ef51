"""The host-side cost of one decode step: scheduler + block manager, no model.

Every step the engine pays schedule(), mark_computed(), appending the sampled token to each
sequence and freeing finished groups. With many running sequences this is pure Python on the
critical path between two forwards, so it must stay small next to a GPU decode step. The
StepBatch the engine then builds for the worker (engine/batch_builder.py) is timed apart
(`build_mean_us`, not part of the step's figures).
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.engine.batch_builder import StepBatchBuilder
from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.sampling_params import SamplingParams


@dataclass
class SchedulerBenchResult:
    num_seqs: int
    prompt_len: int
    num_steps: int
    mean_us: float
    p50_us: float
    p99_us: float
    max_us: float
    schedule_mean_us: float  # the schedule() part of mean_us
    # CPU time of this thread per step: unlike the wall-clock numbers it leaves out the time
    # other processes hold the core, so it is the steadier number on a busy machine.
    cpu_mean_us: float
    cpu_p50_us: float
    num_waiting: int = 0
    build_mean_us: float = 0.0  # StepBatch build per step, outside the figures above

    def to_dict(self) -> dict:
        return asdict(self)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), interpolated between the two nearest ranks."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _step(scheduler: Scheduler, tokens: list[int], offset: int,
          builder: StepBatchBuilder | None = None) -> tuple[int, int, int]:
    """One engine step without the model; returns the ns spent in schedule(), and the wall
    and thread-CPU ns of building the StepBatch (not part of the step's own time)."""
    start = time.perf_counter_ns()
    out = scheduler.schedule()
    scheduled_ns = time.perf_counter_ns() - start
    build_ns = build_cpu_ns = 0
    if builder is not None:
        cpu_start, start = time.thread_time_ns(), time.perf_counter_ns()
        builder.build(out)
        build_ns = time.perf_counter_ns() - start
        build_cpu_ns = time.thread_time_ns() - cpu_start
    for scheduled in out.scheduled_seq_groups:  # counted computed as the engine's update does
        for seq in scheduled.seq_group.get_seqs(SequenceStatus.RUNNING):
            scheduler.mark_computed(seq, scheduled.token_chunk_size)
    i = offset
    for scheduled in out.scheduled_seq_groups:
        if scheduled.do_sample:
            for seq in scheduled.seq_group.get_seqs(SequenceStatus.RUNNING):
                seq.append_token(tokens[i % len(tokens)])
                i += 1
    scheduler.free_finished_seq_groups()
    return scheduled_ns, build_ns, build_cpu_ns


def run_scheduler_bench(
    num_seqs: int = 256,
    prompt_len: int = 128,
    num_steps: int = 200,
    block_size: int = 16,
    enable_prefix_caching: bool = True,
    max_num_batched_tokens: int = 8192,
    seed: int = 0,
    num_waiting: int = 0,
) -> SchedulerBenchResult:
    """Admit `num_seqs` random prompts, run their prefills (untimed), then time decode steps.

    `num_waiting` more requests queue behind the full batch (max_num_seqs = num_seqs) and are
    never admitted: the steady state of a loaded server, where every step also looks at the
    waiting queue.
    """
    for name, value in (("num_seqs", num_seqs), ("prompt_len", prompt_len),
                        ("num_steps", num_steps)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if num_waiting < 0:
        raise ValueError(f"num_waiting must be non-negative, got {num_waiting}")
    rng = random.Random(seed)
    # Prefill can take up to prompt_len steps (chunks), then num_steps decodes: room for all.
    max_len = prompt_len + num_steps + _cdiv(num_seqs * prompt_len, max_num_batched_tokens) + 2
    num_blocks = num_seqs * (_cdiv(max_len, block_size) + 1)
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                        max_model_len=max_len),
        CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        num_gpu_blocks=num_blocks,
        num_cpu_blocks=0,
    )
    params = SamplingParams(max_tokens=num_steps + 1, ignore_eos=True)
    for i in range(num_seqs + num_waiting):
        prompt = [rng.randrange(10000) for _ in range(prompt_len)]
        scheduler.add_seq_group(SequenceGroup(f"bench-{i}", [Sequence(i, prompt, block_size)],
                                              params))
    tokens = [rng.randrange(10000) for _ in range(4099)]

    def all_decoding() -> bool:
        return len(scheduler.running) == num_seqs and all(
            not s.is_prefill for g in scheduler.running for s in g.get_seqs()
        )

    builder = StepBatchBuilder()
    warmup_steps = 0
    while not all_decoding():
        _step(scheduler, tokens, warmup_steps, builder)
        warmup_steps += 1

    step_us: list[float] = []
    schedule_us: list[float] = []
    cpu_us: list[float] = []
    build_us: list[float] = []
    for step in range(num_steps):
        cpu_start = time.thread_time_ns()
        start = time.perf_counter_ns()
        scheduled_ns, build_ns, build_cpu_ns = _step(scheduler, tokens,
                                                     7 * (warmup_steps + step), builder)
        step_us.append((time.perf_counter_ns() - start - build_ns) / 1000)
        cpu_us.append((time.thread_time_ns() - cpu_start - build_cpu_ns) / 1000)
        schedule_us.append(scheduled_ns / 1000)
        build_us.append(build_ns / 1000)
    return SchedulerBenchResult(
        num_seqs=num_seqs,
        prompt_len=prompt_len,
        num_steps=num_steps,
        mean_us=statistics.fmean(step_us),
        p50_us=percentile(step_us, 50),
        p99_us=percentile(step_us, 99),
        max_us=max(step_us),
        schedule_mean_us=statistics.fmean(schedule_us),
        cpu_mean_us=statistics.fmean(cpu_us),
        cpu_p50_us=percentile(cpu_us, 50),
        num_waiting=num_waiting,
        build_mean_us=statistics.fmean(build_us),
    )
