"""layers/norm_fold.py: a one-row step with the RMSNorms folded into the GEMVs gives the
hidden states of the step with its norm kernels, runs two norm kernels in all (the first
layer's input norm and the final norm), and a step of two rows does not fold.

Every layer runs through Triton (its interpreter on the CPU) in fp16, as CUDA runs it."""
from __future__ import annotations

import pytest
import torch

from tests.triton_setup import DEVICE, skip_unless_runnable

from pagedllm.config import ModelConfig  # noqa: E402
from pagedllm.kernels import triton_gemv  # noqa: E402
from pagedllm.kernels.metadata import PagedAttentionInputMetadata  # noqa: E402
from pagedllm.layers import dispatch, norm_fold  # noqa: E402
from pagedllm.loader import initialize_dummy_weights  # noqa: E402
from pagedllm.models.registry import build_model  # noqa: E402

skip_unless_runnable(triton_gemv._skinny_kernel)
BLOCK_SIZE = 4


@pytest.fixture(autouse=True)
def fold_on(monkeypatch):
    """On (the default), whatever PAGEDLLM_FOLD_NORMS says in the environment."""
    monkeypatch.setattr(norm_fold, "ENABLED", True)


def tiny_model(**overrides):
    config = ModelConfig(architecture="llama", vocab_size=97, hidden_size=64,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=96, max_position_embeddings=64, **overrides)
    with dispatch.force("triton"):
        model = build_model(config)
        initialize_dummy_weights(model, seed=5)
        model = model.to(device=DEVICE, dtype=torch.float16).eval()
        dispatch.select(model)
    return model, config


def run_step(model, config, ids: list[int], seq_lens: list[int], fold: bool):
    """One decode step of len(ids) sequences over random caches (the same every call)."""
    g = torch.Generator().manual_seed(0)
    shape = (2, 16, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
    caches = [torch.randn(shape, generator=g).to(DEVICE, torch.float16)
              for _ in range(config.num_hidden_layers)]
    tables = [[3 * i, 3 * i + 1, 3 * i + 2] for i in range(len(ids))]
    positions = [n - 1 for n in seq_lens]
    slots = [t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for t, p in zip(tables, positions)]
    meta = PagedAttentionInputMetadata.build(positions, slots, [1] * len(ids), seq_lens, tables,
                                             device=DEVICE)
    model.folds_norms = fold and type(model).folds_norms.func(model)
    model.folds_rope = type(model).folds_rope.func(model)
    with torch.inference_mode():
        return model(torch.tensor(ids, device=DEVICE), caches, {next(model.parameters()).device: meta}), caches


def count_calls(monkeypatch, name: str) -> list[int]:
    """A counter of the Triton backend's method `name`."""
    calls = [0]
    backend = dispatch.BACKENDS["triton"]
    original = getattr(backend, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(backend, name, counted)
    return calls


def count_norms(monkeypatch) -> list[int]:
    return count_calls(monkeypatch, "rms_norm")


# Plain Llama (qkv folds the rotary embedding and cache write too), with a qkv bias (added
# inside the fold), with the rope fold switched off, and Qwen3-like q/k norms (no rope fold:
# the norms fold into the rotary and cache write kernel instead, unless that is switched off).
CASES = {"llama": ({}, True, True), "bias": ({"attention_bias": True}, True, True),
         "rope off": ({}, False, True),
         "qk norms": ({"qk_norm": True, "attention_bias": True}, True, True),
         "qk norms as kernels": ({"qk_norm": True, "attention_bias": True}, True, False)}


@pytest.mark.parametrize("case", CASES)
def test_one_row_folds_and_matches_the_norm_kernels(monkeypatch, case):
    overrides, rope_on, fold_qk_norm = CASES[case]
    monkeypatch.setattr(norm_fold, "ROPE", rope_on)
    monkeypatch.setattr(dispatch, "FOLD_QK_NORM", fold_qk_norm)
    model, config = tiny_model(**overrides)
    assert type(model).folds_norms.func(model)
    folds_rope = rope_on and not overrides.get("qk_norm")
    assert type(model).folds_rope.func(model) == folds_rope
    calls, rotary = count_norms(monkeypatch), count_calls(monkeypatch, "rotary_paged_attention")
    want, want_caches = run_step(model, config, [11], [7], fold=False)
    unfolded, unfolded_rotary = calls[0], rotary[0]
    got, got_caches = run_step(model, config, [11], [7], fold=True)
    folded, folded_rotary = calls[0] - unfolded, rotary[0] - unfolded_rotary
    layers = config.num_hidden_layers
    per_head = 2 if overrides.get("qk_norm") and not fold_qk_norm else 0  # q and k norms
    assert unfolded == 2 * layers + 1 + per_head * layers
    assert folded == 2 + per_head * layers
    assert unfolded_rotary == layers and folded_rotary == (0 if folds_rope else layers)
    # fp16: the folded path rounds h * g once where the kernels round norm(h), then * g
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    for a, b in zip(got_caches, want_caches):  # the K/V this step wrote
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_two_rows_do_not_fold(monkeypatch):
    model, config = tiny_model()
    calls = count_norms(monkeypatch)
    run_step(model, config, [11, 12], [7, 5], fold=True)
    assert calls[0] == 2 * config.num_hidden_layers + 1


def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setattr(norm_fold, "ENABLED", False)
    model, _ = tiny_model()
    assert not model.folds_norms


def test_fp32_weights_cpu_kernels_and_other_steps_do_not_fold():
    config = ModelConfig(architecture="llama", vocab_size=97, hidden_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=96)
    model = build_model(config)  # fp32, the CPU backend
    assert not model.folds_norms
    with dispatch.force("triton"):
        dispatch.select(model)
    assert not type(model).folds_norms.func(model)  # fp32 weights: no skinny kernel
    model.to(torch.bfloat16)
    assert type(model).folds_norms.func(model)
    assert norm_fold.folds(torch.zeros(1, 64, dtype=torch.bfloat16))
    assert not norm_fold.folds(torch.zeros(1, 64))
    assert not norm_fold.folds(torch.zeros(2, 64, dtype=torch.bfloat16))


def test_qk_norms_folded_into_the_rotary_kernel_match_their_kernels(monkeypatch):
    """Qwen3's q and k norms inside the rotary and cache write kernel (dispatch.FOLD_QK_NORM)
    give the hidden states and cached K/V of their own kernels, over two rows (no GEMV
    fold), with two fewer norm kernels a layer."""
    model, config = tiny_model(qk_norm=True)
    calls = count_norms(monkeypatch)
    monkeypatch.setattr(dispatch, "FOLD_QK_NORM", False)
    want, want_caches = run_step(model, config, [11, 12], [7, 5], fold=True)
    as_kernels = calls[0]
    monkeypatch.setattr(dispatch, "FOLD_QK_NORM", True)
    got, got_caches = run_step(model, config, [11, 12], [7, 5], fold=True)
    assert as_kernels - (calls[0] - as_kernels) == 2 * config.num_hidden_layers
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    for a, b in zip(got_caches, want_caches):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
