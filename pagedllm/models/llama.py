"""The Llama family: Llama 2/3 and SmolLM2, Mistral (sliding window), Qwen2 (qkv bias),
Qwen3 (per-head q/k RMSNorm). One module; the config switches the differences on.

The forward takes a flat batch of tokens from many sequences and reads/writes the paged KV
cache of each layer (see pagedllm/kernels/metadata.py).
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.distributed import parallel_state as ps
from pagedllm.kernels.metadata import PagedAttentionInputMetadata
from pagedllm.layers import norm_fold
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.attention import PagedAttention
from pagedllm.layers.parallel_linear import (
    ColumnParallelLinear, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding,
)
from pagedllm.layers.lora import lora_active
from pagedllm.layers.norm_fold import folded_linear
from pagedllm.layers.norms import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.models.base import CausalLM
from pagedllm.models.cpu_decode import CpuFusedDecode

if TYPE_CHECKING:
    from pagedllm.kernels.triton_gemv import RmsInput


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        tp = ps.tp_size()
        # This rank's heads (all of them on one rank); KV heads replicated past their count.
        self.num_heads, self.num_kv_heads = ps.local_num_heads(config, tp)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        q_full = config.num_attention_heads * self.head_dim
        kv_full = config.num_key_value_heads * self.head_dim
        kv_shards = ps.num_kv_shards(config.num_key_value_heads, tp)
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size, [q_full, kv_full, kv_full], bias=config.attention_bias,
            part_shards=[tp, kv_shards, kv_shards],
        )
        self.o_proj = RowParallelLinear(q_full, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # One per layer (its device's backend), over cos/sin tables all layers share.
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                      config.rope_theta, config.rope_scaling)
        self.attn = PagedAttention(
            self.num_heads,
            self.head_dim,
            self.num_kv_heads,
            scale=self.head_dim**-0.5,
            sliding_window=config.sliding_window,
        )

    def forward(
        self, hidden: torch.Tensor, kv_cache: torch.Tensor, meta: PagedAttentionInputMetadata
    ) -> torch.Tensor:
        return self.o_proj(self.attend(self.qkv_proj(hidden), kv_cache, meta))

    def attend(self, qkv: torch.Tensor, kv_cache: torch.Tensor,
               meta: PagedAttentionInputMetadata) -> torch.Tensor:
        """The attention over the fused projection's output [T, q + 2 kv], before o_proj."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        # the attention's backend norms (Qwen3) and rotates q and k (with the cache write,
        # where it can)
        qk_norm = (self.q_norm, self.k_norm) if self.q_norm is not None else None
        return self.attn(q, k, v, kv_cache, meta, rope=self.rotary.rope, qk_norm=qk_norm)

    def attend_folded(self, x: torch.Tensor | RmsInput, kv_cache: torch.Tensor,
                      meta: PagedAttentionInputMetadata, fold_rope: bool) -> torch.Tensor:
        """One row (layers/norm_fold.py): the qkv GEMV from x (normed, or its RmsInput),
        with the rotary embedding and cache write folded in where fold_rope, then the
        attention, before o_proj."""
        if fold_rope:
            q = norm_fold.folded_qkv(self.qkv_proj, x, self.num_heads, self.num_kv_heads,
                                     self.rotary.rope, kv_cache, meta)
            return self.attn.over_cache(q, kv_cache, meta)
        return self.attend(folded_linear(self.qkv_proj, x)[0], kv_cache, meta)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [size, size], bias=False)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=False)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: PagedAttentionInputMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def fp8_input_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        """(layer, the linear that alone reads its output): where an FP8 linear's input
        quantization can move into the layer before it (layers/fp8_linear.py)."""
        return [(self.input_layernorm, self.self_attn.qkv_proj),
                (self.post_attention_layernorm, self.mlp.gate_up_proj),
                (self.mlp.act, self.mlp.down_proj)]

    def forward_folded(self, x: torch.Tensor | RmsInput, residual: torch.Tensor,
                       kv_cache: torch.Tensor, meta: PagedAttentionInputMetadata,
                       next_norm: RMSNorm | None, fold_rope: bool
                       ) -> tuple[torch.Tensor, RmsInput | None]:
        """One row, the norms folded into the GEMVs (layers/norm_fold.py). x: this layer's
        normed input, or its RmsInput; residual: the stream before the layer. Returns the
        stream after it and, with next_norm, that norm's RmsInput for the next layer."""
        attn, mlp, post = self.self_attn, self.mlp, self.post_attention_layernorm
        h, rms = folded_linear(attn.o_proj, attn.attend_folded(x, kv_cache, meta, fold_rope),
                               residual=residual, next_norm=(post.weight, post.eps))
        act, _ = folded_linear(mlp.gate_up_proj, rms, gated=True)
        return folded_linear(mlp.down_proj, act, residual=h,
                             next_norm=None if next_norm is None else
                             (next_norm.weight, next_norm.eps))


