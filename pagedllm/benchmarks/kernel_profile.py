"""Kernel time by kind over one timed run (`pagedllm bench sharegpt --profile`, and nano's):
torch's profiler records every CUDA kernel of the run, and their durations are summed into
the kinds of issue 31's table. Beside the run's wall time the sum gives the GPU-busy share
(what is left is host gaps). The profiler's own overhead lowers the run's tok/s a little:
compare tok/s across runs without --profile."""
from __future__ import annotations

import re
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

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        yield seconds
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
