"""Kernel time by kind over one timed run (`pagedllm bench sharegpt --profile`, and nano's):
torch's profiler records every CUDA kernel of the run, and their durations are summed into
the kinds of issue 31's table. Beside the run's wall time the sum gives the GPU-busy share
(what is left is host gaps). The device's idle gaps by length follow, and what can stall the
host mid-run: Triton compiling (or loading) a kernel variant first launched in the run, and
the caching allocator's cudaMalloc / cudaFree calls. The profiler's own overhead lowers the
run's tok/s a little: compare tok/s across runs without --profile."""
from __future__ import annotations

import functools
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager

# (kind, pattern over the kernel's name), first match wins; the last takes the rest
KINDS: tuple[tuple[str, str], ...] = (
    ("GEMMs (cuBLAS, skinny GEMV, FP8)", r"gemm|nvjet|cutlass|xmma|cublas|_skinny|_fp8_matmul"),
    ("decode attention", r"_paged_decode|_merge_splits"),
    ("prefill attention", r"_paged_prefill|flash"),
    ("sampling: sort, scan, threshold, softmax, race",
     r"sort|radix|scan|softmax|_threshold|_row_stats|_sample|_race|exponential|argmax|topk|"
     r"cumsum|gather_topk|_penalt|_check_kernel"),
    ("norms, SiLU, rotary + cache", r"rms_norm|silu|rotary|_cache_kernel|_write_kv"),
    ("copies, casts, elementwise, memsets", r"copy|elementwise|memset|memcpy|fill|cast"),
    ("the rest", r""),
)


TOP = 30
# Idle stretches of the device by length (microseconds): many short ones are launch-bound
# steps (eager kernels), a few long ones are the host waiting on the device or the reverse.
GAP_BUCKETS_US = (20, 200, 2000)
TOP_GAPS = 10
# The caching allocator's counters whose change over the run is printed: a cudaMalloc or
# cudaFree mid-run stalls the host, and a retry frees the whole cache after waiting for the
# device.
ALLOCATOR_COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries")


def kind_of(kernel: str) -> str:
    name = kernel.lower()
    return next(kind for kind, pattern in KINDS if re.search(pattern, name))


@contextmanager
def kernel_profile(enabled: bool) -> Iterator[dict[str, float]]:
    """Record the CUDA kernels run inside; on exit the yielded dict holds seconds per kind
    (empty when not enabled or nothing ran on CUDA), and the TOP kernels by time are
    printed (name, calls, seconds): what a kind is made of."""
    seconds: dict[str, float] = {}
    if not enabled:
        yield seconds
        return
    from torch.profiler import ProfilerActivity, profile

    allocator_before = allocator_counters()
    with profile(activities=[ProfilerActivity.CUDA]) as prof, jit_compiles() as compiles:
        yield seconds
    allocator_after = allocator_counters()
    for kind, _ in KINDS:
        seconds[kind] = 0.0
    kernels = []
    for event in prof.key_averages():
        micros = getattr(event, "device_time_total", None)
        if micros is None:
            micros = getattr(event, "cuda_time_total", 0.0)
        if micros > 0:
            seconds[kind_of(event.key)] += micros / 1e6
            kernels.append((micros / 1e6, event.count, event.key))
    print(f"top {TOP} kernels by time (seconds, calls, name):")
    for secs, calls, name in sorted(kernels, reverse=True)[:TOP]:
        print(f"  {secs:8.3f} {calls:8d}  {name[:110]}")
    print_gaps(prof)
    print("\n".join(host_stall_report(compiles, allocator_before, allocator_after)))


@contextmanager
def timed_calls(owner: object, name: str) -> Iterator[list[tuple[float, str, float]]]:
    """Inside, each call of the method `owner.name` is recorded as (seconds since the block
    began, the name of `self.fn` (a JITFunction's kernel) or "?", milliseconds it took)."""
    calls: list[tuple[float, str, float]] = []
    inner = getattr(owner, name)
    t0 = time.perf_counter()

    @functools.wraps(inner)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            label = getattr(getattr(args[0], "fn", None), "__name__", "?") if args else "?"
            calls.append((start - t0, label, (time.perf_counter() - start) * 1e3))

    setattr(owner, name, timed)
    try:
        yield calls
    finally:
        setattr(owner, name, inner)


