"""Megatron-style sharded layers for tensor parallelism (pagedllm/distributed/).

- ColumnParallelLinear: the weight's output rows are split over ranks; each rank computes
  its slice of the output, no communication. A fused weight (q|k|v, gate|up) is split part
  by part, so each rank holds [q_r | k_r | v_r]. A part with fewer heads than ranks (KV heads
  when num_key_value_heads < tensor_parallel_size) is replicated: neighbouring ranks hold
  the same head, as in vLLM.
- RowParallelLinear: the weight's input columns are split; each rank multiplies its slice of
  the input and one all-reduce sums the partial outputs (the bias is added once, after it).
- VocabParallelEmbedding / ParallelLMHead: the vocabulary's rows are split (padded to a
  multiple of the rank count); the embedding all-reduces the rows each rank holds, the LM
  head's logits are all-gathered (models/base.py, compute_logits).

With one rank every layer is its unsharded self: same parameter shapes, same forward.
Each layer knows how to cut its shard from a full tensor: `shard_weight(name, tensor, part)`
for a checkpoint tensor (one part of a fused weight, or the whole of an unfused one) and
`full_shape(name)` for the dummy loader, which draws the full tensor and cuts it the same
way, so random weights are the same at every tensor_parallel_size.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed import parallel_state as ps
from pagedllm.distributed.communication import all_reduce
from pagedllm.layers.linear import Linear, linear


class ColumnParallelLinear(Linear):
    def __init__(self, in_features: int, part_sizes: list[int], bias: bool = True,
                 part_shards: list[int] | None = None) -> None:
        """part_sizes: the full output rows of each fused part; part_shards: into how many
        distinct shards each part splits (default: one per rank)."""
        size = ps.tp_size()
        self.rank, self.tp = ps.tp_rank(), size
        self.part_sizes = list(part_sizes)
        self.part_shards = list(part_shards or [size] * len(part_sizes))
        for full, shards in zip(self.part_sizes, self.part_shards):
            if full % shards or size % shards:
                raise ValueError(f"cannot split {full} output rows into {shards} shards over "
                                 f"{size} ranks")
        self.local_sizes = [full // shards for full, shards in zip(self.part_sizes,
                                                                     self.part_shards)]
        super().__init__(in_features, sum(self.local_sizes), bias=bias)

    def full_shape(self, name: str) -> tuple[int, ...]:
        rows = sum(self.part_sizes)
        return (rows, self.in_features) if name == "weight" else (rows,)

    def local_range(self, part: int) -> tuple[int, int]:
        """Where part `part` sits in this rank's (fused) parameter."""
        return sum(self.local_sizes[:part]), self.local_sizes[part]

    def shard_weight(self, name: str, tensor: torch.Tensor, part: int | None) -> torch.Tensor:
        """This rank's rows of a full tensor: of one part, or (part None) of the whole fused
        parameter, part by part."""
        if part is not None:
            return tensor.narrow(0, *ps.shard_range(self.part_sizes[part],
                                                    self.part_shards[part], self.rank, self.tp))
        pieces = tensor.split(self.part_sizes, dim=0)
        return torch.cat([self.shard_weight(name, p, i) for i, p in enumerate(pieces)])


class RowParallelLinear(Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        """in_features: the full input size; each rank takes 1/tensor_parallel_size of it."""
        self.rank, self.tp = ps.tp_rank(), ps.tp_size()
        if in_features % self.tp:
            raise ValueError(f"cannot split {in_features} input columns over {self.tp} ranks")
        self.full_in_features = in_features
        super().__init__(in_features // self.tp, out_features, bias=bias)

    def full_shape(self, name: str) -> tuple[int, ...]:
        return (self.out_features, self.full_in_features) if name == "weight" else (
            self.out_features,)

    def shard_weight(self, name: str, tensor: torch.Tensor, part: int | None) -> torch.Tensor:
        if name != "weight":
            return tensor  # the bias is whole on every rank, added once after the sum
        return tensor.narrow(1, *ps.shard_range(self.full_in_features, self.tp, self.rank,
                                                self.tp))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not ps.is_initialized():
            return super().forward(x)
        out = all_reduce(linear(x, self.weight, None, self.packed))
        return out if self.bias is None else out + self.bias


def _shard_vocab(tensor: torch.Tensor, vocab_size: int, rank: int, tp: int) -> torch.Tensor:
    """This rank's rows of a [vocab, hidden] tensor, zero rows past the vocabulary."""
    start, rows = ps.vocab_range(vocab_size, rank, tp)
    real = max(0, min(rows, vocab_size - start))
    shard = tensor.narrow(0, start, real)
    if real < rows:
        shard = torch.cat([shard, shard.new_zeros(rows - real, *tensor.shape[1:])])
    return shard


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        self.rank, self.tp = ps.tp_rank(), ps.tp_size()
        self.vocab_size = num_embeddings
        self.vocab_start, rows = ps.vocab_range(num_embeddings, self.rank, self.tp)
        super().__init__(rows, embedding_dim)

    def reset_parameters(self) -> None:
        """Nothing: weights are loaded or drawn by the loader. (nn.Embedding's normal_ on the
        meta device imports torch's reference ops, seconds per process.)"""

    def full_shape(self, name: str) -> tuple[int, ...]:
        return (self.vocab_size, self.embedding_dim)

    def shard_weight(self, name: str, tensor: torch.Tensor, part: int | None) -> torch.Tensor:
        return _shard_vocab(tensor, self.vocab_size, self.rank, self.tp)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not ps.is_initialized():
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))


class ParallelLMHead(Linear):
    """The untied LM head: this rank's rows of the vocabulary (logits all-gathered by
    compute_logits)."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        self.rank, self.tp = ps.tp_rank(), ps.tp_size()
        self.vocab_size = vocab_size
        super().__init__(hidden_size, ps.vocab_range(vocab_size, self.rank, self.tp)[1],
                         bias=False)

    def full_shape(self, name: str) -> tuple[int, ...]:
        return (self.vocab_size, self.in_features)

    def shard_weight(self, name: str, tensor: torch.Tensor, part: int | None) -> torch.Tensor:
        return _shard_vocab(tensor, self.vocab_size, self.rank, self.tp)
