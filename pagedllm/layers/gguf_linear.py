"""GGUF weights kept in their quantized blocks on the CPU (`--quantization gguf`).

A 135M-parameter model reads 538 MB of fp32 weights per decoded token; its Q4_1/Q8_0 GGUF
holds them in 94 MB. GGUFLinear keeps a linear layer's rows as the file packs them and
multiplies with them directly (kernels/cpu/quant.c): small batches (decode) run the packed
matmul, larger ones (prompts) dequantize the weight a slice at a time and use BLAS (MKL's
sgemm, one per thread on its own share of the rows), where the GEMM's cost dwarfs the
dequantization. GGUFEmbedding keeps a packed embedding table,
dequantizes only the rows it looks up, and serves as the tied LM head.

A fused projection (q|k|v, gate|up) loads its parts one by one, and they may be of
different types (Q4_K_M files mix Q4_K and Q6_K): each part is a Segment of the packed
buffer, multiplied on its own into its columns of the output.
"""
from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels.cpu import quant

if TYPE_CHECKING:
    from pagedllm.layers.lora import LoRALayer

# Above this many rows a call dequantizes and uses BLAS (measured on the default model's
# Q4_1 shapes, one core: the packed kernel is 1.1-1.4x ahead at 64 rows, even to 1.2x
# behind at 128, behind BLAS at 256+).
MAX_PACKED_ROWS = 64
# Prompts go through quant.c's gguf_blas_matmul_f32: each thread dequantizes its own share
# of the output rows, at most DEQUANT_THREAD_CHUNK_BYTES of fp32 at a time (for the default
# model's layers: the whole share at once), into a buffer of its own, and multiplies it with
# MKL's single-threaded sgemm. On the 2-core EPYC here, idle, a 512-token prompt's
# projections take about as long as (within 1%) the fp32 model's F.linear on its weights
# (one two-threaded GEMM each; the sgemms gain back what dequantizing costs, ~1.5%), where
# dequantize + F.linear was 1-4% behind; with another job on the machine it ran 15-25%
# faster than both (no two-thread barrier inside each GEMM to wait on a descheduled thread).
DEQUANT_THREAD_CHUNK_BYTES = 4 << 20
# Where torch links no MKL (no sgemm to call from C): dequantize at most this many fp32
# bytes at once (an LM head of 49k rows would be 113 MB in one piece), into one buffer per
# thread that every layer reuses rather than fresh memory per weight (page faults), and run
# F.linear on it. Smaller pieces (4 or 8 MB, to stay in L3) made a 512-token prompt slower
# here: more, narrower GEMMs.
DEQUANT_CHUNK_BYTES = 16 << 20
_scratch = threading.local()


