"""GGUF block dequantization in torch for the common types (Q8_0, Q4_0, Q4_1, F16).

gguf's numpy dequantizers make several passes with temporaries and run on one core: about
5 s for the default model's 134M weights on 2 cores, against a fraction of a second for the
same arithmetic in torch. The arithmetic is gguf's, operation for operation in fp32 (the
fp16 scale times the quant, plus the fp16 minimum), so the results are bit-identical to
gguf.quants.dequantize. Every other type goes to gguf.
"""
from __future__ import annotations

import warnings

import gguf
import numpy as np
import torch

Q = gguf.GGMLQuantizationType


def dequantize(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """fp32 values of a GGUF tensor's raw data ([..., row bytes] for block types)."""
    if qtype == Q.F32:
        return data.view(np.float32)
    if qtype not in _BLOCK_DEQUANTIZERS and qtype != Q.F16:
        return gguf.quants.dequantize(data, qtype)
    with warnings.catch_warnings():  # a read-only memory map, which is only ever read here
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8))
    if qtype == Q.F16:
        return raw.view(torch.float16).float().numpy()
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows = raw.shape[:-1]
    blocks = raw.reshape(-1, type_size)
    values = _BLOCK_DEQUANTIZERS[qtype](blocks)
    return values.reshape(*rows, raw.shape[-1] // type_size * block_size).numpy()


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 number at byte `start` of every block, as fp32 [n_blocks, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """16 bytes -> 32 quants: the low nibbles of every byte, then the high ones."""
    return torch.cat((packed & 0x0F, packed >> 4), dim=1)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:  # d (fp16), 32 x int8
    return blocks[:, 2:].contiguous().view(torch.int8).float() * _half(blocks, 0)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:  # d (fp16), 16 bytes of nibbles; x = d (q - 8)
    q = _nibbles(blocks[:, 2:]).to(torch.int8) - 8
    return _half(blocks, 0) * q.float()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:  # d, m (fp16), 16 bytes; x = d q + m
    return _half(blocks, 0) * _nibbles(blocks[:, 4:]).float() + _half(blocks, 2)


_BLOCK_DEQUANTIZERS = {Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1}
