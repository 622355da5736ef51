"""Pooling a prompt's final hidden states into one vector (embeddings).

A prompt may be computed in several chunks (chunked prefill): each chunk updates a running
partial, fp32 whatever the model's dtype: the sum of its rows ("mean") or its last row
("last"); `finish` turns the partial of the whole prompt into the vector.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def pool_chunk(method: str, hidden: torch.Tensor, partial: torch.Tensor | None) -> torch.Tensor:
    """The partial after one chunk's rows `hidden` [rows, hidden_size] (partial None: the
    prompt's first chunk)."""
    if method == "last":  # a copy: `hidden` may be a CUDA graph's buffer, reused next step
        return hidden[-1].to(torch.float32, copy=True)
    if method == "mean":
        total = hidden.float().sum(0)
        return total if partial is None else partial + total
    raise ValueError(f"unknown pooling {method!r} (last or mean)")


def finish(method: str, partial: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The pooled vector of a prompt of `num_tokens` tokens, not yet normalized."""
    return partial / num_tokens if method == "mean" else partial


def normalize(vector: torch.Tensor) -> torch.Tensor:
    """L2-normalized (a zero vector stays zero)."""
    return F.normalize(vector, dim=-1)
