"""CUDA graphs for decode steps.

A decode step (every sequence brings one new token) launches a few hundred small kernels
whose host-side launch cost dwarfs their run time at small batch sizes. We capture one graph
per batch-size bucket, after the KV cache exists, and replay the smallest bucket that holds
the step's batch. A graph replays fixed pointers and fixed launch grids, so:

- its inputs live in static device buffers, sliced per bucket; each step copies its inputs
  into them, padding the rows past the real batch (slot -1: write nothing; context length 1
  over block 0: a cheap, finite read);
- attention gets a fixed split count per bucket (chosen for max_model_len), so no grid
  depends on this step's lengths;
- every graph allocates from one shared memory pool. Graphs never run concurrently, and each
  one's output is read before the next replay, so they can share it.

Only the model's forward is captured; logits are computed for the real rows only.
"""
from __future__ import annotations

import bisect
import logging
import math
import time
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.layers.metadata import PagedAttentionInputMetadata

logger = logging.getLogger(__name__)

# Graphs for larger batches cost memory and capture time and save little: at that size the
# GPU work per step hides the launch overhead.
MAX_GRAPH_BATCH_SIZE = 512
# Device memory of a captured graph itself (its nodes and launch state), beyond the pool its
# tensors come from: about 7 MiB per graph of a 28-32 layer model, measured on an H200.
GRAPH_BYTES_PER_LAYER = 256 << 10
PAD_SLOT = -1  # reshape_and_cache skips it
PAD_SEQ_LEN = 1  # a padding row attends to one key of block 0


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The captured batch sizes: 1, 2, 4, 8, 16, 24, 32, then every 16, up to max_num_seqs
    (capped at MAX_GRAPH_BATCH_SIZE), which is always the last bucket."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    largest = min(max_num_seqs, MAX_GRAPH_BATCH_SIZE)
    sizes = {b for b in (1, 2, 4, 8, 16, 24, 32) if b < largest}
    sizes.update(range(48, largest, 16))
    sizes.add(largest)
    return sorted(sizes)


def choose_bucket(sizes: list[int], batch_size: int) -> int | None:
    """The smallest captured size >= batch_size; None when the batch is larger than all."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    i = bisect.bisect_left(sizes, batch_size)
    return sizes[i] if i < len(sizes) else None


def fits_decode_graph(max_query_len: int, num_tokens: int, num_seqs: int,
                      max_batch_size: int) -> bool:
    """A decode-only step (one query token per sequence) no larger than the largest bucket."""
    return max_query_len == 1 and num_tokens == num_seqs and 1 <= num_seqs <= max_batch_size


def graphs_supported(layer_devices: list[torch.device], enforce_eager: bool) -> bool:
    """Graphs need the whole model on one CUDA device (a device map's cross-device copies and
    CPU layers are not captured)."""
    devices = set(layer_devices)
    return not enforce_eager and len(devices) == 1 and next(iter(devices)).type == "cuda"


@dataclass
class DecodeBatch:
    """One decode step's inputs padded to a bucket: host tensors ready to copy."""

    input_ids: torch.Tensor  # [bucket] int64, padding 0
    positions: torch.Tensor  # [bucket] int64, padding 0
    slot_mapping: torch.Tensor  # [bucket] int64, padding PAD_SLOT
    seq_lens: torch.Tensor  # [bucket] int32, padding PAD_SEQ_LEN
    block_tables: torch.Tensor  # [bucket, widest table] int32, padding 0
    num_seqs: int  # the real rows


def pad_decode_batch(
    input_ids: list[int],
    positions: list[int],
    slot_mapping: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    bucket: int,
) -> DecodeBatch:
    n = len(input_ids)
    if not n == len(positions) == len(slot_mapping) == len(seq_lens) == len(block_tables):
        raise ValueError(
            f"decode inputs disagree on the batch size: {n} ids, {len(positions)} positions, "
            f"{len(slot_mapping)} slots, {len(seq_lens)} seq_lens, {len(block_tables)} tables"
        )
    if n > bucket:
        raise ValueError(f"a batch of {n} sequences does not fit a graph of {bucket}")
    pad = bucket - n
    width = max(len(t) for t in block_tables) if block_tables else 0
    tables = [t + [0] * (width - len(t)) for t in block_tables] + [[0] * width] * pad
    return DecodeBatch(
        input_ids=torch.tensor(input_ids + [0] * pad, dtype=torch.int64),
        positions=torch.tensor(positions + [0] * pad, dtype=torch.int64),
        slot_mapping=torch.tensor(slot_mapping + [PAD_SLOT] * pad, dtype=torch.int64),
        seq_lens=torch.tensor(seq_lens + [PAD_SEQ_LEN] * pad, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32).reshape(bucket, width),
        num_seqs=n,
    )


