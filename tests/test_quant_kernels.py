"""The GGUF block kernels of the CPU (kernels/cpu/quant.c) against gguf.quants.dequantize:
dequantize and embedding rows bit for bit, matmuls within the error their arithmetic
allows, for every supported type, ragged K and 1-600 rows; checks that a wrong scale or a
wrong nibble order fails; the scalar build (no AVX2) the same way."""
from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels.cpu import build, quant
from pagedllm.layers import gguf_linear
from pagedllm.layers.gguf_linear import GGUFEmbedding, GGUFLinear, PackedWeight, make_segments
from tests.quant_helpers import (
    QT, TYPES, block_size, dequantize, error_bound, random_packed, violations,
)

pytestmark = pytest.mark.skipif(build.load_library() is None,
                                reason="no C compiler: GGUF weights cannot stay packed")

# (rows of W, blocks per row): ragged K (odd block counts), n not a multiple of a tile
SHAPES = [(5, 1), (67, 3), (13, 37)]
# 1-8: integer kernel; 9-64: the tiled one (4-bit types through their value tables) with
# 1-4 vectors of 8 rows per tile (16, 24, 32: whole vectors; 33: 4 + 1); 100: 64 + 36 rows
ROWS = [1, 2, 3, 4, 5, 8, 9, 16, 17, 24, 32, 33, 100]


def packed_case(qtype, n, blocks, seed=0):
    k = blocks * block_size(qtype)
    packed = random_packed(qtype, n, k, seed)
    return torch.from_numpy(packed.reshape(-1).copy()), dequantize(packed, qtype, n, k), k


def check_kernels(qtype, n, blocks):
    packed, want, k = packed_case(qtype, n, blocks)
    assert torch.equal(quant.dequantize(packed, qtype, n, k), want)
    ids = torch.tensor([[n - 1, 0], [2 % n, 2 % n]])
    assert torch.equal(quant.get_rows(packed, qtype, n, k, ids), want[ids])
    g = torch.Generator().manual_seed(n * blocks)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=g)
        x[0, :32] *= 50  # an outlier block: its own activation scale
        y = quant.matmul(x, packed, qtype, n)
        assert violations(y, x, want, int16_activations=rows <= 8) == 0, f"{rows} rows"
    if quant.sgemm_address() is not None:  # the prompt path: dequantize + MKL's sgemm
        x = torch.randn(70, k, generator=g)
        y = torch.empty(70, n)
        quant.blas_matmul_unchecked(y, x, packed.data_ptr(), qtype, n, 0, 16,
                                    quant.sgemm_address())
        assert violations(y, x, want, int16_activations=False) == 0


@pytest.mark.parametrize("n, blocks", SHAPES)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_kernels_match_the_dequantize_oracle(qtype, n, blocks):
    check_kernels(qtype, n, blocks)


def test_matmul_writes_a_column_slice_of_a_wider_output():
    packed, want, k = packed_case(QT.Q4_1, 40, 6)
    x = torch.randn(3, k)
    out = torch.full((3, 100), 7.0)
    quant.matmul(x, packed, QT.Q4_1, 40, out[:, 30:70])
    assert violations(out[:, 30:70], x, want, int16_activations=True) == 0
    assert (out[:, :30] == 7).all() and (out[:, 70:] == 7).all()


@pytest.mark.skipif(quant.sgemm_address() is None, reason="torch links no MKL sgemm")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_blas_matmul_of_dequantized_slices(qtype):
    """The prompt path (gguf_blas_matmul_f32): each thread dequantizes its share of the
    rows, chunk_rows at a time, and multiplies them with MKL's sgemm, into a column slice
    of a wider output; shares that are not whole chunks, and n too small to share."""
    sgemm = quant.sgemm_address()
    for n, blocks, chunk_rows in [(67, 3, 5), (67, 3, 1000), (13, 37, 1), (5, 1, 4)]:
        packed, want, k = packed_case(qtype, n, blocks, seed=n)
        x = torch.randn(70, k, generator=torch.Generator().manual_seed(n))
        x[0, :32] *= 50
        out = torch.full((70, n + 9), 7.0)
        quant.blas_matmul_unchecked(out, x, packed.data_ptr(), qtype, n, 4, chunk_rows, sgemm)
        assert violations(out[:, 4:4 + n], x, want, int16_activations=False) == 0, (n, chunk_rows)
        assert (out[:, :4] == 7).all() and (out[:, 4 + n:] == 7).all()


