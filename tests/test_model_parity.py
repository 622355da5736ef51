"""Our models vs transformers, fp32 on CPU, for a tiny random config of each family."""
from __future__ import annotations

import pytest
import torch
import transformers

from pagedllm.loader import load_model_source
from pagedllm.models.registry import build_model
from tests.paged_helpers import PagedRunner

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


@torch.no_grad()
def test_prefill_and_paged_decode_match_transformers(pair):
    hf, ours, config = pair
    runner = PagedRunner(ours, config, num_blocks=64, block_size=4)
    # Prefill both prompts in one flat batch.
    logits = runner.step({i: p for i, p in enumerate(PROMPTS)})
    offset = 0
    pasts, nexts = [], []
    for prompt in PROMPTS:
        ref = hf(torch.tensor([prompt]), use_cache=True)
        ours_logits = logits[offset: offset + len(prompt)]
        offset += len(prompt)
        assert (ours_logits - ref.logits[0]).abs().max().item() <= 1e-4
        pasts.append(ref.past_key_values)
        nexts.append(int(ref.logits[0, -1].argmax()))
    # 16 greedy decode steps through the paged cache, both sequences in each step.
    for _ in range(16):
        logits = runner.step({i: [t] for i, t in enumerate(nexts)})
        for i in range(len(PROMPTS)):
            ref = hf(torch.tensor([[nexts[i]]]), past_key_values=pasts[i], use_cache=True)
            assert (logits[i] - ref.logits[0, -1]).abs().max().item() <= 1e-4
            pasts[i] = ref.past_key_values
            nexts[i] = int(ref.logits[0, -1].argmax())
    # The sequences really spanned many scattered blocks.
    assert all(len(t) >= 7 for t in runner.tables.values())
