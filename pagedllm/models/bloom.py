"""Bloom: ALiBi attention (no rotary), LayerNorms with bias, a LayerNorm right after the
embedding, GELU MLP and a head tied to the embedding.

Same interface as pagedllm/models/llama.py, so the Worker places and loads it the same way.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.kernels.metadata import PagedAttentionInputMetadata
from pagedllm.kernels.reference import alibi_slopes
from pagedllm.layers.attention import PagedAttention
from pagedllm.layers.linear import Linear
from pagedllm.models.base import CausalLM


class BloomEmbedding(nn.Embedding):
    """Token embedding followed by Bloom's word_embeddings_layernorm, in one module so the
    Worker's `embed_tokens.to_empty(...)` places both; `.weight` is the (tied) embedding."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config.vocab_size, config.hidden_size)
        self.layernorm = nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.layernorm(super().forward(input_ids))


class BloomAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        # Our fused layout is [all q | all k | all v]; load_weights reorders Bloom's per-head one.
        self.query_key_value = Linear(config.hidden_size, 3 * self.q_size)
        self.dense = Linear(self.q_size, config.hidden_size)
        # The slopes are plain CPU data, even while the model is built on the meta device.
        with torch.device("cpu"):
            slopes = alibi_slopes(self.num_heads)
        self.attn = PagedAttention(
            self.num_heads,
            self.head_dim,
            self.num_heads,
            scale=self.head_dim**-0.5,
            alibi_slopes=slopes,
        )

    def forward(
        self, hidden: torch.Tensor, kv_cache: torch.Tensor, meta: PagedAttentionInputMetadata
    ) -> torch.Tensor:
        q, k, v = self.query_key_value(hidden).split(self.q_size, dim=-1)
        out = self.attn(q.contiguous(), k.contiguous(), v.contiguous(), kv_cache, meta)
        return self.dense(out)


class BloomMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.dense_h_to_4h = Linear(config.hidden_size, config.intermediate_size)
        self.dense_4h_to_h = Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x), approximate="tanh"))


class BloomDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.self_attention = BloomAttention(config)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = BloomMLP(config)

    def forward(
        self, hidden: torch.Tensor, kv_cache: torch.Tensor, meta: PagedAttentionInputMetadata
    ) -> torch.Tensor:
        # Residuals are taken before each LayerNorm (apply_residual_connection_post_layernorm
        # is False in every released Bloom).
        hidden = hidden + self.self_attention(self.input_layernorm(hidden), kv_cache, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class BloomForCausalLM(CausalLM):
    # Hugging Face module prefixes -> ours (everything below a layer keeps its HF name).
    renames = (
        ("transformer.word_embeddings_layernorm.", "embed_tokens.layernorm."),
        ("transformer.word_embeddings.", "embed_tokens."),
        ("transformer.h.", "layers."),
        ("transformer.ln_f.", "norm."),
    )

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.num_key_value_heads != config.num_attention_heads:
            raise ValueError("bloom uses multi-head attention: num_key_value_heads must equal "
                             "num_attention_heads")
        self.config = config
        self.embed_tokens = BloomEmbedding(config)
        self.layers = nn.ModuleList(BloomDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

    # The three stages (models/base.py); the state is (hidden,).
    def embed(self, input_ids: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.embed_tokens(input_ids),)

    def run_layers(self, layers: range, state: tuple, kv_caches: list[torch.Tensor],
                   meta: PagedAttentionInputMetadata) -> tuple[torch.Tensor]:
        (hidden,) = state
        for i in layers:
            hidden = self.layers[i](hidden, kv_caches[i], meta)
        return (hidden,)

    def final_norm(self, state: tuple) -> torch.Tensor:
        return self.norm(state[0])

    def weight_target(self, name: str) -> tuple[str, int | None]:
        if not name.startswith("transformer."):
            return name, None  # lm_head.weight of an untied head
        for hf, ours in self.renames:
            if name.startswith(hf):
                return ours + name.removeprefix(hf), None
        return name, None  # unknown: reported as unexpected

    def convert_weight(self, param_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Bloom stores qkv rows per head as [q_h, k_h, v_h]; ours are [q | k | v]."""
        if ".query_key_value." not in param_name:
            return tensor
        c = self.config
        per_head = tensor.reshape(c.num_attention_heads, 3, c.head_dim, *tensor.shape[1:])
        return per_head.transpose(0, 1).reshape(tensor.shape)
