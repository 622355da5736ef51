"""8-bit activations (--cpu-activations int8): quant.c's Q8_0-activation path against a torch
emulation of the same quantization with exact integer block sums, and against the fp32
oracle within the quantization's error bound; mutated weights and scales must fail both."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.kernels.cpu import quant
from pagedllm.layers import gguf_linear
from pagedllm.layers.gguf_linear import GGUFLinear, PackedWeight, make_segments
from tests.quant_helpers import QT, dequantize, error_bound, random_packed

pytestmark = pytest.mark.skipif(not quant.available(), reason="no CPU kernels")
TYPES = [QT.Q4_0, QT.Q4_1, QT.Q8_0]
ROWS = [1, 3, 8, 9, 16, 64]


def quantize_emulated(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """llama.cpp's Q8_0 for activations, in the kernel's fp32 operations: d = max|x| / 127,
    q = round-half-even(x * (1 / d)), s = d * sum(q)."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv[..., None])
    return q.to(torch.int8).reshape(x.shape), d, d * q.sum(-1)


def weight_blocks(packed: np.ndarray, qtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Integer values [n, blocks, 32] (Q4: the nibbles 0-15; Q8_0: int8), scale and offset
    factor [n, blocks] of each block: w = d * q + off."""
    n = packed.shape[0]
    size = {QT.Q4_0: 18, QT.Q4_1: 20, QT.Q8_0: 34}[qtype]
    b = packed.reshape(n, -1, size)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    if qtype == QT.Q8_0:
        return b[..., 2:34].copy().view(np.int8).astype(np.int64), d, np.zeros_like(d)
    qs = b[..., (2 if qtype == QT.Q4_0 else 4):]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int64)
    off = -8 * d if qtype == QT.Q4_0 else \
        b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    return q, d, off


def emulated_matmul(x: torch.Tensor, packed: np.ndarray, qtype, dx_scale: float = 1.0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, bound): y = sum over blocks of (d * dx) * (exact integer sum) + off * sx in
    float64, and how far a kernel's fp32 accumulation of the same terms may be from it."""
    qx, dx, sx = quantize_emulated(x)
    qw, dw, off = weight_blocks(packed, qtype)
    rows, k = x.shape
    isum = torch.einsum("rbi,nbi->rnb", qx.reshape(rows, -1, 32).long(),
                        torch.from_numpy(qw))  # exact int64
    dx64, sx64 = dx.double() * dx_scale, sx.double() * dx_scale
    scale = torch.from_numpy(dw)[None] * dx64[:, None]
    products = scale * isum.double()
    offsets = torch.from_numpy(off)[None] * sx64[:, None]
    # fp32 rounds partial sums, which may cancel (8 lanes of a block; Q4's offsets against
    # its products): the bound scales with the sums of absolute values
    isum_abs = torch.einsum("rbi,nbi->rnb", qx.reshape(rows, -1, 32).long().abs(),
                            torch.from_numpy(np.abs(qw)))
    bound = ((scale * isum_abs).abs() + offsets.abs()).sum(-1) * (k / 32 + 8) * 2.0**-23 \
        + 1e-30
    return (products + offsets).sum(-1), bound


def int8_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """How far the int8 path may be from x . w^T: each activation moves by at most dx / 2
    (dx = its block's max|x| / 127), plus fp32 rounding."""
    dx = x.double().reshape(x.shape[0], -1, 32).abs().amax(-1) / 127
    w_abs = w.double().abs().reshape(w.shape[0], -1, 32).sum(-1)
    return (dx @ w_abs.T) / 2 * (1 + 1e-5) + 4 * error_bound(x, w, False)


def case(qtype, n: int, blocks: int, seed: int = 0):
    k = 32 * blocks
    packed = random_packed(qtype, n, k, seed=seed)
    return packed, torch.from_numpy(packed.reshape(-1).copy()), k


def int8_matmul(x: torch.Tensor, packed: torch.Tensor, qtype, n: int) -> torch.Tensor:
    return quant.matmul(x, packed, qtype, n, int8_activations=True)


def test_activations_quantize_as_the_emulation():
    x = torch.randn(5, 96)
    x[0, :32] *= 1e4  # blocks of their own scale
    x[1, 32:64] = 0.0  # an all-zero block: d = 0, q = 0
    x[2, :32] = 0.0
    x[2, :8] = torch.tensor([127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5])  # d = 1: ties to even
    for got, want in zip(quant.quantize_q8(x), quantize_emulated(x)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_int8_matmul_matches_the_emulation_and_the_fp32_bound(qtype):
    for n, blocks in [(1, 1), (37, 3), (100, 18)]:
        packed_np, packed, k = case(qtype, n, blocks, seed=n)
        w = dequantize(packed_np, qtype, n, k)
        g = torch.Generator().manual_seed(n)
        for rows in ROWS:
            x = torch.randn(rows, k, generator=g)
            x[0, :32] *= 50  # an outlier block
            y = int8_matmul(x, packed, qtype, n)
            want, bound = emulated_matmul(x, packed_np, qtype)
            assert ((y.double() - want).abs() <= bound).all(), (n, rows)
            assert ((y.double() - x.double() @ w.double().T).abs() <= int8_bound(x, w)).all()


def test_int8_writes_a_column_slice_and_leaves_fp32_calls_alone():
    packed_np, packed, k = case(QT.Q4_1, 40, 6)
    x = torch.randn(20, k)
    out = torch.full((20, 100), 7.0)
    quant.matmul(x, packed, QT.Q4_1, 40, out[:, 30:70], int8_activations=True)
    want, bound = emulated_matmul(x, packed_np, QT.Q4_1)
    assert ((out[:, 30:70].double() - want).abs() <= bound).all()
    assert (out[:, :30] == 7).all() and (out[:, 70:] == 7).all()
    # The flag is only for the types and row counts that have the path.
    assert quant.kernel_qtype(QT.Q4_K, True) == QT.Q4_K
    assert quant.kernel_qtype(QT.Q4_1, True) == QT.Q4_1 | quant.INT8_ACTIVATIONS
    fp32 = quant.matmul(x, packed, QT.Q4_1, 40)
    assert not torch.equal(fp32, out[:, 30:70])  # another path ran
    x65 = torch.randn(65, k)  # more rows than the int8 path takes: the fp32 path
    assert torch.equal(int8_matmul(x65, packed, QT.Q4_1, 40), quant.matmul(x65, packed, QT.Q4_1, 40))


def mutated(packed: np.ndarray, qtype, how: str) -> np.ndarray:
    size = {QT.Q4_0: 18, QT.Q4_1: 20, QT.Q8_0: 34}[qtype]
    bad = packed.copy().reshape(-1, size)
    if how == "scale":
        d = bad[:, 0:2].copy().view(np.float16) * np.float16(1.25)
        bad[:, 0:2] = d.view(np.uint8)
    else:  # nibbles swapped in each byte (Q8_0: values reversed)
        lo = {QT.Q4_0: 2, QT.Q4_1: 4, QT.Q8_0: 2}[qtype]
        q = bad[:, lo:]
        bad[:, lo:] = q[:, ::-1] if qtype == QT.Q8_0 else (q >> 4) | (q << 4)
    return bad.reshape(packed.shape)


@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("how", ["scale", "order"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_wrong_scale_or_nibble_order_fails_both_checks(qtype, how, rows):
    n, k = 24, 128
    packed_np, packed, _ = case(qtype, n, k // 32, seed=3)
    w = dequantize(packed_np, qtype, n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    want, bound = emulated_matmul(x, packed_np, qtype)
    bad = torch.from_numpy(mutated(packed_np, qtype, how).reshape(-1).copy())
    y_bad = int8_matmul(x, bad, qtype, n).double()
    assert ((y_bad - want).abs() > bound).double().mean() > 0.5
    assert ((y_bad - x.double() @ w.double().T).abs() > int8_bound(x, w)).double().mean() > 0.5
    # A wrong activation block scale (the emulation's dx 25% off) fails the exact check.
    y = int8_matmul(x, packed, qtype, n).double()
    off_want, off_bound = emulated_matmul(x, packed_np, qtype, dx_scale=1.25)
    assert ((y - off_want).abs() > off_bound).double().mean() > 0.5
    assert ((y - want).abs() <= bound).all()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_8_row_layout_matches_the_emulation_and_fails_when_mutated(qtype):
    """quant_x8.c (the fused decode's GEMV, one row and a few): the repacked copy gives the
    emulation's exact integer sums within fp32 rounding; a wrong scale or nibble order in the source
    weight fails the check; a row count that is not a multiple of 8 has no such layout."""
    if not quant.x8_repackable(qtype, 8, 32):
        pytest.skip("no 8-row layout in this build (AVX2, F16C and FMA)")
    assert not quant.x8_repackable(qtype, 12, 64) and not quant.x8_repackable(QT.Q6_K, 8, 256)
    for n, blocks in [(8, 1), (40, 3), (96, 18)]:
        packed_np, packed, k = case(qtype, n, blocks, seed=n)
        x = torch.randn(1, k, generator=torch.Generator().manual_seed(n))
        x[0, :32] *= 50  # an outlier block
        repacked = quant.repack_x8(packed, qtype, n, k)
        y = quant.x8_row_matmul(x[0], repacked, qtype, n)
        want, bound = emulated_matmul(x, packed_np, qtype)
        assert ((y.double() - want[0]).abs() <= bound[0]).all(), n
        for rows in (1, 2, 16, 64):  # a few streams' step: gguf_x8_matmul
            xs = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            xs[0, :32] *= 50
            y = quant.x8_matmul(xs, repacked, qtype, n)
            want_rows, bound_rows = emulated_matmul(xs, packed_np, qtype)
            assert ((y.double() - want_rows).abs() <= bound_rows).all(), (n, rows)
    for how in ("scale", "order"):
        bad = torch.from_numpy(mutated(packed_np, qtype, how).reshape(-1).copy())
        y_bad = quant.x8_row_matmul(x[0], quant.repack_x8(bad, qtype, n, k), qtype, n)
        assert ((y_bad.double() - want[0]).abs() > bound[0]).double().mean() > 0.5, how
        y_bad = quant.x8_matmul(xs, quant.repack_x8(bad, qtype, n, k), qtype, n)
        assert ((y_bad.double() - want_rows).abs() > bound_rows).double().mean() > 0.5, how


@pytest.mark.parametrize("rows", [5, 64, 200])
def test_a_layer_with_int8_activations_reads_its_8_row_copy_for_any_row_count(rows, monkeypatch):
    """GGUFLinear with int8 activations: its first matmul makes the 8-row copy, which up to
    64 rows take in one call and a prompt's rows (200: three chunks of 64 and one of 8)
    chunk by chunk, never the fp32 BLAS path; every row within the emulation's bound."""
    if not quant.x8_repackable(QT.Q4_1, 8, 32):
        pytest.skip("no 8-row layout in this build (AVX2, F16C and FMA)")
    monkeypatch.setattr(gguf_linear.PackedMatrix, "_blas_matmul", None)  # must not be called
    n, k = 48, 32 * 6
    packed_np = random_packed(QT.Q4_1, n, k, seed=rows)
    layer = GGUFLinear(k, n, make_segments([(QT.Q4_1, n)], k))
    layer.load_packed(0, PackedWeight(QT.Q4_1, packed_np, n, k))
    layer.set_int8_activations(True)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    x[rows - 1, :32] *= 50  # an outlier block in the last chunk
    y = layer(x)
    assert layer.x8_copies and layer.x8_copies[0] is not None
    want, bound = emulated_matmul(x, packed_np, QT.Q4_1)
    assert ((y.double() - want).abs() <= bound).all()


@pytest.mark.parametrize("free_bytes, copies", [(1 << 40, True), (1024, False)])
def test_int8_layers_read_the_gguf_layout_when_ram_is_short(free_bytes, copies, monkeypatch):
    """The worker gives int8 layers 8-row copies only where they take at most half the free
    RAM; without them the int8 kernels read the GGUF blocks, within the same bound."""
    from pagedllm.worker import memory
    from pagedllm.worker.worker import Worker

    if copies and not quant.x8_repackable(QT.Q4_0, 8, 32):
        pytest.skip("no 8-row layout in this build (AVX2, F16C and FMA)")
    monkeypatch.setattr(memory, "free_memory", lambda device: free_bytes)
    n, k = 16, 32 * 4
    packed_np = random_packed(QT.Q4_0, n, k, seed=3)
    layer = GGUFLinear(k, n, make_segments([(QT.Q4_0, n)], k))
    layer.load_packed(0, PackedWeight(QT.Q4_0, packed_np, n, k))
    Worker._int8_activations(torch.nn.Sequential(layer))
    assert layer.int8_activations
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(4))
    y = layer(x)
    assert (layer.x8_copies_in_use()[0] is not None) == copies
    assert bool(layer.x8_copies) == copies
    want, bound = emulated_matmul(x, packed_np, QT.Q4_0)
    assert ((y.double() - want).abs() <= bound).all()


def test_cpu_activations_option_is_checked():
    from pagedllm.engine_args import EngineArgs

    with pytest.raises(ValueError, match="cpu_activations must be one of fp32, int8, got 'int4'"):
        EngineArgs(cpu_activations="int4")
    assert EngineArgs().cpu_activations == "fp32"
