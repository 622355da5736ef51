"""The collectives of tensor parallelism; each is the identity on one rank."""
from __future__ import annotations

from typing import Any

import torch

from pagedllm.distributed import parallel_state as ps


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place (row-parallel linears, the vocab-parallel embedding)."""
    if ps.is_initialized():
        import torch.distributed as dist

        dist.all_reduce(x, group=ps.state().device_group)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim`, in rank order (the vocab-parallel logits)."""
    size = ps.tp_size()
    if not ps.is_initialized():
        return x
    import torch.distributed as dist

    x = x.contiguous()
    out = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x, group=ps.state().device_group)
    return torch.cat(out.view(size, *x.shape).unbind(0), dim=dim)


def broadcast_object(obj: Any = None, src: int = 0) -> Any:
    """Rank `src`'s picklable object, on every rank (the step batches), over the CPU group."""
    if not ps.is_initialized():
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src, group=ps.state().cpu_group)
    return box[0]


def all_reduce_min(value: int) -> int:
    """The smallest of the ranks' values (the KV-cache block count every rank can hold)."""
    if not ps.is_initialized():
        return value
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=ps.state().cpu_group)
    return int(t.item())
