"""layers/dispatch.py: one backend per layer, picked from its weights' device and dtype when
the model is placed; `force` is the one seam tests route layers through."""
from __future__ import annotations

import torch

from pagedllm.config import ModelConfig
from pagedllm.layers import dispatch
from pagedllm.layers.dispatch import Dispatched
from pagedllm.layers.norms import RMSNorm
from pagedllm.models.registry import build_model

CONFIG = ModelConfig(architecture="llama", vocab_size=50, hidden_size=32, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                     qk_norm=True)


def backends(module: torch.nn.Module) -> set[str]:
    return {m.backend.name for m in module.modules() if isinstance(m, Dispatched)}


def test_choose_by_device_and_dtype():
    assert dispatch.choose(torch.device("cuda", 1), torch.bfloat16).name == "triton"
    assert dispatch.choose("cpu", torch.float32).name == "cpu"
    assert dispatch.choose("cpu", torch.bfloat16).name == "torch"
    assert dispatch.choose("meta", torch.float32).name == "torch"


def test_select_gives_each_layer_the_backend_of_its_weights():
    model = build_model(CONFIG)
    assert backends(model) == {"cpu"}
    model.layers[1].to(torch.bfloat16)
    dispatch.select(model)
    # Every dispatched module of layer 1 (the attention and activation, which have no weights
    # of their own, too) follows the layer's bf16 weights; the others keep the CPU backend.
    assert backends(model.layers[1]) == {"torch"}
    assert len([m for m in model.layers[1].modules() if isinstance(m, Dispatched)]) == 7
    assert backends(model.layers[0]) == backends(model.layers[2]) == backends(model.norm) == {"cpu"}


def test_force_routes_layers_built_or_selected_inside():
    with dispatch.force("torch"):
        norm = RMSNorm(8)
        model = build_model(CONFIG)
    assert norm.backend.name == "torch" and backends(model) == {"torch"}
    assert RMSNorm(8).backend.name == "cpu"  # the seam is gone once the block ends
    with dispatch.force("triton"):
        dispatch.select(model)
    assert backends(model) == {"triton"}
    dispatch.select(model)
    assert backends(model) == {"cpu"}
