"""PagedAttentionInputMetadata: the per-step description of a flat batch of tokens.

A step computes a flat run of tokens from many sequences. Sequence i contributes the tokens
query_start_loc[i]:query_start_loc[i+1]; they are the *last* tokens of its context, whose
total length (cached tokens + this step's tokens) is seq_lens[i]. So query token j of
sequence i sits at position seq_lens[i] - q_len_i + j. Decode is q_len 1, a prompt chunk is
q_len > 1, and context already in the cache (an earlier chunk, a prefix-cache hit) is just
seq_lens[i] - q_len_i > 0.

KV cache of one layer: a tensor [2, num_blocks, block_size, num_kv_heads, head_dim]
(index 0 keys, 1 values). Token t of a sequence lives in block block_tables[i][t // block_size]
at offset t % block_size; its flat slot is block * block_size + offset.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, fields
from typing import TypeVar

import numpy as np
import torch

T = TypeVar("T")


@dataclass
class PagedAttentionInputMetadata:
    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64; -1 means "do not write"
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32, context length after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # Host copies of the small per-sequence lists, so the CPU path never syncs.
    query_lens_host: list[int]
    seq_lens_host: list[int]
    # Decode only: a fixed split count for the split-KV kernel. CUDA-graph replay sets it so
    # the launch grid never depends on this step's lengths; None lets the kernel choose.
    num_splits: int | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    def step_cache(self, key: Hashable, compute: Callable[[], T]) -> T:
        """Work that is the same for every layer of the step (the CPU attention plan, the
        rotary rows of the step's positions): the first layer that asks computes it, the
        others reuse it. Not a field, so `to()` leaves it behind with the old device."""
        cache = self.__dict__.setdefault("_step_cache", {})
        if key not in cache:
            cache[key] = compute()
        return cache[key]

    def to(self, device: torch.device | str) -> "PagedAttentionInputMetadata":
        """A copy whose tensors live on `device` (one copy per device per step)."""
        values = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                # Asynchronous only from (pinned) host memory; GPU -> GPU copies complete.
                v = v.to(device, non_blocking=v.device.type == "cpu")
            values[f.name] = v
        return PagedAttentionInputMetadata(**values)

    @classmethod
    def build(
        cls,
        positions: list[int],
        slot_mapping: list[int],
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        device: torch.device | str = "cpu",
        padded_tables: torch.Tensor | None = None,
    ) -> "PagedAttentionInputMetadata":
        """`padded_tables`: block_tables already padded (pad_block_tables), when the caller
        keeps them over several steps."""
        if padded_tables is None:
            padded_tables = pad_block_tables(block_tables)
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        device = torch.device(device)
        return cls(
            positions=host_to_device(positions, torch.int64, device),
            slot_mapping=host_to_device(slot_mapping, torch.int64, device),
            query_start_loc=host_to_device(starts, torch.int32, device),
            seq_lens=host_to_device(seq_lens, torch.int32, device),
            block_tables=host_to_device(padded_tables, torch.int32, device),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_lens_host=list(query_lens),
            seq_lens_host=list(seq_lens),
        )


_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32,
                 torch.float64: np.float64, torch.bool: np.bool_}


def host_to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list (or array) as a device tensor, through pinned memory without blocking the
    host."""
    if isinstance(values, list) and dtype in _NUMPY_DTYPES:
        # numpy converts a list of Python numbers ~4x faster than torch.as_tensor
        t = torch.from_numpy(np.array(values, dtype=_NUMPY_DTYPES[dtype]))
    else:
        t = torch.as_tensor(values, dtype=dtype)
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def pad_block_tables(block_tables: list[list[int]], num_rows: int | None = None) -> torch.Tensor:
    """[num_rows, longest table] int32 on the host, each table padded with block 0 (rows past
    the tables are all padding). Filled through numpy: far faster than torch.tensor on lists."""
    width = max((len(t) for t in block_tables), default=0)
    out = torch.zeros((num_rows or len(block_tables), width), dtype=torch.int32)
    rows = out.numpy()
    for i, table in enumerate(block_tables):
        rows[i, : len(table)] = table
    return out


def slots_for(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Flat cache slots of token positions [start, end) of a sequence with this block table."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]
