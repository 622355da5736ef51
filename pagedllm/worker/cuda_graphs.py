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
- the graphs of one device allocate from one shared memory pool. Graphs never run
  concurrently, and each one's output is read before the next replay, so they can share it;
- with a device map, each device group is its own graph (see DecodeCUDAGraphs);
- with LoRA adapters attached, a second set of graphs runs the projections' LoRA kernels
  over static sorted-rows and segment buffers (layers/lora.StaticLoRARows) the step's
  per-row slots are copied into; it replays only for steps with adapter rows, so base-only
  steps keep the base graphs. Both sets share the memory pool. PAGEDLLM_LORA_GRAPHS=0
  leaves the second set out (steps with adapter rows then run eager).

Only the model's forward is captured; logits are computed for the real rows only. In
multi-step decoding the input ids of a step after the first come from the device.
"""
from __future__ import annotations

import bisect
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.kernels.metadata import (
    PagedAttentionInputMetadata, host_to_device, pad_block_tables,
)
from pagedllm.layers.lora import LoRARows, StaticLoRARows, lora_rows
from pagedllm.models.device_map import DeviceGroup, DeviceMap

_HOST = torch.device("cpu")
logger = logging.getLogger(__name__)

# Graphs up to the GPU's default max_num_seqs (1,024): a step with more sequences than the
# largest graph launches its ~200 kernels one by one from Python, and at 513-1,024 sequences
# those launches, not the GPU, set the step's pace (the A/B against a cap of 512 is in
# docs/benchmarks.md). Each graph costs memory and capture time at start-up;
# PAGEDLLM_MAX_GRAPH_BATCH moves the cap (gpu-check's sharegpt-graphs512).
MAX_GRAPH_BATCH_SIZE = int(os.environ.get("PAGEDLLM_MAX_GRAPH_BATCH", "1024"))
if MAX_GRAPH_BATCH_SIZE < 1:
    raise ValueError(f"PAGEDLLM_MAX_GRAPH_BATCH must be at least 1, got {MAX_GRAPH_BATCH_SIZE}")
# Device memory of a captured graph itself (its nodes and launch state), beyond the pool its
# tensors come from, which grows with the layers it launches (docs/benchmarks.md).
GRAPH_BYTES_PER_LAYER = 256 << 10
PAD_SLOT = -1  # reshape_and_cache skips it
PAD_SEQ_LEN = 1  # a padding row attends to one key of block 0
LORA_GRAPHS = os.environ.get("PAGEDLLM_LORA_GRAPHS", "1") != "0"


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
    """Graphs need every layer on CUDA (one graph per device group; CPU layers are eager)."""
    return not enforce_eager and all(d.type == "cuda" for d in layer_devices)


@dataclass
class DecodeBatch:
    """One decode step's inputs padded to a bucket: host tensors ready to copy."""

    input_ids: torch.Tensor  # [bucket] int64, padding 0
    positions: torch.Tensor  # [bucket] int64, padding 0
    slot_mapping: torch.Tensor  # [bucket] int64, padding PAD_SLOT
    seq_lens: torch.Tensor  # [bucket] int32, padding PAD_SEQ_LEN
    block_tables: torch.Tensor  # [bucket, widest table] int32, padding 0
    num_seqs: int  # the real rows

    def pinned(self) -> "DecodeBatch":
        """Page-locked copies, so the copies to the device do not block the host."""
        tables = self.block_tables
        return DecodeBatch(self.input_ids.pin_memory(), self.positions.pin_memory(),
                           self.slot_mapping.pin_memory(), self.seq_lens.pin_memory(),
                           tables if tables.is_pinned() else tables.pin_memory(), self.num_seqs)


def pad_decode_batch(
    input_ids: list[int],
    positions: list[int],
    slot_mapping: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    bucket: int,
    padded_tables: torch.Tensor | None = None,
) -> DecodeBatch:
    """The step's inputs padded to `bucket` rows; `padded_tables`: block_tables already
    padded to it."""
    n = len(input_ids)
    if not n == len(positions) == len(slot_mapping) == len(seq_lens) == len(block_tables):
        raise ValueError(
            f"decode inputs disagree on the batch size: {n} ids, {len(positions)} positions, "
            f"{len(slot_mapping)} slots, {len(seq_lens)} seq_lens, {len(block_tables)} tables"
        )
    if n > bucket:
        raise ValueError(f"a batch of {n} sequences does not fit a graph of {bucket}")
    pad = bucket - n
    return DecodeBatch(
        input_ids=host_to_device(input_ids + [0] * pad, torch.int64, _HOST),
        positions=host_to_device(positions + [0] * pad, torch.int64, _HOST),
        slot_mapping=host_to_device(slot_mapping + [PAD_SLOT] * pad, torch.int64, _HOST),
        seq_lens=host_to_device(seq_lens + [PAD_SEQ_LEN] * pad, torch.int32, _HOST),
        block_tables=pad_block_tables(block_tables, bucket) if padded_tables is None
        else padded_tables,
        num_seqs=n,
    )


