"""Our models vs transformers, fp32 on CPU, for a tiny random config of each family."""
from __future__ import annotations

import pytest
import torch
import transformers

from pagedllm.loader import load_model_source
from pagedllm.models.registry import build_model
from tests.paged_helpers import assert_matches_transformers

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    rms_norm_eps=1e-6, tie_word_embeddings=False,
)
FAMILIES = {
    "llama": (transformers.LlamaConfig, dict(rope_theta=10000.0)),
    "mistral": (transformers.MistralConfig, dict(sliding_window=8)),  # shorter than the prompts
    "qwen2": (transformers.Qwen2Config, dict()),
    "qwen3": (transformers.Qwen3Config, dict()),
}
PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 200, 31, 64, 12, 1, 90, 91, 92, 13, 77, 150, 2, 33],
           [101, 102, 9, 250, 6, 6, 6, 48, 19, 203, 11]]


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request, tmp_path_factory):
    cls, extra = FAMILIES[request.param]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cls(**TINY, **extra), dtype=torch.float32)
    hf.eval()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, safe_serialization=True)
    source = load_model_source(str(path))
    assert source.config.architecture == request.param
    ours = build_model(source.config)
    ours.load_weights(source.iter_weights(torch.float32))
    ours.eval()
    return hf, ours, source.config


def test_prefill_and_paged_decode_match_transformers(pair):
    hf, ours, config = pair
    assert_matches_transformers(hf, ours, config, PROMPTS)
