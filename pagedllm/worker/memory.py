"""Memory profiling: how many KV blocks each device can hold.

All devices share one block table, so the engine's block count is the minimum over devices
of (that device's KV budget / bytes per block of the layers it holds).
"""
from __future__ import annotations

import gc
import logging
import resource
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

# Without --kv-cache-memory, the CPU KV cache takes this share of the RAM that is free
# after the weights are loaded, minus the activation peak, up to a cap.
CPU_KV_FRACTION = 0.25
CPU_KV_CAP = 2 << 30


def available_host_memory() -> int:
    """MemAvailable from /proc/meminfo (bytes); a conservative 4 GiB where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def _max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def profile_peak_memory(run: Callable[[], None], devices: list[torch.device]) -> dict[torch.device, int]:
    """Run `run` once (the largest batch) and return each device's activation peak in bytes."""
    cuda = [d for d in devices if d.type == "cuda"]
    before = {d: torch.cuda.memory_allocated(d) for d in cuda}
    for d in cuda:
        torch.cuda.reset_peak_memory_stats(d)
    rss_before = _max_rss()
    run()
    peaks: dict[torch.device, int] = {}
    for d in cuda:
        torch.cuda.synchronize(d)
        peaks[d] = torch.cuda.max_memory_allocated(d) - before[d]
    for d in devices:
        if d.type == "cpu":
            # ru_maxrss only grows: this is the rise of the process' high-water mark.
            peaks[d] = max(_max_rss() - rss_before, 0)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return peaks


def kv_budget(
    device: torch.device,
    activation_peak: int,
    gpu_memory_utilization: float,
    kv_cache_memory: int | None,
) -> int:
    """Bytes this device may give its KV cache."""
    if kv_cache_memory is not None:
        return int(kv_cache_memory)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free  # weights, other processes, the allocator's cache
        return int(total * gpu_memory_utilization - used - activation_peak)
    free_ram = available_host_memory()
    return int(min(free_ram * CPU_KV_FRACTION, CPU_KV_CAP) - activation_peak)


def num_blocks_for_budgets(budgets: dict[torch.device, int], block_bytes: dict[torch.device, int]) -> int:
    """The shared block count: min over devices of budget / bytes per block there."""
    counts = {d: max(budgets[d], 0) // block_bytes[d] for d in block_bytes if block_bytes[d] > 0}
    return min(counts.values())
