"""Memory accounting: free memory per device, activation peaks, and how many KV blocks
the devices can hold.

All devices share one block table, so the engine's block count is the minimum over devices
of (that device's KV budget / bytes per block of the layers it holds).
"""
from __future__ import annotations

import contextlib
import gc
import logging
import resource
import threading
from collections.abc import Callable, Sequence

import torch
from torch import nn

from pagedllm.config import ModelConfig

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


def free_memory(device: torch.device) -> int:
    """Bytes free on the device now (host RAM for the CPU)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_host_memory()


def usable_memory(device: torch.device, gpu_memory_utilization: float) -> int:
    """Bytes the engine may still take on the device: on CUDA, its share of the card minus
    what is in use already; on the CPU, the RAM that is free."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(total * gpu_memory_utilization - (total - free))
    return available_host_memory()


def module_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers (works on the meta device too)."""
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


RUNTIME_SLACK = 32 << 20


def estimate_activation_peak(
    config: ModelConfig, num_tokens: int, num_logit_rows: int, dtype: torch.dtype,
    max_model_len: int | None = None,
) -> int:
    """An upper bound of one forward's working memory (bytes).

    It places layers before the model exists, and sizes the CPU's KV cache instead of a
    profiling forward (on CUDA the measured peak decides). Per token, what a layer holds at
    once: the hidden state, the residual and the norm's output, q/k/v and the attention
    output, the fused gate|up projection and the activation; for attention, the context one
    prompt chunk reads back from the cache (K and V of up to max_model_len tokens, gathered,
    then converted) and its boolean mask; then the fp32 logits with their log-softmax and
    the sampler's copy. The bound stays above the peaks of real CPU forwards
    (tests/test_memory.py). Part of a peak does not shrink with the step (workspaces MKL and
    OpenMP first touch, the allocator's slack), hence RUNTIME_SLACK.
    """
    size = torch.tensor([], dtype=dtype).element_size()
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    per_token = 4 * config.hidden_size + 2 * (q + 2 * kv) + 4 * config.intermediate_size
    context = max(max_model_len or num_tokens, num_tokens)
    attention = 2 * 2 * context * kv * size + num_tokens * context
    logits = num_logit_rows * config.vocab_size * 4 * 3  # fp32 logits, log-softmax, sampling
    return num_tokens * per_token * size + attention + logits + RUNTIME_SLACK


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _rss() -> int:
    kib = _status_kib("VmRSS")
    return 0 if kib is None else kib * 1024


def _max_rss() -> int:
    """The RSS high-water mark (Linux's VmHWM, which clear_refs resets)."""
    kib = _status_kib("VmHWM")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 if kib is None else kib * 1024


def _reset_max_rss() -> bool:
    """Bring the RSS high-water mark down to the current RSS (Linux: /proc/self/clear_refs),
    so a peak measured next is that run's, not the load's (which can be higher). False where
    the mark did not come down (some kernels and sandboxes refuse or ignore the write)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _max_rss() - _rss() < (4 << 20)


class _RssSampler:
    """The highest RSS seen by polling, where the kernel's mark cannot be reset."""

    def __init__(self, interval_s: float = 0.0005) -> None:
        self.interval_s, self.peak = interval_s, _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, _rss())

    def __enter__(self) -> "_RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def profile_peak_memory(run: Callable[[], None], devices: list[torch.device]) -> dict[torch.device, int]:
    """Run `run` once (the largest batch) and return each device's activation peak in bytes."""
    cuda = [d for d in devices if d.type == "cuda"]
    before = {d: torch.cuda.memory_allocated(d) for d in cuda}
    for d in cuda:
        torch.cuda.reset_peak_memory_stats(d)
    sampler = None
    if any(d.type == "cpu" for d in devices) and not _reset_max_rss():
        sampler = _RssSampler()
    rss_before = _rss() if sampler else _max_rss()
    with sampler or contextlib.nullcontext():
        run()
    peaks: dict[torch.device, int] = {}
    for d in cuda:
        torch.cuda.synchronize(d)
        peaks[d] = torch.cuda.max_memory_allocated(d) - before[d]
    for d in devices:
        if d.type == "cpu":
            # The rise of the process' high-water mark (or of the polled RSS).
            peaks[d] = max((sampler.peak if sampler else _max_rss()) - rss_before, 0)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return peaks


def per_device_values(name: str, value, devices: Sequence[torch.device], cast) -> dict:
    """One value for all devices, or one per device (a list, or "a,b" as a string)."""
    if value is None:
        return {d: None for d in devices}
    if isinstance(value, str):
        try:
            value = [cast(float(v)) for v in value.split(",")]
        except ValueError:
            raise ValueError(
                f"{name} must be a number or comma-separated numbers, got {value!r}"
            ) from None
    if not isinstance(value, (list, tuple)):
        value = [value]
    if len(value) == 1:
        value = list(value) * len(devices)
    if len(value) != len(devices):
        shown = ", ".join(str(d) for d in devices)
        raise ValueError(
            f"{name} has {len(value)} values but the device map uses {len(devices)} "
            f"device(s): {shown}"
        )
    return {d: cast(v) for d, v in zip(devices, value)}


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
        return usable_memory(device, gpu_memory_utilization) - activation_peak
    free_ram = available_host_memory()
    return int(min(free_ram * CPU_KV_FRACTION, CPU_KV_CAP) - activation_peak)


def num_blocks_for_budgets(
    budgets: dict[torch.device, int], block_bytes: dict[torch.device, int]
) -> int:
    """The shared block count: min over devices of budget / bytes per block there.

    block_bytes[d] is one block over every layer device d holds; a device without layers
    (0 bytes) does not limit the count.
    """
    counts = {d: max(budgets[d], 0) // block_bytes[d] for d in block_bytes if block_bytes[d] > 0}
    if not counts:
        raise ValueError("no device holds a layer")
    device = min(counts, key=counts.__getitem__)
    if counts[device] < 1:
        raise ValueError(
            f"no memory is left for the KV cache on {device}: its budget of "
            f"{max(budgets[device], 0)} bytes is less than one block ({block_bytes[device]} "
            f"bytes); lower the batch limits or give the cache more memory"
        )
    return counts[device]