@contextmanager
def jit_compiles() -> Iterator[list[tuple[float, str, float]]]:
    """Triton's compiles inside: a kernel variant (its constexprs and the JIT's
    specialization of its arguments) launched for the first time in the process is compiled,
    or loaded from Triton's disk cache, on the launching thread while the device may idle.
    Empty where Triton or its JITFunction._do_compile is missing."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        JITFunction = None
    if JITFunction is None or not hasattr(JITFunction, "_do_compile"):
        yield []
        return
    with timed_calls(JITFunction, "_do_compile") as calls:
        yield calls


def allocator_counters() -> dict[str, int]:
    """ALLOCATOR_COUNTERS of the current CUDA device now (empty without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {key: int(stats.get(key, 0)) for key in ALLOCATOR_COUNTERS}


def host_stall_report(compiles: list[tuple[float, str, float]], before: dict[str, int],
                      after: dict[str, int]) -> list[str]:
    """Lines: the run's Triton compiles (count, seconds, the longest with when they began in
    seconds since the run began) and the change of the allocator's counters."""
    total = sum(ms for _, _, ms in compiles) / 1e3
    lines = [f"Triton compiles or loads in the run: {len(compiles)} ({total:.3f} s)"]
    for start, name, ms in sorted(compiles, key=lambda c: -c[2])[:TOP_GAPS]:
        lines.append(f"  {start:8.3f} {ms:8.2f}  {name}")
    if after:
        change = ", ".join(f"{key} +{after[key] - before.get(key, 0)}" for key in after)
        lines.append(f"CUDA caching allocator in the run: {change}")
    return lines


def idle_gaps(spans: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """The stretches in which no kernel ran, between the first kernel's start and the last
    one's end: (start, length, the name of the kernel that ends it). `spans` are kernels'
    (start, end, name) in any order; overlapping ones (several streams) count as one."""
    gaps: list[tuple[float, float, str]] = []
    busy_until = None
    for start, end, name in sorted(spans):
        if busy_until is not None and start > busy_until:
            gaps.append((busy_until, start - busy_until, name))
        busy_until = end if busy_until is None else max(busy_until, end)
    return gaps


def gap_report(gaps: list[tuple[float, float, str]], t0: float) -> list[str]:
    """Lines: the idle time by length bucket (count, seconds), then the longest gaps (when,
    in seconds since `t0`, how long, and the kernel after each). Times in microseconds."""
    edges = (0.0, *GAP_BUCKETS_US, float("inf"))
    lines = ["device idle gaps by length (count, seconds):"]
    for low, high in zip(edges, edges[1:]):
        inside = [length for _, length, _ in gaps if low <= length < high]
        label = f">= {low:g} us" if high == float("inf") else f"{low:g}-{high:g} us"
        lines.append(f"  {label:14s} {len(inside):8d} {sum(inside) / 1e6:8.3f}")
    lines.append(f"the {TOP_GAPS} longest (at s, ms, the kernel after):")
    for start, length, name in sorted(gaps, key=lambda g: -g[1])[:TOP_GAPS]:
        lines.append(f"  {(start - t0) / 1e6:8.3f} {length / 1e3:8.2f}  {name[:90]}")
    return lines


def print_gaps(prof) -> None:
    from torch.autograd import DeviceType

    spans = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
             if e.device_type == DeviceType.CUDA]
    if spans:
        print("\n".join(gap_report(idle_gaps(spans), min(s for s, _, _ in spans))))


def print_table(seconds: dict[str, float], wall_s: float) -> float:
    """The table on stdout; returns the GPU-busy share (kernel seconds / wall seconds)."""
    total = sum(seconds.values())
    print("| kernels | seconds |\n|---|---:|")
    for kind, s in seconds.items():
        print(f"| {kind} | {s:.2f} |")
    busy = total / wall_s if wall_s else 0.0
    print(f"| all kernels / wall time | {total:.2f} / {wall_s:.2f} ({busy:.0%} busy) |")
    return busy


def profile_summary(seconds: dict[str, float], wall_s: float) -> dict:
    """A bench summary's profile entries (none when nothing was recorded): the seconds per
    kind and the GPU-busy share; the table goes to stdout."""
    if not seconds:
        return {}
    return {"kernel_seconds": seconds, "gpu_busy_share": print_table(seconds, wall_s)}