# ----------------------------------------------------------------------------- mutations


def mutate(packed: np.ndarray, qtype, how: str) -> np.ndarray:
    """A weight as a kernel with one bug would read it."""
    bad = packed.copy().reshape(-1, gguf_bytes(qtype))
    if how == "scale":  # every block's fp16 scale read 25% too large
        off = {QT.Q6_K: 208}.get(qtype, 0)
        d = bad[:, off:off + 2].copy().view(np.float16) * np.float16(1.25)
        bad[:, off:off + 2] = d.view(np.uint8)
    else:  # "order": the two values of each byte swapped (Q8_0: values reversed)
        lo, hi = {QT.Q8_0: (2, 34), QT.Q4_0: (2, 18), QT.Q4_1: (4, 20), QT.Q4_K: (16, 144),
                  QT.Q6_K: (0, 128)}[qtype]
        q = bad[:, lo:hi]
        bad[:, lo:hi] = q[:, ::-1] if qtype == QT.Q8_0 else (q >> 4) | (q << 4)
    return bad.reshape(packed.shape)


def gguf_bytes(qtype) -> int:
    return quant.row_bytes(qtype, block_size(qtype))


@pytest.mark.parametrize("rows", [4, 16])  # the integer kernel, the tiled one
@pytest.mark.parametrize("how", ["scale", "order"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_wrong_scale_or_value_order_fails_the_check(qtype, how, rows):
    """The check above would catch a kernel that misreads a scale or the nibble order:
    products with such a misread weight break the bound almost everywhere."""
    n, k = 24, 4 * block_size(qtype)
    packed = random_packed(qtype, n, k, seed=3)
    want = dequantize(packed, qtype, n, k)
    bad = torch.from_numpy(mutate(packed, qtype, how).reshape(-1).copy())
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    int16 = rows <= 8
    assert violations(quant.matmul(x, bad, qtype, n), x, want, int16) > 0.5
    assert violations(quant.matmul(x, torch.from_numpy(packed.reshape(-1).copy()), qtype, n),
                      x, want, int16) == 0
    assert violations(F.linear(x, quant.dequantize(bad, qtype, n, k)), x, want, False) > 0.5
    if quant.sgemm_address() is not None:
        for packed_w, broken in ((bad, True), (torch.from_numpy(packed.reshape(-1).copy()), False)):
            y = torch.empty(rows, n)
            quant.blas_matmul_unchecked(y, x, packed_w.data_ptr(), qtype, n, 0, 5,
                                        quant.sgemm_address())
            assert (violations(y, x, want, False) > 0.5) == broken


# ----------------------------------------------------------------------------- layers


_LINEAR_ROWS = [1, 4, 5, 31, 33, 64, 65, 600]


# The torch variant only where BLAS runs at all (above MAX_PACKED_ROWS).
@pytest.mark.parametrize("rows,blas", [(r, "sgemm") for r in _LINEAR_ROWS] + [
    (r, "torch") for r in _LINEAR_ROWS if r > gguf_linear.MAX_PACKED_ROWS])
def test_linear_of_mixed_parts_with_bias(rows, blas, monkeypatch):
    """A fused projection of three parts of two types (as Q4_K_M files mix them), with a
    bias: the packed kernels up to MAX_PACKED_ROWS rows, dequantize + BLAS above, in slices
    (the chunk sizes made small to cut the weight in several): through MKL's sgemm from
    the C kernel, or where torch links no MKL through torch's GEMM."""
    if blas == "sgemm" and quant.sgemm_address() is None:
        pytest.skip("torch links no MKL sgemm")
    if blas == "torch":
        monkeypatch.setattr(quant, "sgemm_address", lambda: None)
    monkeypatch.setattr(gguf_linear, "DEQUANT_CHUNK_BYTES", 40 * 512 * 4)
    monkeypatch.setattr(gguf_linear, "DEQUANT_THREAD_CHUNK_BYTES", 24 * 512 * 4)
    k, parts = 512, [(QT.Q4_K, 96), (QT.Q6_K, 32), (QT.Q6_K, 32)]
    layer = GGUFLinear(k, 160, make_segments(parts, k), bias=True)
    assert [s.rows for s in layer.segments] == [96, 64]  # neighbours of one type merged
    weights = []
    for i, (qtype, n) in enumerate(parts):
        packed = random_packed(qtype, n, k, seed=i)
        layer.load_packed(i, PackedWeight(qtype, packed, n, k))
        weights.append(dequantize(packed, qtype, n, k))
    layer.bias.data.copy_(torch.randn(160))
    w = torch.cat(weights)
    assert torch.equal(layer.dequantize(), w)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    y = layer(x.view(1, rows, k))
    assert y.shape == (1, rows, 160)
    assert violations(y[0] - layer.bias, x, w, int16_activations=rows <= 8) == 0


def test_embedding_rows_and_tied_head():
    packed = random_packed(QT.Q8_0, 50, 64)
    table = dequantize(packed, QT.Q8_0, 50, 64)
    emb = GGUFEmbedding(50, 64, QT.Q8_0)
    emb.load_packed(0, PackedWeight(QT.Q8_0, packed, 50, 64))
    ids = torch.tensor([[3, 49, 0]])
    assert torch.equal(emb(ids), table[ids])
    h = torch.randn(2, 64)
    assert violations(emb.as_lm_head(h), h, table, int16_activations=True) == 0
    with pytest.raises(IndexError, match="token id out of range for an embedding of 50 rows"):
        emb(torch.tensor([50]))


def test_bad_inputs_get_clear_errors():
    packed, _, k = packed_case(QT.Q4_0, 4, 2)
    with pytest.raises(ValueError, match="4 rows of 64 Q4_0 values take 144 bytes, got 143"):
        quant.dequantize(packed[:-1], QT.Q4_0, 4, k)
    with pytest.raises(ValueError, match="Q4_0 rows hold whole blocks of 32 values, got 48"):
        quant.row_bytes(QT.Q4_0, 48)
    with pytest.raises(ValueError, match="no CPU kernel for Q5_K weights"):
        quant.dequantize(packed, QT.Q5_K, 1, 256)
    layer = GGUFLinear(64, 4, make_segments([(QT.Q4_0, 4)], 64))
    with pytest.raises(ValueError, match=r"packed part 0 is Q4_1 \[4, 64\], expected Q4_0 \[4, 64\]"):
        layer.load_packed(0, PackedWeight(QT.Q4_1, random_packed(QT.Q4_1, 4, 64), 4, 64))
    with pytest.raises(ValueError, match="expected 64 input features, got 32"):
        layer(torch.randn(2, 32))


# ----------------------------------------------------------------------------- scalar build


@pytest.fixture
def scalar_library(tmp_path, monkeypatch):
    """quant.c built for a baseline x86-64 (no AVX2, FMA or F16C): the path other CPUs get."""
    import ctypes

    flags = [f for f in build.FLAGS if not f.startswith("-march")] + ["-march=x86-64"]
    if build.platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the baseline build is x86-64")
    target = tmp_path / "quant_scalar.so"
    source = build.Path(quant.__file__).with_name("quant.c")
    subprocess.run([build._compiler(), *flags, str(source), "-o", str(target)], check=True)
    lib = ctypes.CDLL(str(target))
    monkeypatch.setattr(quant, "library", lambda: lib)
    return lib


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_scalar_build_matches_the_oracle(qtype, scalar_library):
    check_kernels(qtype, 67, 3)