class DecodeCUDAGraphs:
    """Static input buffers, one captured graph per bucket, and their replay."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> None:
        self.model = model
        self.device = device
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_batch_size = self.sizes[-1]
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.table_width = math.ceil(max_model_len / block_size)
        n = self.max_batch_size
        i64 = dict(dtype=torch.int64, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.slot_mapping = torch.full((n,), PAD_SLOT, **i64)
        self.seq_lens = torch.full((n,), PAD_SEQ_LEN, **i32)
        self.query_start_loc = torch.arange(n + 1, **i32)  # one query token per sequence
        self.block_tables = torch.zeros((n, self.table_width), **i32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.graph_memory = 0  # bytes, measured at capture
        self.num_replays = 0

    def num_splits(self, batch_size: int) -> int:
        from pagedllm.kernels.triton_attention import choose_num_splits

        return choose_num_splits(self.max_model_len, batch_size, self.num_kv_heads, self.device)

    def metadata(self, batch_size: int) -> PagedAttentionInputMetadata:
        """Views of the static buffers for one bucket (host lists only feed shape checks)."""
        b = batch_size
        return PagedAttentionInputMetadata(
            positions=self.positions[:b],
            slot_mapping=self.slot_mapping[:b],
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_lens_host=[1] * b,
            seq_lens_host=[self.max_model_len] * b,
            num_splits=self.num_splits(b),
        )

    def _forward(self, batch_size: int, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        meta = self.metadata(batch_size)
        return self.model(self.input_ids[:batch_size], kv_caches, {self.device: meta})

    @torch.inference_mode()
    def profile_run(self) -> None:
        """One eager decode forward at the largest bucket, over a one-block cache (the static
        buffers write nothing and read only block 0): its activation peak is about what the
        graphs' shared pool will hold. For memory profiling, before the KV cache exists."""
        shape = (2, 1, self.block_size, self.num_kv_heads, self.head_dim)
        caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.model.layers]
        self._forward(self.max_batch_size, caches)

    def memory_reserve(self, pool_peak: int) -> int:
        """Bytes to keep free for the graphs: the shared pool (the activation peak of an eager
        decode at the largest bucket, profiled) plus every graph's own memory."""
        return pool_peak + GRAPH_BYTES_PER_LAYER * len(self.model.layers) * len(self.sizes)

    @torch.inference_mode()
    def capture(self, kv_caches: list[torch.Tensor]) -> None:
        """Capture every bucket, largest first, into one memory pool."""
        start = time.perf_counter()
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = None
        for b in reversed(self.sizes):
            # Eager warm-up: compiles this launch shape's kernels and builds lazily made
            # per-device tables, neither of which may happen inside a capture.
            self._forward(b, kv_caches)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self._forward(b, kv_caches)
            pool = graph.pool() if pool is None else pool
            self.graphs[b] = graph
        torch.cuda.synchronize(self.device)
        self.graph_memory = free_before - torch.cuda.mem_get_info(self.device)[0]
        logger.info(
            "CUDA graphs: captured %d decode batch sizes (1..%d) in %.1f s, using %.1f MiB",
            len(self.sizes), self.max_batch_size, time.perf_counter() - start,
            self.graph_memory / (1 << 20),
        )

    def can_run(self, max_query_len: int, num_tokens: int, num_seqs: int) -> bool:
        return bool(self.graphs) and fits_decode_graph(
            max_query_len, num_tokens, num_seqs, self.max_batch_size
        )

    def load_inputs(
        self,
        input_ids: list[int],
        positions: list[int],
        slot_mapping: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
    ) -> int:
        """Copy a decode step's inputs, padded, into the static buffers; returns the bucket."""
        bucket = choose_bucket(self.sizes, len(input_ids))
        if bucket is None:
            raise ValueError(
                f"no CUDA graph holds a batch of {len(input_ids)} (largest {self.max_batch_size})"
            )
        batch = pad_decode_batch(input_ids, positions, slot_mapping, seq_lens, block_tables, bucket)
        width = batch.block_tables.shape[1]
        if width > self.table_width:
            raise ValueError(
                f"a block table of {width} blocks is longer than max_model_len allows "
                f"({self.table_width} blocks)"
            )
        pin = self.device.type == "cuda"
        for dst, src in (
            (self.input_ids[:bucket], batch.input_ids),
            (self.positions[:bucket], batch.positions),
            (self.slot_mapping[:bucket], batch.slot_mapping),
            (self.seq_lens[:bucket], batch.seq_lens),
            (self.block_tables[:bucket, :width], batch.block_tables),
        ):
            dst.copy_(src.pin_memory() if pin else src, non_blocking=pin)
        return bucket

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        slot_mapping: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
    ) -> torch.Tensor:
        """Load this step's inputs, replay its bucket's graph, return [num_seqs, hidden]."""
        bucket = self.load_inputs(input_ids, positions, slot_mapping, seq_lens, block_tables)
        self.graphs[bucket].replay()
        self.num_replays += 1
        return self.outputs[bucket][: len(input_ids)]
