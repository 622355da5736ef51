"""Bloom: ALiBi attention (no rotary), LayerNorms with bias, a LayerNorm right after the
embedding, GELU MLP and a head tied to the embedding.

Same interface as pagedllm/models/llama.py, so the Worker places and loads it the same way.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.kernels.reference import alibi_slopes
from pagedllm.layers.attention import PagedAttention
from pagedllm.layers.linear import Linear, compute_logits
from pagedllm.kernels.metadata import PagedAttentionInputMetadata
from pagedllm.worker.device_map import DeviceMap

MetadataByGroup = (
    list[PagedAttentionInputMetadata] | dict[torch.device, PagedAttentionInputMetadata]
)


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


class BloomForCausalLM(nn.Module):
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

    # Device placement: the embedding sits with the first layer, norm and head with the last.
    def layer_device(self, i: int) -> torch.device:
        return self.layers[i].input_layernorm.weight.device

    # Set by the Worker; None: one group per run of layers whose weights share a device.
    device_map: DeviceMap | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: MetadataByGroup,
    ) -> torch.Tensor:
        """metadata: one per device group (DeviceMap.distribute), or keyed by device."""
        device_map = self.device_map or DeviceMap.from_layer_devices(
            [self.layer_device(i) for i in range(len(self.layers))]
        )
        return device_map.run_model(self, input_ids, kv_caches, metadata)

    # The stages DeviceMap.run_model runs; the state is (hidden,).
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

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return compute_logits(self, hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors, reordering the fused qkv as they arrive."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            target = self._target(name)
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} for {self.config.architecture}")
            param = params[target]
            if param.shape != tensor.shape:
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(param.shape)}"
                )
            if ".query_key_value." in target:
                tensor = self._split_heads_qkv(tensor)
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(target)
        missing = [n for n in params if n not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:5])}")

    def _target(self, name: str) -> str:
        if not name.startswith("transformer."):
            return name  # lm_head.weight of an untied head
        for hf, ours in self.renames:
            if name.startswith(hf):
                return ours + name.removeprefix(hf)
        return name  # unknown: reported as unexpected

    def _split_heads_qkv(self, tensor: torch.Tensor) -> torch.Tensor:
        """Bloom stores qkv rows per head as [q_h, k_h, v_h]; ours are [q | k | v]."""
        c = self.config
        per_head = tensor.reshape(c.num_attention_heads, 3, c.head_dim, *tensor.shape[1:])
        return per_head.transpose(0, 1).reshape(tensor.shape)