class StaticMetadata:
    """One device's static metadata buffers, for the largest bucket (sliced per bucket)."""

    def __init__(self, device: torch.device, max_batch_size: int, table_width: int) -> None:
        n = max_batch_size
        i64 = dict(dtype=torch.int64, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        self.positions = torch.zeros(n, **i64)
        self.slot_mapping = torch.full((n,), PAD_SLOT, **i64)
        self.seq_lens = torch.full((n,), PAD_SEQ_LEN, **i32)
        self.query_start_loc = torch.arange(n + 1, **i32)  # one query token per sequence
        self.block_tables = torch.zeros((n, table_width), **i32)
        # The host tables last copied in: the steps of a decode window share one tensor
        # (FlatBatch.padded_block_tables), copied once.
        self.loaded_tables: torch.Tensor | None = None

    def load(self, batch: "DecodeBatch", bucket: int) -> None:
        pin = self.positions.is_cuda
        width = batch.block_tables.shape[1]
        copies = [
            (self.positions[:bucket], batch.positions),
            (self.slot_mapping[:bucket], batch.slot_mapping),
            (self.seq_lens[:bucket], batch.seq_lens),
        ]
        if batch.block_tables is not self.loaded_tables:
            copies.append((self.block_tables[:bucket, :width], batch.block_tables))
            self.loaded_tables = batch.block_tables
        for dst, src in copies:
            dst.copy_(src, non_blocking=pin)


class DecodeCUDAGraphs:
    """Static input buffers, one captured graph per (bucket, device group), and their replay.

    With a device map, each group's layers are one graph on that group's device; between two
    replays the state (hidden, residual) is copied into the next group's static buffers, the
    only step a map adds. Metadata buffers exist once per distinct device. `lora_slots` > 0:
    also capture every bucket with LoRA on (graphs keyed by (bucket, group, lora))."""

    def __init__(
        self,
        model: nn.Module,
        device_map: DeviceMap,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        lora_slots: int = 0,
    ) -> None:
        self.model = model
        self.device_map = device_map
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_batch_size = self.sizes[-1]
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.table_width = math.ceil(max_model_len / block_size)
        self.input_ids = torch.zeros(self.max_batch_size, dtype=torch.int64,
                                     device=device_map.input_device)
        self.static_metadata = {
            d: StaticMetadata(d, self.max_batch_size, self.table_width) for d in device_map.devices
        }
        self.lora = StaticLoRARows(device_map.devices, self.max_batch_size, lora_slots) \
            if lora_slots else None
        self.modes = (False, True) if self.lora is not None else (False,)  # LoRA off / on
        # Group index -> the static state a group > 0 starts from (made at the first forward).
        self.states: dict[int, tuple] = {}
        # (bucket, group, lora)
        self.graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int, bool], object] = {}
        self.graph_memory = 0  # bytes, measured at capture
        self.num_replays = 0
        self.num_lora_replays = 0  # of which with LoRA on

    def num_splits(self, batch_size: int, device: torch.device | None = None) -> int:
        from pagedllm.kernels.triton_attention import choose_num_splits

        device = device or self.device_map.input_device
        return choose_num_splits(self.max_model_len, batch_size, self.num_kv_heads, device)

    def metadata(self, batch_size: int, device: torch.device | None = None
                 ) -> PagedAttentionInputMetadata:
        """Views of one device's static buffers for one bucket (host lists only feed shape
        checks)."""
        b = batch_size
        device = device or self.device_map.input_device
        buf = self.static_metadata[device]
        return PagedAttentionInputMetadata(
            positions=buf.positions[:b],
            slot_mapping=buf.slot_mapping[:b],
            query_start_loc=buf.query_start_loc[: b + 1],
            seq_lens=buf.seq_lens[:b],
            block_tables=buf.block_tables[:b],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_lens_host=[1] * b,
            seq_lens_host=[self.max_model_len] * b,
            num_splits=self.num_splits(b, device),
        )

    # ------------------------------------------------------------------ stages
    def _stage(self, g: int, batch_size: int, kv_caches: list[torch.Tensor]):
        """What group g's graph replays: its layers over its static inputs; the last group
        ends with the final norm and returns the hidden states. Runs with the group's device
        current (DeviceMap.walk, or the capture)."""
        group = self.device_map.groups[g]
        b = batch_size
        if g == 0:
            state = self.model.embed(self.input_ids[:b])
        else:
            state = tuple(None if t is None else t[:b] for t in self.states[g])
        state = self.model.run_layers(group.layers, state, kv_caches,
                                      self.metadata(b, group.device))
        if g == len(self.device_map.groups) - 1:
            return self.model.final_norm(state)
        return state

    def _load_state(self, state: tuple, group: DeviceGroup, batch_size: int) -> None:
        """Copy the previous group's output state into `group`'s static buffers (across
        devices: the copy orders both devices' streams). The walk's boundary step: the next
        stage reads those buffers."""
        g = group.index
        if g not in self.states:
            device = self.device_map.groups[g].device
            self.states[g] = tuple(
                None if t is None else torch.zeros((self.max_batch_size, *t.shape[1:]),
                                                   dtype=t.dtype, device=device)
                for t in state
            )
        for dst, src in zip(self.states[g], state):
            if src is not None:
                dst[:batch_size].copy_(src)

    def _lora(self, lora: bool, batch_size: int):
        """The LoRA context a graph of `batch_size` rows runs in (off: base model only)."""
        if lora:
            self.lora.num_rows = batch_size
        return lora_rows(self.lora if lora else None)

    def _forward(self, batch_size: int, kv_caches: list[torch.Tensor],
                 lora: bool = False) -> torch.Tensor:
        """Every stage eagerly over the static buffers (warm-up, and the CPU tests)."""
        with self._lora(lora, batch_size):
            return self.device_map.walk(
                None, lambda group, _: self._stage(group.index, batch_size, kv_caches),
                lambda state, group: self._load_state(state, group, batch_size),
            )

    @torch.inference_mode()
    def profile_run(self) -> None:
        """One eager decode forward at the largest bucket, over a one-block cache per layer
        (the static buffers write nothing and read only block 0): its activation peak is
        about what the graphs' shared pool will hold. For memory profiling, before the KV
        cache exists."""
        shape = (2, 1, self.block_size, self.num_kv_heads, self.head_dim)
        caches = [torch.zeros(shape, dtype=self.dtype, device=d)
                  for d in self.device_map.layer_devices]
        self._forward(self.max_batch_size, caches)

    def memory_reserve(self, device: torch.device, pool_peak: int) -> int:
        """Bytes to keep free on `device` for the graphs: its share of the pool (the
        activation peak of an eager decode at the largest bucket, profiled) plus the memory
        of every graph of its layers."""
        layers = self.device_map.layers_on(device)
        return pool_peak + GRAPH_BYTES_PER_LAYER * layers * len(self.sizes) * len(self.modes)

    @torch.inference_mode()
    def capture(self, kv_caches: list[torch.Tensor]) -> None:
        """Capture every bucket, largest first, each device's graphs into one memory pool."""
        start = time.perf_counter()
        devices = self.device_map.devices
        for d in devices:
            torch.cuda.synchronize(d)
        free_before = sum(torch.cuda.mem_get_info(d)[0] for d in devices)
        pools: dict[torch.device, object] = {}
        streams = {d: torch.cuda.Stream(device=d) for d in devices}
        for b in reversed(self.sizes):
            for lora in self.modes:
                # Eager warm-up: compiles this launch shape's kernels and builds lazily made
                # per-device tables, neither of which may happen inside a capture.
                self._forward(b, kv_caches, lora)
                for g, group in enumerate(self.device_map.groups):
                    d = group.device
                    torch.cuda.synchronize(d)
                    graph = torch.cuda.CUDAGraph()
                    with self._lora(lora, b), torch.cuda.device(d), torch.cuda.graph(
                            graph, pool=pools.get(d), stream=streams[d]):
                        self.outputs[b, g, lora] = self._stage(g, b, kv_caches)
                    pools.setdefault(d, graph.pool())
                    self.graphs[b, g, lora] = graph
        for d in devices:
            torch.cuda.synchronize(d)
        self.graph_memory = free_before - sum(torch.cuda.mem_get_info(d)[0] for d in devices)
        logger.info(
            "CUDA graphs: captured %d decode batch sizes (1..%d) x %d device group(s) x %d "
            "(LoRA off/on) in %.1f s, using %.1f MiB", len(self.sizes), self.max_batch_size,
            len(self.device_map.groups), len(self.modes), time.perf_counter() - start,
            self.graph_memory / (1 << 20),
        )

    def release(self) -> None:
        """Destroy the graphs now. A graph that captured an NCCL all-reduce holds a reference
        on the communicator until it is destroyed, and destroying the process group waits
        for those references (pytorch/pytorch#115388): release the graphs first."""
        for d in self.device_map.devices:
            torch.cuda.synchronize(d)
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()

    def can_run(self, max_query_len: int, num_tokens: int, num_seqs: int,
                lora: bool = False) -> bool:
        """A decode step fits a bucket (`lora`: the step has adapter rows, which needs the
        LoRA set)."""
        return bool(self.graphs) and (not lora or self.lora is not None) and fits_decode_graph(
            max_query_len, num_tokens, num_seqs, self.max_batch_size
        )

    def load_inputs(
        self,
        input_ids: list[int] | torch.Tensor,
        positions: list[int],
        slot_mapping: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        padded_tables: Callable[[int, bool], torch.Tensor] | None = None,
        lora_slots: torch.Tensor | None = None,
    ) -> int:
        """Copy a decode step's inputs, padded, into the static buffers of every device;
        returns the bucket. `padded_tables(bucket, pin)`: the block tables padded to the
        bucket, the same tensor for each step that shares them (copied in only once).
        `lora_slots`: the rows' adapter slots (host int64), into the LoRA set's buffers."""
        bucket = choose_bucket(self.sizes, len(input_ids))
        if bucket is None:
            raise ValueError(
                f"no CUDA graph holds a batch of {len(input_ids)} (largest {self.max_batch_size})"
            )
        on_device = isinstance(input_ids, torch.Tensor)
        host_ids = [0] * len(input_ids) if on_device else input_ids
        pin = self.input_ids.is_cuda
        tables = None if padded_tables is None else padded_tables(bucket, pin)
        batch = pad_decode_batch(host_ids, positions, slot_mapping, seq_lens, block_tables, bucket,
                                 tables)
        width = batch.block_tables.shape[1]
        if width > self.table_width:
            raise ValueError(
                f"a block table of {width} blocks is longer than max_model_len allows "
                f"({self.table_width} blocks)"
            )
        if pin:
            batch = batch.pinned()
        if on_device:  # the last step's samples (multi-step); padding rows keep old ids
            self.input_ids[: len(input_ids)].copy_(input_ids)
        else:
            self.input_ids[:bucket].copy_(batch.input_ids, non_blocking=self.input_ids.is_cuda)
        for buffers in self.static_metadata.values():
            buffers.load(batch, bucket)
        if lora_slots is not None:
            if len(lora_slots) != len(input_ids):
                raise ValueError(f"{len(lora_slots)} LoRA slots for {len(input_ids)} rows")
            self.lora.load(lora_slots, bucket)
        return bucket

    def _replay(self, bucket: int, g: int, lora: bool):
        self.graphs[bucket, g, lora].replay()
        return self.outputs[bucket, g, lora]

    def run(
        self,
        input_ids: list[int] | torch.Tensor,
        positions: list[int],
        slot_mapping: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        padded_tables: Callable[[int, bool], torch.Tensor] | None = None,
        lora: LoRARows | None = None,
    ) -> torch.Tensor:
        """Load this step's inputs, replay its bucket's graphs group by group (the LoRA set
        when `lora` has adapter rows), return [num_seqs, hidden]."""
        on = lora is not None and lora.has_adapters
        bucket = self.load_inputs(input_ids, positions, slot_mapping, seq_lens, block_tables,
                                  padded_tables, lora.slots if on else None)
        out = self.device_map.walk(
            None, lambda group, _: self._replay(bucket, group.index, on),
            lambda state, group: self._load_state(state, group, bucket),
        )
        self.num_replays += 1
        self.num_lora_replays += on
        return out[: len(input_ids)]
