"""Structured output's mask on the device: packed allowed-token bitmasks -> -inf logits."""
from __future__ import annotations

import sys

import numpy as np
import torch

from pagedllm.kernels.metadata import host_to_device

_BITS: dict[torch.device, torch.Tensor] = {}


def _bits(device: torch.device) -> torch.Tensor:
    bits = _BITS.get(device)
    if bits is None:
        bits = _BITS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return bits


def refused_tokens(bitmask: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[rows, 32 * words] bool on `device`: True where bit t % 32 of word t // 32 is clear.
    On the host numpy unpacks the bits in one pass (a little-endian int32 word's bytes are
    its bits in order); on a GPU the packed mask is copied and unpacked there."""
    rows, words = bitmask.shape
    if device.type == "cpu" and sys.byteorder == "little":
        packed = np.invert(bitmask.contiguous().numpy()).view(np.uint8)
        bits = np.unpackbits(packed, axis=1, bitorder="little")
        return torch.from_numpy(bits).view(torch.bool)  # 0/1 bytes are valid bools
    mask = bitmask.to(device)
    return (((mask[:, :, None] >> _bits(device)) & 1) == 0).view(rows, words * 32)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: logits[rows[i], t] = -inf where bit t of bitmask[i] is clear (bit t % 32 of
    word t // 32), and for every t past the mask's 32 * words ids. Other rows are left as
    they are. On CUDA one transfer of the packed mask and one kernel (triton_bitmask);
    elsewhere numpy unpacks it and a few batched passes apply it."""
    if not rows:
        return
    device, vocab = logits.device, logits.shape[1]
    if device.type == "cuda":
        from pagedllm.kernels.triton_bitmask import apply_token_bitmask_

        # From pinned memory the copy is queued without waiting (a pageable one may wait for
        # the forward queued before it).
        pinned = bitmask if bitmask.is_pinned() else bitmask.pin_memory()
        apply_token_bitmask_(logits, pinned.to(device, non_blocking=True),
                             host_to_device(rows, torch.long, device))
        return
    refused = refused_tokens(bitmask, device)
    if refused.shape[1] >= vocab:
        refused = refused[:, :vocab]
    else:
        refused = torch.nn.functional.pad(refused, (0, vocab - refused.shape[1]), value=True)
    if rows == list(range(logits.shape[0])):
        logits.masked_fill_(refused, float("-inf"))
        return
    index = host_to_device(rows, torch.long, device)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(refused, float("-inf")))
