"""Seeded random-weight Llamas saved with transformers' save_pretrained and loaded like any
checkpoint, and the greedy runs the CUDA tests compare."""
from __future__ import annotations

import gc
import json
from pathlib import Path

import torch

SMOLLM2_SHAPE = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
    tie_word_embeddings=True, max_position_embeddings=2048, rms_norm_eps=1e-5,
    bos_token_id=1, eos_token_id=2,
)


# A Qwen3-shaped model (per-head q and k norms) small enough for a fast CUDA-vs-CPU check.
QWEN3_SHAPE = dict(
    vocab_size=49152, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, rope_theta=1000000.0,
    tie_word_embeddings=True, max_position_embeddings=2048, rms_norm_eps=1e-6,
    bos_token_id=1, eos_token_id=2,
)


def save_random_model(folder: str | Path, shape: dict, seed: int = 0,
                      architecture: str = "llama") -> None:
    """architecture: "llama" or "qwen3" (transformers' classes of that name)."""
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[architecture]
    config = config_cls(**shape)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    model.save_pretrained(folder)
    saved = json.loads((Path(folder) / "config.json").read_text())
    theta = saved.get("rope_theta") or (saved.get("rope_parameters") or {}).get("rope_theta")
    assert theta == shape["rope_theta"], f"saved config lost rope_theta: {saved}"


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def compare(a: dict, b: dict) -> dict:
    """How far two runs' greedy tokens agree: identical sequences and tokens, and the largest
    cumulative-logprob difference among identical sequences."""
    pairs = list(zip(a["tokens"], b["tokens"]))
    same_seqs = sum(x == y for x, y in pairs)
    same_tokens = sum(p == q for x, y in pairs for p, q in zip(x, y))
    total = sum(len(x) for x, _ in pairs)
    diffs = [abs(p - q) for (x, y), p, q in zip(pairs, a["cumulative_logprob"],
                                                 b["cumulative_logprob"]) if x == y]
    return {"identical_seqs": f"{same_seqs}/{len(pairs)}",
            "identical_tokens": f"{same_tokens}/{total}", "ok": same_seqs == len(pairs),
            "max_abs_dlogprob": max(diffs, default=float("nan"))}
