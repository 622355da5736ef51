"""Random GGUF-packed weights of every supported type, and the oracle check for products
with them (the dequantized weight in float64)."""
from __future__ import annotations

import gguf
import numpy as np
import torch

QT = gguf.GGMLQuantizationType
TYPES = [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q4_K, QT.Q6_K]
# Byte offsets of each block's fp16 fields: scale first, then min / dmin where there is one.
FP16_FIELDS = {QT.Q8_0: [0], QT.Q4_0: [0], QT.Q4_1: [0, 2], QT.Q4_K: [0, 2], QT.Q6_K: [208]}
# fp16 scales that a file may hold: signs, zero, subnormals (the scalar fp16 path's cases).
SPECIAL_SCALES = np.array([0.0, -0.0, 6e-8, -3e-6, 1e-4, -2.5e-3], dtype=np.float16)


def block_size(qtype: int) -> int:
    return gguf.GGML_QUANT_SIZES[QT(qtype)][0]


def random_packed(qtype: int, rows: int, cols: int, seed: int = 0,
                  scale: float | None = None) -> np.ndarray:
    """uint8 [rows, row_bytes]: random quant bytes (every bit pattern) and fp16 scales of
    about `scale` (default: weights of about 1/sqrt(cols)), some of them special values."""
    qtype = QT(qtype)
    rng = np.random.default_rng(seed)
    bs, bb = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // bs, bb), dtype=np.uint8)
    if scale is None:
        # typical |q| of each type, so that the weights come out near 1 / sqrt(cols)
        typical = {QT.Q8_0: 64, QT.Q4_0: 4, QT.Q4_1: 8, QT.Q4_K: 8 * 32, QT.Q6_K: 16 * 64}
        scale = 1.0 / (typical[qtype] * np.sqrt(cols))
    for offset in FP16_FIELDS[qtype]:
        values = rng.uniform(-scale, scale, size=len(blocks)).astype(np.float16)
        values[: len(SPECIAL_SCALES)] = SPECIAL_SCALES[: len(values)]
        blocks[:, offset:offset + 2] = values.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def dequantize(packed: np.ndarray, qtype: int, rows: int, cols: int) -> torch.Tensor:
    """The oracle: gguf.quants.dequantize."""
    return torch.from_numpy(gguf.quants.dequantize(packed, QT(qtype)).reshape(rows, cols).copy())


def error_bound(x: torch.Tensor, w: torch.Tensor, int16_activations: bool) -> torch.Tensor:
    """[rows, n]: how far x . w^T computed in fp32 (any summation order) may be from the exact
    value; with 16-bit activations, plus the rounding of each activation to its block's step
    dx = max|x_block| / 32767 (at most dx / 2 per value)."""
    x64, w64 = x.double(), w.double()
    k = x.shape[-1]
    bound = (x64.abs() @ w64.abs().T) * (k * 2.0**-23)
    if int16_activations:
        dx = x64.reshape(x.shape[0], -1, 32).abs().amax(-1) / 32767  # [rows, blocks]
        w_abs = w64.abs().reshape(w.shape[0], -1, 32).sum(-1)  # [n, blocks]
        bound = (dx @ w_abs.T) / 2 * (1 + 1e-5) + 4 * bound
    return bound


def violations(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
               int16_activations: bool) -> float:
    """The share of outputs further from the float64 oracle than error_bound allows."""
    err = (y.double() - x.double() @ w.double().T).abs()
    return (err > error_bound(x, w, int16_activations)).double().mean().item()