class LlamaForCausalLM(CausalLM):
    # Hugging Face names of the separate projections we load into one fused weight:
    # (hf suffix, our suffix, shard index).
    packed_weights = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)

    # The three stages (models/base.py). The state between layers is (hidden, residual);
    # residual is None before the first layer.
    def embed(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.embed_tokens(input_ids), None

    def run_layers(self, layers: range, state: tuple, kv_caches: list[torch.Tensor],
                   meta: PagedAttentionInputMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = state
        # the fused decode bypasses the projection modules, so not with adapter rows
        if self.fused_decode_enabled and layers == range(len(self.layers)) and not lora_active():
            fused = self.cpu_decode.run(hidden, residual, kv_caches, meta)
            if fused is not None:
                return fused
        if layers == range(len(self.layers)) and self.folds_norms and norm_fold.folds(hidden):
            return self._run_folded(layers, state, kv_caches, meta)
        for i in layers:
            hidden, residual = self.layers[i](hidden, residual, kv_caches[i], meta)
        return hidden, residual

    @functools.cached_property
    def folds_rope(self) -> bool:
        """Folded steps fold the rotary embedding and cache write into qkv too."""
        attn = self.layers[0].self_attn
        return norm_fold.rope_foldable(attn.qkv_proj, attn.head_dim, attn.q_norm is not None)

    @functools.cached_property
    def folds_norms(self) -> bool:
        """One-row steps fold the norms into the GEMVs (layers/norm_fold.py); whole models
        only (a device map's stages hand (hidden, residual) on)."""
        layers = list(self.layers)
        return norm_fold.foldable(
            [n for layer in layers
             for n in (layer.input_layernorm, layer.post_attention_layernorm)],
            [p for layer in layers for p in (layer.self_attn.o_proj, layer.mlp.down_proj)],
            [layer.self_attn.qkv_proj for layer in layers],
            [layer.mlp.gate_up_proj for layer in layers])

    def _run_folded(self, layers: range, state: tuple, kv_caches: list[torch.Tensor],
                    meta: PagedAttentionInputMetadata) -> tuple[torch.Tensor, None]:
        """The layers at one row with folded norms. The first input norm runs as a kernel;
        the state returned is (the stream, None), which final_norm reads whole."""
        hidden, residual = state
        first = self.layers[layers[0]].input_layernorm
        if residual is None:
            x, residual = first(hidden), hidden
        else:
            x, residual = first(hidden, residual)
        for i in layers:
            following = self.layers[i + 1].input_layernorm if i + 1 in layers else None
            residual, x = self.layers[i].forward_folded(x, residual, kv_caches[i], meta,
                                                        following, self.folds_rope)
        return residual, None

    # A CPU decode step with GGUF-packed weights runs every layer in one C call
    # (models/cpu_decode.py); tests turn it off to compare with the per-op path.
    fused_decode_enabled = True

    @functools.cached_property
    def cpu_decode(self) -> CpuFusedDecode:
        return CpuFusedDecode(self)

    def final_norm(self, state: tuple) -> torch.Tensor:
        hidden, residual = state
        if residual is None:  # hidden is the whole stream (a folded step)
            return self.norm(hidden)
        return self.norm(hidden, residual)[0]

    # Hugging Face names -> ours: "model." dropped, q/k/v and gate/up fused.
    def weight_target(self, name: str) -> tuple[str, int | None] | None:
        name = name.removeprefix("model.")
        if "rotary_emb" in name:
            return None
        for hf, (ours, shard) in self.packed_weights.items():
            if f".{hf}." in name:
                return name.replace(f".{hf}.", f".{ours}."), shard
        return name, None

    def num_shards(self, param_name: str) -> int | None:
        if ".qkv_proj." in param_name:
            return 3
        return 2 if ".gate_up_proj." in param_name else None
