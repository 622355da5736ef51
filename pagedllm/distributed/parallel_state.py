"""Which tensor-parallel rank this process is, and its process groups.

One module-level state, set once per process by `init_tensor_parallel` (rank 0 from the
engine, other ranks from their worker loop) and read by the sharded layers when a model is
built. Until then the process is rank 0 of 1 and every collective is a no-op.

Two groups, as in vLLM: `device_group` carries the activations' all-reduces and all-gathers
(NCCL on CUDA, gloo on the CPU) under the collective timeout; `cpu_group` (always gloo)
carries the step batches from rank 0 and small host values (the KV block count). Its timeout
is long, because a worker waits on it for the next step while the server is idle.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

from pagedllm.config import ModelConfig

# A worker rank may wait this long for rank 0's next step (an idle server); a dead rank 0
# closes its sockets, which ends the wait at once.
IDLE_TIMEOUT_S = 7 * 24 * 3600.0


@dataclass
class ParallelState:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device_group: Any = None
    cpu_group: Any = None
    timeout_s: float = 0.0


_state = ParallelState()


def tp_rank() -> int:
    return _state.rank


def tp_size() -> int:
    return _state.world_size


def state() -> ParallelState:
    return _state


def is_initialized() -> bool:
    """A process group exists (also at world size 1 under torchrun, so one GPU runs the
    collectives for real)."""
    return _state.device_group is not None


def init_tensor_parallel(world_size: int, rank: int, local_rank: int, init_method: str,
                         backend: str, timeout_s: float) -> None:
    """Join the process group of `world_size` ranks (init_method: "tcp://host:port" or
    "env://", as torchrun sets it) and make the two groups."""
    global _state
    import torch.distributed as dist

    if is_initialized():
        raise RuntimeError("tensor parallelism is already initialized in this process: "
                           "shut the previous engine down first (llm.engine.shutdown())")
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=init_method, world_size=world_size,
                            rank=rank, timeout=timeout)
    ranks = list(range(world_size))
    device_group = dist.group.WORLD
    cpu_group = dist.new_group(ranks, backend="gloo",
                               timeout=datetime.timedelta(seconds=IDLE_TIMEOUT_S))
    _state = ParallelState(rank, world_size, local_rank, device_group, cpu_group, timeout_s)
    if backend == "nccl":
        # Set NCCL's communicator up now with one all-reduce: a first collective inside a
        # CUDA graph capture could not.
        import torch

        warm = torch.zeros(1, device=torch.device("cuda", local_rank))
        dist.all_reduce(warm, group=device_group)
        torch.cuda.synchronize()


def destroy_tensor_parallel() -> None:
    global _state
    import torch.distributed as dist

    if is_initialized() and dist.is_initialized():
        dist.destroy_process_group()
    _state = ParallelState()


def torchrun_env() -> tuple[int, int, int] | None:
    """(world size, rank, local rank) when this process was started by torchrun."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and "LOCAL_RANK" not in os.environ:
        return None
    return (int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"]),
            int(os.environ["LOCAL_RANK"]))


# ------------------------------------------------------------------ sharding arithmetic
def check_tp_size(config: ModelConfig, size: int) -> None:
    """A clear error when the model cannot be split over `size` ranks."""
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if heads % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the model's {heads} "
                         f"attention heads")
    if kv % size and size % kv:
        raise ValueError(f"tensor_parallel_size {size} and the model's {kv} key-value heads: "
                         f"one must divide the other (KV heads are split over ranks, or "
                         f"replicated when there are fewer than ranks)")
    if config.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the model's MLP size "
                         f"{config.intermediate_size}")


def num_kv_shards(num_kv_heads: int, size: int) -> int:
    """Distinct KV-head shards: one per rank, or one per head when heads are replicated."""
    return size if num_kv_heads >= size else num_kv_heads


def local_num_heads(config: ModelConfig, size: int | None = None) -> tuple[int, int]:
    """(attention heads, KV heads) each rank holds."""
    size = tp_size() if size is None else size
    kv = config.num_key_value_heads
    return config.num_attention_heads // size, kv // num_kv_shards(kv, size)


def shard_range(full: int, num_shards: int, rank: int | None = None,
                size: int | None = None) -> tuple[int, int]:
    """(start, length) of this rank's shard when `full` rows split into `num_shards` equal
    shards over `size` ranks (num_shards divides size: neighbouring ranks share a shard)."""
    rank = tp_rank() if rank is None else rank
    size = tp_size() if size is None else size
    length = full // num_shards
    return rank * num_shards // size * length, length


def vocab_range(vocab_size: int, rank: int | None = None,
                size: int | None = None) -> tuple[int, int]:
    """(first token id, padded rows) of this rank's slice of a vocabulary split over ranks;
    the last rank's slice is padded past vocab_size."""
    rank = tp_rank() if rank is None else rank
    size = tp_size() if size is None else size
    per_rank = -(-vocab_size // size)
    return rank * per_rank, per_rank
