"""Configuration dataclasses: what the model is, how the cache and scheduler behave."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "bloom")

# --dtype: "auto" is float32 on the CPU and bfloat16 on CUDA (see resolve_dtype).
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")
PREEMPTION_MODES = ("recompute", "swap")
QUANTIZATIONS = ("gguf", "fp8")  # worker/quantization.py
# --kv-cache-dtype (vLLM's values): auto keeps the model's dtype; fp8 and fp8_e4m3 store the
# paged KV cache as float8_e4m3fn with a scale of 1.0 (CUDA only; worker/cache_engine.py).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
CPU_ACTIVATIONS = ("fp32", "int8")  # layers/gguf_linear.py (PackedMatrix.int8_activations)

# Hugging Face `architectures[0]` / `model_type` -> our architecture name.
HF_ARCHITECTURE_NAMES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "BloomForCausalLM": "bloom",
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "bloom": "bloom",
}


@dataclass
class ModelConfig:
    """The shape of a decoder-only transformer, named as in Hugging Face configs."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int = 0
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm on q and k per head (Qwen3)
    sliding_window: int | None = None  # Mistral: a query sees at most this many keys
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face config.json dict."""
        names = list(hf.get("architectures") or []) + [hf.get("model_type", "")]
        arch = next((HF_ARCHITECTURE_NAMES[n] for n in names if n in HF_ARCHITECTURE_NAMES), None)
        if arch is None:
            shown = ", ".join(n for n in names if n) or "none given"
            raise ValueError(
                f"unsupported architecture ({shown}); supported: "
                f"{', '.join(sorted(k for k in HF_ARCHITECTURE_NAMES if k[0].isupper()))}"
            )
        if arch == "bloom":
            return cls(
                architecture="bloom",
                vocab_size=hf["vocab_size"],
                hidden_size=hf.get("hidden_size", hf.get("n_embed")),
                num_hidden_layers=hf.get("n_layer", hf.get("num_hidden_layers")),
                num_attention_heads=hf.get("n_head", hf.get("num_attention_heads")),
                intermediate_size=4 * hf.get("hidden_size", hf.get("n_embed")),
                rms_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
                hidden_act="gelu",
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=_as_list(hf.get("eos_token_id")),
                max_position_embeddings=hf.get("seq_length", 2048),
            )
        sliding = hf.get("sliding_window") if arch == "mistral" or hf.get("use_sliding_window") else None
        rope_theta = hf.get("rope_theta")
        rope_scaling = hf.get("rope_scaling")
        rope_params = hf.get("rope_parameters") or {}
        if rope_theta is None:
            rope_theta = rope_params.get("rope_theta", 10000.0)
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = dict(rope_params)
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=hf["num_attention_heads"],
            num_key_value_heads=hf.get("num_key_value_heads"),
            head_dim=hf.get("head_dim"),
            intermediate_size=hf["intermediate_size"],
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
            sliding_window=sliding,
            hidden_act=hf.get("hidden_act", "silu"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_as_list(hf.get("eos_token_id")),
        )

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [int(value)]


def resolve_dtype(name: str, device: Any) -> Any:
    """The torch dtype a --dtype name stands for on `device` (a torch.device or its name)."""
    import torch  # here, so that reading the options (`pagedllm --help`) needs no torch

    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return getattr(torch, name)


@dataclass(frozen=True)
class EngineConfig:
    """What is known before any worker exists or any weight loads (resolve_config in
    engine/config_resolver.py): the model, its context, its stop tokens. Picklable: a
    tensor-parallel rank gets rank 0's. The rest (KV blocks, batch limits sized by the GPU)
    comes back from the worker (contract.WorkerInfo)."""

    model_config: ModelConfig  # max_position_embeddings raised to an allowed longer context
    source_name: str  # the model's name, as the server answers to it by default
    source_path: str | None  # the file or directory it came from; None for dummy presets
    tokenizer_path: str | None  # the user's override, else the model's own; None: none
    max_model_len: int
    # The config's stop tokens, and the tokenizer's EOS once rank 0 has loaded it.
    eos_token_ids: tuple[int, ...]


@dataclass
class CacheConfig:
    """What the block manager needs (the memory options are the Worker's: EngineArgs)."""

    block_size: int = 16
    enable_prefix_caching: bool = True


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"  # or "swap"

    def __post_init__(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}"
            )
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "max_num_batched_tokens must be at least max_model_len without chunked prefill"
            )


