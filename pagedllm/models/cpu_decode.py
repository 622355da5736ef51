"""The CPU's fused decode for Llama-family models with GGUF-packed weights: a decode step's
decoder layers in one C call (kernels/cpu/fused_decode.c) instead of ~12 module and kernel
calls per layer. The same kernels run in the same order as the per-op path, which stays the
path (and the tests' oracle) for everything this does not cover: prompt chunks and mixed
steps, more rows than the packed matmul takes, weights that are not all packed, biases,
q/k norms, sliding windows, tensor parallelism, a device map that splits the layers, layers
not on the C kernels (no compiler, PAGEDLLM_CPU_KERNELS=0, another backend).
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.distributed import parallel_state as ps
from pagedllm.kernels.cpu import fused_decode, is_decode_step, quant
from pagedllm.kernels.metadata import PagedAttentionInputMetadata
from pagedllm.layers.dispatch import Dispatched
from pagedllm.layers.gguf_linear import MAX_PACKED_ROWS, GGUFLinear


class CpuFusedDecode:
    """One model's fused decode: whether it applies (decided once), and the layers' C
    description, rebuilt whenever a weight or KV cache it points into has moved."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.steps = 0  # decode steps run fused (tests assert which path ran)
        self._supported: bool | None = None
        self._plan: fused_decode.DecodeModel | None = None
        self._key: tuple[int, ...] = ()
        self._slots: list[tuple[dict, str]] = []

    def run(self, hidden: torch.Tensor, residual: torch.Tensor | None,
            kv_caches: list[torch.Tensor], meta: PagedAttentionInputMetadata
            ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The state after every layer, or None: the step is not one this covers."""
        if not (self.supported() and is_decode_step(hidden, meta)
                and 1 <= hidden.shape[0] <= MAX_PACKED_ROWS):
            return None
        if hidden.dtype != torch.float32 or hidden.device.type != "cpu":
            return None
        plan = self._current_plan(kv_caches)
        if plan is None:
            return None
        self.steps += 1
        return fused_decode.decode_layers(plan, hidden, residual, meta)

    def supported(self) -> bool:
        if self._supported is None:
            self._supported = _supports(self.model)
            if self._supported:
                self._slots = _weight_slots(self.model.layers)
        return self._supported

    def _current_plan(self, kv_caches: list[torch.Tensor]) -> fused_decode.DecodeModel | None:
        if len(kv_caches) != len(self.model.layers):
            return None
        # Every address the description holds (~55 us for 30 layers): rebuilt when one moved.
        key = tuple([d[name].data_ptr() for d, name in self._slots]
                    + [kv.data_ptr() for kv in kv_caches])
        if key != self._key:
            self._plan, self._key = _build(self.model, kv_caches), key
        return self._plan


def _supports(model: nn.Module) -> bool:
    """The model's decoder layers are all ones the C step computes exactly as the per-op
    path does (the checks that do not depend on the step)."""
    config = model.config
    if ps.tp_size() != 1 or config.qk_norm or config.sliding_window or not len(model.layers):
        return False
    rope = model.layers[0].self_attn.rotary.rope
    scale = model.layers[0].self_attn.attn.scale
    for layer in model.layers:
        attn = layer.self_attn
        on_c_kernels = all(m.backend.name == "cpu" and m.backend.has_kernels
                           for m in layer.modules() if isinstance(m, Dispatched))
        projections = (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        packed = all(isinstance(p, GGUFLinear) and p.bias is None
                     and len(p.segments) <= fused_decode.MAX_SEGMENTS for p in projections)
        plain_attention = (attn.q_norm is None and attn.attn.sliding_window is None
                           and attn.attn._alibi is None and attn.rotary.rope is rope
                           and attn.attn.scale == scale)
        if not (on_c_kernels and packed and plain_attention):
            return False
    return True


def _projection(p: GGUFLinear) -> fused_decode.PackedProjection:
    """The projection's segments; with int8 activations, those with quant_x8.c's layout
    point at the projection's 8-row copy (PackedMatrix.x8_copies_in_use), which the fused
    steps of up to 64 rows read."""
    base = p.qweight.data_ptr()
    copies = p.x8_copies_in_use()
    segments = [(base + s.offset, qtype, s.start, s.rows, 0 if c is None else c.data_ptr())
                for s, qtype, c in zip(p.segments, p.kernel_qtypes, copies)]
    return fused_decode.PackedProjection(tuple(segments), p.in_features, p.out_features,
                                         tuple(c for c in copies if c is not None))


def _weight_slots(layers: nn.ModuleList) -> list[tuple[dict, str]]:
    """Where each tensor the C description points into is held: (the module's buffer or
    parameter dict, name), read directly (no module attribute lookups) on every step."""
    slots = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            slots.append((p._buffers, "qweight"))
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            slots.append((norm._parameters, "weight"))
    return slots


def _build(model: nn.Module, kv_caches: list[torch.Tensor]) -> fused_decode.DecodeModel | None:
    first = model.layers[0].self_attn
    shape = fused_decode.DecodeShape(
        hidden=model.config.hidden_size, num_heads=first.num_heads,
        num_kv_heads=first.num_kv_heads, head_dim=first.head_dim,
        intermediate=model.layers[0].mlp.down_proj.in_features, scale=first.attn.scale)
    expected_cache = (2, kv_caches[0].shape[1], kv_caches[0].shape[2], shape.num_kv_heads,
                      shape.head_dim)
    if any(tuple(kv.shape) != expected_cache for kv in kv_caches):
        return None
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if ((attn.qkv_proj.out_features, attn.o_proj.in_features, mlp.gate_up_proj.out_features)
                != (q + 2 * kv, q, 2 * shape.intermediate)):
            return None
    cos, sin = first.rotary.tables(torch.device("cpu"))
    layers = [
        fused_decode.LayerWeights(
            input_norm=layer.input_layernorm.weight.detach(),
            input_eps=layer.input_layernorm.eps,
            post_norm=layer.post_attention_layernorm.weight.detach(),
            post_eps=layer.post_attention_layernorm.eps,
            qkv=_projection(layer.self_attn.qkv_proj), o=_projection(layer.self_attn.o_proj),
            gate_up=_projection(layer.mlp.gate_up_proj), down=_projection(layer.mlp.down_proj),
            kv_cache=kv)
        for layer, kv in zip(model.layers, kv_caches)]
    try:
        return fused_decode.DecodeModel(layers, shape, cos, sin)
    except ValueError:  # a tensor of another dtype, device or layout: the per-op path
        return None
