"""CacheEngine: the paged KV tensors of every layer, on that layer's device, plus a host
pool for swapped-out blocks, and the swap / copy-on-write operations on them."""
from __future__ import annotations

import logging

import torch

from pagedllm.config import ModelConfig

logger = logging.getLogger(__name__)


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype, num_layers: int) -> int:
    """Bytes one block takes over `num_layers` layers (keys and values)."""
    per_layer = 2 * block_size * config.num_key_value_heads * config.head_dim
    return per_layer * num_layers * torch.tensor([], dtype=dtype).element_size()


class CacheEngine:
    def __init__(
        self,
        config: ModelConfig,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        dtype: torch.dtype,
        layer_devices: list[torch.device],
    ) -> None:
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.layer_devices = layer_devices
        shape = (block_size, config.num_key_value_heads, config.head_dim)
        # "gpu" blocks live on each layer's own device (which may be the CPU).
        self.gpu_cache = [
            torch.zeros((2, num_gpu_blocks, *shape), dtype=dtype, device=d) for d in layer_devices
        ]
        pin = torch.cuda.is_available() and any(d.type == "cuda" for d in layer_devices)
        self.cpu_cache = [
            torch.zeros((2, num_cpu_blocks, *shape), dtype=dtype, pin_memory=pin)
            for _ in layer_devices
        ]

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        """(cpu block, gpu block) pairs: host pool -> device cache, every layer."""
        self._move(self.cpu_cache, self.gpu_cache, mapping)

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        """(gpu block, cpu block) pairs: device cache -> host pool, every layer."""
        self._move(self.gpu_cache, self.cpu_cache, mapping)

    def copy(self, mapping: list[tuple[int, int]]) -> None:
        """Copy-on-write: (src, dst) block pairs within the device cache, every layer."""
        self._move(self.gpu_cache, self.gpu_cache, mapping)

    @staticmethod
    def _move(src: list[torch.Tensor], dst: list[torch.Tensor], mapping: list[tuple[int, int]]) -> None:
        if not mapping:
            return
        src_ids = torch.tensor([s for s, _ in mapping])
        dst_ids = torch.tensor([d for _, d in mapping])
        for s, d in zip(src, dst):
            blocks = s[:, src_ids.to(s.device)].to(d.device, non_blocking=True)
            d[:, dst_ids.to(d.device)] = blocks
