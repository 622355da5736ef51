"""Bloom (ALiBi) vs transformers, fp32 on CPU, through the paged KV cache."""
from __future__ import annotations

import pytest
import torch
import transformers

from pagedllm.loader import load_model_source
from pagedllm.models.registry import build_model
from tests.paged_helpers import PagedRunner, assert_matches_transformers

# 4 heads is the tiny config; 6 heads exercises ALiBi's slopes for a head count that is not a
# power of two (the extra interleaved slopes).
CONFIGS = {
    "4heads": dict(hidden_size=64, n_head=4),
    "6heads": dict(hidden_size=96, n_head=6),
}
PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 200, 31, 64, 12, 1, 90, 91, 92, 13, 77, 150, 2, 33],
           [101, 102, 9, 250, 6, 6, 6, 48, 19, 203, 11]]


def tiny_bloom(path, **shape):
    torch.manual_seed(0)
    config = transformers.BloomConfig(vocab_size=256, n_layer=2, **shape)
    hf = transformers.BloomForCausalLM(config).to(torch.float32).eval()
    # Bloom initialises LayerNorms to (1, 0) and biases to 0: randomise them, so a wrong
    # mapping of any of them shows in the logits.
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "layernorm" in name or "ln_f" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(path, safe_serialization=True)
    return hf


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"bloom-{request.param}")
    hf = tiny_bloom(path, **CONFIGS[request.param])
    source = load_model_source(str(path))
    assert source.config.architecture == "bloom"
    ours = build_model(source.config)
    ours.load_weights(source.iter_weights(torch.float32))
    ours.eval()
    return hf, ours, source.config


def test_prefill_and_paged_decode_match_transformers(pair):
    hf, ours, config = pair
    assert_matches_transformers(hf, ours, config, PROMPTS)


def test_head_is_tied_to_the_embedding(pair):
    _, ours, _ = pair
    assert ours.lm_head is None
    hidden = torch.randn(3, ours.config.hidden_size)
    expected = hidden @ ours.embed_tokens.weight.T
    assert torch.allclose(ours.compute_logits(hidden), expected)


def test_builds_on_meta_device(pair):
    _, _, config = pair
    with torch.device("meta"):
        model = build_model(config)
    assert all(p.device.type == "meta" for p in model.parameters())
    # Moving the listed parts covers every parameter (what the Worker does).
    for layer in model.layers:
        layer.to_empty(device="cpu")
    model.embed_tokens.to_empty(device="cpu")
    model.norm.to_empty(device="cpu")
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert model.layer_device(0) == torch.device("cpu")


def _weights(pair):
    hf, _, _ = pair
    return [(n, t.detach().clone()) for n, t in hf.state_dict().items() if n != "lm_head.weight"]


def test_missing_weight_is_reported(pair):
    _, _, config = pair
    weights = [(n, t) for n, t in _weights(pair) if n != "transformer.ln_f.bias"]
    with pytest.raises(ValueError, match=r"checkpoint is missing weights: norm\.bias"):
        build_model(config).load_weights(weights)


def test_unexpected_weight_is_reported(pair):
    _, _, config = pair
    weights = _weights(pair) + [("transformer.h.9.mlp.extra.weight", torch.zeros(1))]
    with pytest.raises(ValueError, match=r"unexpected weight 'transformer\.h\.9\.mlp\.extra\.weight'"):
        build_model(config).load_weights(weights)


def test_wrong_shape_is_reported(pair):
    _, _, config = pair
    weights = [(n, t[:-1] if n == "transformer.ln_f.weight" else t) for n, t in _weights(pair)]
    with pytest.raises(ValueError, match=r"weight 'transformer\.ln_f\.weight' has shape"):
        build_model(config).load_weights(weights)


@torch.no_grad()
def test_untied_head_is_loaded(tmp_path):
    hf = tiny_bloom(tmp_path, hidden_size=64, n_head=4, tie_word_embeddings=False)
    with torch.no_grad():
        hf.lm_head.weight.copy_(torch.randn_like(hf.lm_head.weight) * 0.02)  # differ from embedding
    hf.save_pretrained(tmp_path, safe_serialization=True)
    source = load_model_source(str(tmp_path))
    assert not source.config.tie_word_embeddings
    ours = build_model(source.config)
    ours.load_weights(source.iter_weights(torch.float32))
    assert ours.lm_head is not None
    runner = PagedRunner(ours.eval(), source.config, num_blocks=16, block_size=4)
    logits = runner.step({0: PROMPTS[1]})
    assert (logits - hf(torch.tensor([PROMPTS[1]])).logits[0]).abs().max().item() <= 1e-4