def _scratch_matrix(n: int, k: int) -> torch.Tensor:
    """A [n, k] fp32 view of this thread's dequantization buffer (grown as needed)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < n * k:
        buf = _scratch.buf = torch.empty(n * k)
    return buf[: n * k].view(n, k)


@dataclass
class PackedWeight:
    """A [rows, cols] GGUF tensor in its blocks: what the loader hands over instead of a
    dequantized tensor. data: uint8 [rows, row_bytes]."""

    qtype: int
    data: np.ndarray  # often a view of the file's read-only memory map
    rows: int
    cols: int


@dataclass(frozen=True)
class Segment:
    """One part of a packed weight: output rows [start, start + rows), bytes from offset."""

    qtype: int
    start: int
    rows: int
    offset: int
    nbytes: int


def make_segments(parts: Iterable[tuple[int, int]], cols: int) -> list[Segment]:
    """(qtype, rows) of each part in order -> segments laid out back to back."""
    segments, start, offset = [], 0, 0
    for qtype, rows in parts:
        nbytes = rows * quant.row_bytes(qtype, cols)
        segments.append(Segment(int(qtype), start, rows, offset, nbytes))
        start, offset = start + rows, offset + nbytes
    return segments


def merge_segments(segments: list[Segment]) -> list[Segment]:
    """Neighbours of one type as one segment: one kernel call for q|k|v of one type."""
    merged: list[Segment] = []
    for s in segments:
        last = merged[-1] if merged else None
        if last is not None and last.qtype == s.qtype:
            merged[-1] = Segment(s.qtype, last.start, last.rows + s.rows, last.offset,
                                 last.nbytes + s.nbytes)
        else:
            merged.append(s)
    return merged


class PackedMatrix(nn.Module):
    """The packed [out_features, in_features] matrix shared by GGUFLinear and GGUFEmbedding."""

    def __init__(self, in_features: int, out_features: int, parts: list[Segment]) -> None:
        super().__init__()
        if sum(s.rows for s in parts) != out_features:
            raise ValueError("the parts must cover every output row")
        self.in_features, self.out_features = in_features, out_features
        self.parts = parts  # as loaded: one per shard of a fused projection
        self.segments = merge_segments(parts)  # as computed
        self.register_buffer("qweight", torch.empty(sum(s.nbytes for s in parts),
                                                    dtype=torch.uint8))
        self.loaded = [False] * len(parts)
        # per segment, an 8-row copy (quant_x8.c) or None: see use_x8_copies
        self.x8_copies: list[torch.Tensor | None] = []
        self._x8_source = 0  # the qweight address the copies were made from
        self.set_int8_activations(False)

    def set_int8_activations(self, on: bool, x8_layout: bool = True) -> None:
        """8-bit activations (llama.cpp's Q8_0) in the packed matmul, for the segments whose
        type has that path (kernels/cpu/quant.py INT8_TYPES); fp32 activations elsewhere.
        x8_layout: read 8-row copies of the weights (use_x8_copies), else the GGUF layout."""
        self.int8_activations, self.x8_layout = on, x8_layout
        # the qtype each segment's kernel call passes, flag included (the per-token path)
        self.kernel_qtypes = [quant.kernel_qtype(s.qtype, on) for s in self.segments]

    def use_x8_copies(self) -> None:
        """An 8-row copy (quant_x8.c, as many bytes again) of each segment whose type has
        that layout, which int8-activation matmuls read from then on: its kernels run up to
        twice the GGUF layout's speed. Made on the first such matmul (the weights are
        loaded by then and not written after); the fused decode reads the same copies."""
        source = self.qweight.data_ptr()  # a replaced weight gets copies of its own
        if self.x8_copies and self._x8_source == source:
            return
        self._x8_source = source
        self.x8_copies = [
            quant.repack_x8(self._data(s), s.qtype, s.rows, self.in_features)
            if quant.x8_repackable(s.qtype, s.rows, self.in_features) else None
            for s in self.segments]

    def x8_copies_in_use(self) -> list[torch.Tensor | None]:
        """Per segment, the 8-row copy the matmuls read (made on first use), or None: fp32
        activations, or a type without that layout."""
        if not (self.int8_activations and self.x8_layout):
            return [None] * len(self.segments)
        self.use_x8_copies()
        return self.x8_copies

    def load_packed(self, part: int, packed: PackedWeight) -> None:
        """Copy part `part` (a shard of a fused projection, else 0) in from the file."""
        seg = self.parts[part]
        if (packed.qtype, packed.rows, packed.cols) != (seg.qtype, seg.rows, self.in_features):
            raise ValueError(
                f"packed part {part} is {quant.QuantType(packed.qtype).name} "
                f"[{packed.rows}, {packed.cols}], expected "
                f"{quant.QuantType(seg.qtype).name} [{seg.rows}, {self.in_features}]")
        dst = self.qweight[seg.offset: seg.offset + seg.nbytes].numpy()
        np.copyto(dst, packed.data.reshape(-1))
        self.loaded[part] = True

    def _data(self, seg: Segment) -> torch.Tensor:
        return self.qweight[seg.offset: seg.offset + seg.nbytes]

    def dequantize(self) -> torch.Tensor:
        """The whole [out, in] matrix in fp32 (tests, and the oracle)."""
        return torch.cat([quant.dequantize(self._data(s), s.qtype, s.rows, self.in_features)
                          for s in self.segments])

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] fp32 -> x . W^T [..., out] fp32."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected {self.in_features} input features, got {x.shape[-1]}")
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32:
            raise ValueError(f"GGUF weights compute in float32, got {rows.dtype} activations")
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        copies = self.x8_copies_in_use()
        if rows.shape[0] > MAX_PACKED_ROWS and all(c is not None for c in copies):
            return self._x8_chunked_matmul(rows).reshape(*x.shape[:-1], self.out_features)
        if rows.shape[0] <= MAX_PACKED_ROWS:
            out = torch.empty(rows.shape[0], self.out_features)
            base = self.qweight.data_ptr()
            # the segments were checked at load
            for s, qtype, copy in zip(self.segments, self.kernel_qtypes, copies):
                if copy is not None:
                    quant.x8_matmul_unchecked(out, rows, copy.data_ptr(), s.qtype, s.rows,
                                              s.start)
                else:
                    quant.matmul_unchecked(out, rows, base + s.offset, qtype, s.rows, s.start)
        else:
            out = self._blas_matmul(rows)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _x8_chunked_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """A prompt's rows with int8 activations: the 8-row kernel, INT8_MAX_ROWS rows at a
        time (on these weights it outruns dequantizing them for BLAS by ~1.5x, and each
        row's values are the ones it gets in a decode step)."""
        out = torch.empty(rows.shape[0], self.out_features)
        for at in range(0, rows.shape[0], quant.INT8_MAX_ROWS):
            chunk = rows[at:at + quant.INT8_MAX_ROWS]
            for s, copy in zip(self.segments, self.x8_copies):
                quant.x8_matmul_unchecked(out[at:], chunk, copy.data_ptr(), s.qtype, s.rows,
                                          s.start)
        return out

    def _blas_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        sgemm = quant.sgemm_address()
        if sgemm is None:
            return self._torch_blas_matmul(rows)
        chunk_rows = max(1, DEQUANT_THREAD_CHUNK_BYTES // (4 * self.in_features))
        out = torch.empty(rows.shape[0], self.out_features)
        base = self.qweight.data_ptr()
        for s in self.segments:
            quant.blas_matmul_unchecked(out, rows, base + s.offset, s.qtype, s.rows, s.start,
                                        chunk_rows, sgemm)
        return out

    def _torch_blas_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        pieces = []
        k = self.in_features
        for s in self.segments:
            step = max(1, DEQUANT_CHUNK_BYTES // (4 * k))
            row_bytes = quant.row_bytes(s.qtype, k)
            data = self._data(s)
            for first in range(0, s.rows, step):
                n = min(step, s.rows - first)
                w = quant.dequantize(data[first * row_bytes: (first + n) * row_bytes],
                                     s.qtype, n, k, out=_scratch_matrix(n, k))
                pieces.append(F.linear(rows, w))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)

    def extra_repr(self) -> str:
        types = "+".join(quant.QuantType(s.qtype).name for s in self.parts)
        acts = ", int8 activations" if self.int8_activations else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {types}{acts}"


class GGUFLinear(PackedMatrix):
    """A Linear whose weight stays in GGUF blocks; the bias (if any) is fp32."""

    def __init__(self, in_features: int, out_features: int, parts: list[Segment],
                 bias: bool = False) -> None:
        super().__init__(in_features, out_features, parts)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=torch.float32),
                                 requires_grad=False) if bias else None

    # The bias of a fused projection (Qwen2's q|k|v) loads part by part, like a
    # layers/parallel_linear.py module on one rank.
    @property
    def part_sizes(self) -> list[int]:
        return [s.rows for s in self.parts]

    def full_shape(self, name: str) -> tuple[int, ...]:
        return (self.out_features,)

    def local_range(self, part: int) -> tuple[int, int]:
        return self.parts[part].start, self.parts[part].rows

    def shard_weight(self, name: str, tensor: torch.Tensor, part: int | None) -> torch.Tensor:
        return tensor

    lora: "LoRALayer | None" = None  # adapters attached by pagedllm/lora (layers/lora.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x)
        if self.bias is not None:
            out = out.add_(self.bias)
        return out if self.lora is None else self.lora(x, out)


class GGUFEmbedding(PackedMatrix):
    """An embedding table in GGUF blocks: lookups dequantize just their rows."""

    def __init__(self, num_embeddings: int, embedding_dim: int, qtype: int) -> None:
        super().__init__(embedding_dim, num_embeddings,
                         make_segments([(qtype, num_embeddings)], embedding_dim))
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seg = self.segments[0]
        return quant.get_rows(self.qweight, seg.qtype, self.num_embeddings, self.embedding_dim,
                              input_ids)

    def as_lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the tied LM head: hidden . table^T."""
        return self.matmul(hidden)


def is_packed(module: nn.Module | None) -> bool:
    return isinstance(module, PackedMatrix)


def unloaded_parts(model: nn.Module) -> list[str]:
    """Names of packed parts no weight was loaded into (a checkpoint missing tensors)."""
    return [f"{name}#{i}" for name, m in model.named_modules() if isinstance(m, PackedMatrix)
            for i, done in enumerate(m.loaded) if not done]

