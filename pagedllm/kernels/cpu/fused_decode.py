"""A Llama-family decode step's decoder layers in one C call (fused_decode.c), for GGUF-packed
weights on the CPU. The caller describes the layers once as plain pointers (DecodeModel,
built by make_model from LayerWeights); each step then passes its hidden states and metadata.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from pagedllm.kernels.cpu import is_decode_step
from pagedllm.kernels.cpu.build import load_library
from pagedllm.kernels.metadata import PagedAttentionInputMetadata

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
MAX_SEGMENTS = 4  # as fused_decode.c


class _Segment(ctypes.Structure):
    _fields_ = [("weight", _ptr), ("qtype", _i64), ("start", _i64), ("rows", _i64),
                ("x8", _ptr)]


class _Projection(ctypes.Structure):
    _fields_ = [("segments", _Segment * MAX_SEGMENTS), ("num_segments", _i64),
                ("in_features", _i64), ("out_features", _i64)]


class _DecodeLayer(ctypes.Structure):
    _fields_ = [("input_norm", _ptr), ("post_norm", _ptr), ("input_eps", _f32),
                ("post_eps", _f32), ("qkv", _Projection), ("o", _Projection),
                ("gate_up", _Projection), ("down", _Projection), ("key_cache", _ptr),
                ("value_cache", _ptr)]


class _DecodeModel(ctypes.Structure):
    _fields_ = [("layers", ctypes.POINTER(_DecodeLayer)), ("num_layers", _i64),
                ("hidden", _i64), ("num_heads", _i64), ("num_kv_heads", _i64),
                ("head_dim", _i64), ("intermediate", _i64), ("block_size", _i64),
                ("scale", _f32), ("cos", _ptr), ("sin", _ptr)]


class _DecodeStep(ctypes.Structure):
    _fields_ = [("rows", _i64), ("positions", _ptr), ("slots", _ptr), ("block_tables", _ptr),
                ("seq_lens", _ptr), ("table_stride", _i64), ("max_seq_len", _i64),
                ("num_threads", _i64)]


@dataclass(frozen=True)
class PackedProjection:
    """A packed [out_features, in_features] weight: (address, qtype, first output row, rows,
    address of its 8-row copy or 0) of each run of rows in one block type; `copies` holds
    the 8-row copies (kernels/cpu/quant_x8.c), which the int8 steps read instead."""

    segments: tuple[tuple[int, int, int, int, int], ...]
    in_features: int
    out_features: int
    copies: tuple[torch.Tensor, ...] = ()


@dataclass(frozen=True, eq=False)
class LayerWeights:
    input_norm: torch.Tensor  # [hidden] fp32
    input_eps: float
    post_norm: torch.Tensor
    post_eps: float
    qkv: PackedProjection  # q | k | v
    o: PackedProjection
    gate_up: PackedProjection  # gate | up
    down: PackedProjection
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim] fp32


@dataclass(frozen=True)
class DecodeShape:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    scale: float


class DecodeModel:
    """The C description of the layers; holds every tensor it points into."""

    def __init__(self, layers: list[LayerWeights], shape: DecodeShape, cos: torch.Tensor,
                 sin: torch.Tensor) -> None:
        if not layers:
            raise ValueError("a fused decode needs at least one layer")
        self.tensors = [cos, sin] + [t for w in layers
                                     for t in (w.input_norm, w.post_norm, w.kv_cache)]
        self.copies = [t for w in layers for p in (w.qkv, w.o, w.gate_up, w.down)
                       for t in p.copies]
        for t in self.tensors:
            if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError("a fused decode takes contiguous fp32 CPU tensors")
        self.shape = shape
        self._layers = (_DecodeLayer * len(layers))(*map(_layer, layers))
        self.struct = _DecodeModel(
            ctypes.cast(self._layers, ctypes.POINTER(_DecodeLayer)), len(layers), shape.hidden,
            shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.intermediate,
            layers[0].kv_cache.shape[2], shape.scale, cos.data_ptr(), sin.data_ptr())


def _projection(p: PackedProjection) -> _Projection:
    if not 1 <= len(p.segments) <= MAX_SEGMENTS:
        raise ValueError(f"a fused decode takes 1 to {MAX_SEGMENTS} segments per projection")
    out = _Projection(num_segments=len(p.segments), in_features=p.in_features,
                      out_features=p.out_features)
    for i, seg in enumerate(p.segments):
        out.segments[i] = _Segment(*seg)
    return out


def _layer(w: LayerWeights) -> _DecodeLayer:
    return _DecodeLayer(w.input_norm.data_ptr(), w.post_norm.data_ptr(), w.input_eps,
                        w.post_eps, _projection(w.qkv), _projection(w.o),
                        _projection(w.gate_up), _projection(w.down), w.kv_cache[0].data_ptr(),
                        w.kv_cache[1].data_ptr())


@functools.cache
def _kernel():
    fn = load_library().llama_decode_layers_f32
    fn.argtypes, fn.restype = [ctypes.POINTER(_DecodeModel), ctypes.POINTER(_DecodeStep)] + \
        [_ptr] * 4, None
    return fn


def decode_layers(model: DecodeModel, hidden: torch.Tensor, residual: torch.Tensor | None,
                  meta: PagedAttentionInputMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden, residual) [rows, hidden] after every layer of `model`, for a decode step
    (one token per sequence; residual None before the first layer). Writes the step's K/V
    into the layers' caches."""
    if not is_decode_step(hidden, meta):
        raise ValueError("decode_layers takes decode-only steps (one token per sequence)")
    if hidden.dtype != torch.float32 or hidden.shape[1:] != (model.shape.hidden,):
        raise ValueError(f"decode_layers takes fp32 [rows, {model.shape.hidden}] hidden states")
    hidden = hidden.contiguous()
    residual = residual.contiguous() if residual is not None else None
    tables = meta.block_tables.contiguous()
    positions, slots = meta.positions.contiguous(), meta.slot_mapping.contiguous()
    seq_lens = meta.seq_lens.contiguous()
    step = _DecodeStep(hidden.shape[0], positions.data_ptr(), slots.data_ptr(),
                       tables.data_ptr(), seq_lens.data_ptr(), tables.shape[1],
                       meta.max_seq_len, torch.get_num_threads())
    hidden_out, residual_out = torch.empty_like(hidden), torch.empty_like(hidden)
    _kernel()(ctypes.byref(model.struct), ctypes.byref(step), hidden.data_ptr(),
              residual.data_ptr() if residual is not None else None, hidden_out.data_ptr(),
              residual_out.data_ptr())
    return hidden_out, residual_out
