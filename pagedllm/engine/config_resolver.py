"""resolve_config: what the engine's arguments mean before any worker exists or any weight
loads (the model's config from its header or config.json, the context, the stop tokens),
and the engine's tokenizer, loaded by rank 0 alone: a tensor-parallel rank > 0 gets rank
0's EngineConfig and never reads a tokenizer."""
from __future__ import annotations

import os
from dataclasses import replace

from pagedllm.config import EngineConfig
from pagedllm.distributed.parallel_state import torchrun_env
from pagedllm.engine_args import EngineArgs
from pagedllm.loader import load_model_source, load_tokenizer

# As vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN: a context longer than the model's positions
# (a rope-scaled model the config undersells); past them, outputs may be garbage.
ALLOW_LONG_MAX_MODEL_LEN = "PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN"


def resolve_max_model_len(requested: int | None, model_max: int) -> int:
    """The context length: the model's own by default; a longer request is an error naming
    both numbers unless ALLOW_LONG_MAX_MODEL_LEN=1 is set in the environment."""
    if requested is None:
        return model_max
    if requested > model_max and os.environ.get(ALLOW_LONG_MAX_MODEL_LEN) != "1":
        raise ValueError(
            f"--max-model-len {requested} is longer than the model's {model_max} positions "
            f"(max_position_embeddings); set {ALLOW_LONG_MAX_MODEL_LEN}=1 to allow it anyway")
    return requested


def resolve_config(args: EngineArgs) -> EngineConfig:
    """The model's config (no weights, no tokenizer read), the context checked against the
    model's positions, and the config's stop tokens."""
    source = load_model_source(args.model, args.load_format, args.tokenizer,
                               with_tokenizer=False)
    config = source.config
    max_model_len = resolve_max_model_len(args.max_model_len, config.max_position_embeddings)
    if max_model_len > config.max_position_embeddings:  # allowed by the override
        config = replace(config, max_position_embeddings=max_model_len)
    return EngineConfig(
        model_config=config, source_name=source.name, source_path=source.path,
        tokenizer_path=source.tokenizer_path, max_model_len=max_model_len,
        eos_token_ids=tuple(sorted(set(config.eos_token_ids))))


def loads_tokenizer() -> bool:
    """Whether this process runs the engine's front: not a torchrun rank other than 0."""
    env = torchrun_env()
    return env is None or env[1] == 0


def load_engine_tokenizer(config: EngineConfig):
    """Rank 0's tokenizer (None: the model has none, or this is a rank > 0), and the config
    with the tokenizer's EOS among the stop tokens."""
    if config.tokenizer_path is None or not loads_tokenizer():
        return None, config
    tokenizer = load_tokenizer(config.tokenizer_path)
    eos = set(config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return tokenizer, replace(config, eos_token_ids=tuple(sorted(eos)))
