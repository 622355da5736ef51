"""CacheEngine: the paged KV cache of every layer, on that layer's device, plus a host pool
for swapped-out blocks, and the swap / copy-on-write operations on them.

Each device group has one tensor [num_layers, 2, num_blocks, block_size, kv_heads, head_dim];
a layer's cache is a view of it, so a swap or a copy is one gather per group, not per layer.
"""
from __future__ import annotations

import logging
import math
import mmap

import torch

from pagedllm.config import KV_CACHE_DTYPES, ModelConfig
from pagedllm.models.device_map import DeviceMap

logger = logging.getLogger(__name__)


def resolve_kv_cache_dtype(kind: str, devices: list[torch.device], dtype: torch.dtype
                           ) -> torch.dtype:
    """--kv-cache-dtype: auto is the model's dtype; fp8 / fp8_e4m3 store float8_e4m3fn
    (scale 1.0, kernels/triton_cache.py), which only the Triton kernels read."""
    if kind not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                         f"got {kind!r}")
    if kind == "auto":
        return dtype
    if any(d.type != "cuda" for d in devices):
        raise ValueError(f"--kv-cache-dtype {kind} needs CUDA: the CPU kernels read the KV "
                         "cache in the model's dtype; use --kv-cache-dtype auto")
    return torch.float8_e4m3fn


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype, num_layers: int) -> int:
    """Bytes one block takes over `num_layers` layers (keys and values)."""
    per_layer = 2 * block_size * config.num_key_value_heads * config.head_dim
    return per_layer * num_layers * torch.tensor([], dtype=dtype).element_size()


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
          pin_memory: bool = False) -> torch.Tensor:
    """torch.zeros, but in plain host memory the pages are zeroed by the OS on first use.

    torch.zeros writes every byte now, though a short session touches few blocks. An
    anonymous mmap is the kernel's zero pages, each faulted in when first written; it is
    not advised for transparent huge pages (numpy.zeros is), whose first touch stalls on
    zeroing and compacting 2 MiB at a time.

    Zeros, not garbage (torch.empty): the torch attention path reads whole blocks and masks
    the slots past a sequence's length, whose zero softmax weights times NaN garbage would
    be NaN. A slot once written holds a real key or value, so a freed block handed to
    another sequence keeps that invariant.
    """
    nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
    if device.type != "cpu" or pin_memory or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
    # Page aligned; the tensor holds a reference to the mapping, unmapped with it.
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)


class CacheEngine:
    def __init__(
        self,
        config: ModelConfig,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        dtype: torch.dtype,
        device_map: DeviceMap,
    ) -> None:
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.device_map = device_map
        shape = (2, block_size, config.num_key_value_heads, config.head_dim)
        # "gpu" blocks live on each group's own device (which may be the CPU); the swap pool
        # is host memory, pinned where it feeds a CUDA device.
        self.group_caches = [
            zeros((g.num_layers, shape[0], num_gpu_blocks, *shape[1:]), dtype, g.device)
            for g in device_map.groups
        ]
        self.group_swap = [
            zeros((g.num_layers, shape[0], num_cpu_blocks, *shape[1:]), dtype, torch.device("cpu"),
                  pin_memory=g.device.type == "cuda")
            for g in device_map.groups
        ]
        # Per layer, in layer order: what the model's forward takes.
        self.gpu_cache = [layer for cache in self.group_caches for layer in cache.unbind(0)]
        self.cpu_cache = [layer for pool in self.group_swap for layer in pool.unbind(0)]

    def group_bytes(self, index: int) -> int:
        """Bytes of the device-side KV cache of one group."""
        cache = self.group_caches[index]
        return cache.numel() * cache.element_size()

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        """(cpu block, gpu block) pairs: host pool -> device cache, every group."""
        self._move(self.group_swap, self.group_caches, mapping)

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        """(gpu block, cpu block) pairs: device cache -> host pool, every group."""
        self._move(self.group_caches, self.group_swap, mapping)

    def copy(self, mapping: list[tuple[int, int]]) -> None:
        """Copy-on-write: (src, dst) block pairs within the device cache, every group."""
        self._move(self.group_caches, self.group_caches, mapping)

    @staticmethod
    def _move(
        src: list[torch.Tensor], dst: list[torch.Tensor], mapping: list[tuple[int, int]]
    ) -> None:
        if not mapping:
            return
        src_ids = torch.tensor([s for s, _ in mapping])
        dst_ids = torch.tensor([d for _, d in mapping])
        on_device: dict[tuple[str, torch.device], torch.Tensor] = {}

        def ids(which: str, ids_: torch.Tensor, device: torch.device) -> torch.Tensor:
            if (which, device) not in on_device:
                on_device[which, device] = ids_.to(device)
            return on_device[which, device]

        for s, d in zip(src, dst):
            if s.element_size() == 1:  # FP8: moved as bytes (indexing need not know the type)
                s, d = s.view(torch.uint8), d.view(torch.uint8)
            # Gather on the source, one transfer, scatter on the destination. A copy to the
            # host is synchronous so the scatter reads complete data.
            blocks = s[:, :, ids("src", src_ids, s.device)]
            blocks = blocks.to(d.device, non_blocking=d.device.type == "cuda")
            d[:, :, ids("dst", dst_ids, d.device)] = blocks
