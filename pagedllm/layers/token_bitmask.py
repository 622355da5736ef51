"""Structured output's mask on the device: packed allowed-token bitmasks -> -inf logits."""
from __future__ import annotations

import torch

from pagedllm.kernels.metadata import host_to_device

_BITS: dict[torch.device, torch.Tensor] = {}


def _bits(device: torch.device) -> torch.Tensor:
    bits = _BITS.get(device)
    if bits is None:
        bits = _BITS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return bits


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: logits[rows[i], t] = -inf where bit t of bitmask[i] is clear (bit t % 32 of
    word t // 32), and for every t past the mask's 32 * words ids. Other rows are left as
    they are. One transfer of the packed mask, then a few batched passes on the device."""
    if not rows:
        return
    device, vocab = logits.device, logits.shape[1]
    mask = bitmask.to(device, non_blocking=True)
    allowed = ((mask[:, :, None] >> _bits(device)) & 1).view(mask.shape[0], -1).bool()
    if allowed.shape[1] >= vocab:
        allowed = allowed[:, :vocab]
    else:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    if rows == list(range(logits.shape[0])):
        logits.masked_fill_(~allowed, float("-inf"))
        return
    index = host_to_device(rows, torch.long, device)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(~allowed, float("-inf")))