SPECULATIVE_METHODS = ("ngram", "draft_model")
_SPEC_KEYS = {
    "ngram": {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
              "disable_by_batch_size"},
    "draft_model": {"method", "model", "num_speculative_tokens", "disable_by_batch_size",
                    "load_format", "seed"},
}


@dataclass
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config` names): each decode step proposes
    `num_speculative_tokens` tokens per sequence, the target model scores them in one
    forward, and the standard rule keeps a prefix of them plus one token of the target's.

    method "ngram": prompt lookup; the proposal is what followed the latest earlier match
    of the sequence's last n tokens, n from prompt_lookup_max down to prompt_lookup_min.
    method "draft_model": `model` (a path, hub id or preset; `load_format`, `seed` as for
    the target) proposes greedily for greedy requests, by sampling otherwise.
    disable_by_batch_size: no speculation in a step with more running sequences than this;
    default 32 on CUDA, 8 on the CPU (past them the k+1 rows per sequence make the step
    compute-bound and speculation stops paying: README, "Speculative decoding").
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None
    load_format: str = "auto"
    seed: int = 0
    disable_by_batch_size: int | None = None

    @classmethod
    def from_dict(cls, value: Any) -> "SpeculativeConfig":
        """From a dict or a JSON object string (the --speculative-config flag)."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict (or a JSON object), got "
                             f"{type(value).__name__}")
        method = value.get("method")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: method must be one of "
                             f"{', '.join(map(repr, SPECULATIVE_METHODS))}, got {method!r}")
        unknown = sorted(set(value) - _SPEC_KEYS[method])
        if unknown:
            raise ValueError(f"speculative_config: unknown key {unknown[0]!r} for method "
                             f"{method!r}; known: {', '.join(sorted(_SPEC_KEYS[method]))}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config: num_speculative_tokens is required")
        return cls(**value)

    def __post_init__(self) -> None:
        def positive(name: str, v: Any) -> None:
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, "
                                 f"got {v!r}")

        positive("num_speculative_tokens", self.num_speculative_tokens)
        if self.method == "ngram":
            positive("prompt_lookup_min", self.prompt_lookup_min)
            positive("prompt_lookup_max", self.prompt_lookup_max)
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise ValueError(
                    f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) is more "
                    f"than prompt_lookup_max ({self.prompt_lookup_max})")
        elif self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ValueError("speculative_config: method 'draft_model' needs 'model' (a "
                                 "path, hub id or preset of the draft model)")
            if self.load_format not in LOAD_FORMATS:
                raise ValueError(f"speculative_config: load_format must be one of "
                                 f"{', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        else:
            raise ValueError(f"speculative_config: method must be one of "
                             f"{', '.join(map(repr, SPECULATIVE_METHODS))}, got {self.method!r}")
        if self.disable_by_batch_size is not None:
            positive("disable_by_batch_size", self.disable_by_batch_size)


# The batch limits when the user sets neither, by the device (as vLLM v1's defaults): a GPU
# with this much memory or more runs bigger batches; below it, and on the CPU, the others.
# On the CPU, prompt batches of 2048 tokens keep the GEMMs near their best rate.
LARGE_GPU_BYTES = 70 << 30
BATCH_LIMITS = {"large_gpu": (1024, 16384), "gpu": (256, 8192), "cpu": (256, 2048)}


def default_batch_limits(device_type: str, device_memory: int | None) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) for a device of `device_type` ("cuda" |
    "cpu") with `device_memory` bytes (a GPU's total; None on the CPU)."""
    if device_type != "cuda":
        return BATCH_LIMITS["cpu"]
    large = device_memory is not None and device_memory >= LARGE_GPU_BYTES
    return BATCH_LIMITS["large_gpu" if large else "gpu"]


def bound_by_cache(max_num_seqs: int, max_num_batched_tokens: int, num_blocks: int,
                   block_size: int, floor_tokens: int) -> tuple[int, int]:
    """Default limits no larger than the KV cache holds: a running sequence holds a block
    at least, and a step's tokens are all in the cache (never under `floor_tokens`, the
    context a step must take whole without chunked prefill)."""
    return (max(1, min(max_num_seqs, num_blocks)),
            max(floor_tokens, min(max_num_batched_tokens, num_blocks * block_size)))
