"""The Llama family: Llama 2/3 and SmolLM2, Mistral (sliding window), Qwen2 (qkv bias),
Qwen3 (per-head q/k RMSNorm). One module; the config switches the differences on.

The forward takes a flat batch of tokens from many sequences and reads/writes the paged KV
cache of each layer (see pagedllm/layers/metadata.py).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.layers.activation import silu_and_mul
from pagedllm.layers.attention import PagedAttention
from pagedllm.layers.gguf_linear import PackedWeight
from pagedllm.layers.linear import Linear, compute_logits
from pagedllm.layers.metadata import PagedAttentionInputMetadata
from pagedllm.layers.norms import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.worker.device_map import DeviceMap

MetadataByGroup = (
    list[PagedAttentionInputMetadata] | dict[torch.device, PagedAttentionInputMetadata]
)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.rotary = [rotary]  # a list: shared by all layers, not a registered submodule
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
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary[0](meta.positions, q, k, meta)
        out = self.attn(q, k, v.contiguous(), kv_cache, meta)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, rotary)
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


class LlamaForCausalLM(nn.Module):
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
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, rotary) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
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

    # The three stages DeviceMap.run_model (and each device group's CUDA graph) runs. The
    # state between layers is (hidden, residual); residual is None before the first layer.
    def embed(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.embed_tokens(input_ids), None

    def run_layers(self, layers: range, state: tuple, kv_caches: list[torch.Tensor],
                   meta: PagedAttentionInputMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = state
        for i in layers:
            hidden, residual = self.layers[i](hidden, residual, kv_caches[i], meta)
        return hidden, residual

    def final_norm(self, state: tuple) -> torch.Tensor:
        hidden, residual = state
        return self.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return compute_logits(self, hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors, fusing q/k/v and gate/up as they arrive."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            target, shard = self._target(name)
            if isinstance(tensor, PackedWeight):  # GGUF blocks kept packed
                self.get_submodule(target.removesuffix(".weight")).load_packed(shard or 0, tensor)
                continue
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} for {self.config.architecture}")
            param = params[target]
            with torch.no_grad():
                if shard is None:
                    if param.shape != tensor.shape:
                        raise ValueError(
                            f"weight {name!r} has shape {tuple(tensor.shape)}, "
                            f"expected {tuple(param.shape)}"
                        )
                    param.copy_(tensor)
                else:
                    start, size = self._shard_range(target, shard)
                    param.narrow(0, start, size).copy_(tensor)
            loaded.add(f"{target}#{shard}")
        missing = [n for n in self._expected_weights() if n not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:5])}")

    def _target(self, name: str) -> tuple[str, int | None]:
        for hf, (ours, shard) in self.packed_weights.items():
            if f".{hf}." in name:
                return name.replace(f".{hf}.", f".{ours}."), shard
        return name, None

    def _shard_range(self, target: str, shard: int) -> tuple[int, int]:
        c = self.config
        if "qkv_proj" in target:
            q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
            return [(0, q), (q, kv), (q + kv, kv)][shard]
        return shard * c.intermediate_size, c.intermediate_size

    def _expected_weights(self) -> list[str]:
        names = []
        for name, _ in self.named_parameters():
            if ".qkv_proj." in name:
                names += [f"{name}#{i}" for i in range(3)]
            elif ".gate_up_proj." in name:
                names += [f"{name}#{i}" for i in range(2)]
            else:
                names.append(f"{name}#None")
        return names
