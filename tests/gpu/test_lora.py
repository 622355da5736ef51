"""LoRA on CUDA: the Triton shrink/expand pair against the torch path at Llama-3-8B's
projection shapes (bf16), and greedy output of a SmolLM2-shaped random model under adapters with the
kernels vs with the torch path (`pagedllm bench lora` times them)."""
from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.benchmarks.lora_bench import write_adapter
from pagedllm.layers import lora as lora_layer
from tests.paged_helpers import NEAR_TIE_ACROSS_BATCH_SHAPES, assert_same_greedy

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("k,parts", [(4096, [4096, 1024, 1024]), (4096, [14336, 14336]),
                                     (14336, [4096])])
def test_kernels_match_the_torch_path(k, parts):
    from pagedllm.kernels.triton_lora import lora_expand, lora_shrink

    g = torch.Generator(device="cuda").manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    lora_a = [torch.randn(4, 16, k, generator=g, device=dev, dtype=dt) * 0.02 for _ in parts]
    lora_b = [torch.randn(4, n, 16, generator=g, device=dev, dtype=dt) * 0.02 for n in parts]
    layer = lora_layer.LoRALayer(lora_a, lora_b)
    layer.active = [[True] * len(parts) for _ in range(4)]
    slots = torch.tensor([(i % 5) - 1 for i in range(37)])  # base rows and all 4 slots
    x = torch.randn(len(slots), k, generator=g, device=dev, dtype=dt)
    base = torch.randn(len(slots), sum(parts), generator=g, device=dev, dtype=dt)
    with lora_layer.lora_rows(slots):
        lora_layer.USE_TRITON = False
        want = layer(x, base.clone())
        lora_layer.USE_TRITON = True
        got = base.clone()
        col = 0
        for a, b in zip(lora_a, lora_b):
            lora_expand(got, lora_shrink(x, a, slots.cuda()), b, slots.cuda(), col)
            col += b.shape[1]
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_greedy_with_kernels_matches_the_torch_path(tmp_path, model_dir):
    rng = random.Random(0)
    prompts = [[rng.randrange(10000) for _ in range(rng.randint(16, 120))] for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=32, logprobs=2)
    outputs = {}
    for use_triton in (False, True):
        lora_layer.USE_TRITON = use_triton
        llm = LLM(model=model_dir, dtype="float32", device="cuda", enable_lora=True, max_loras=2,
                  max_lora_rank=16, gpu_memory_utilization=0.3)
        write_adapter(tmp_path / "a", llm.engine.model_config, 16, seed=0)
        write_adapter(tmp_path / "b", llm.engine.model_config, 8, seed=1)
        loras = [None, LoRARequest("a", 1, str(tmp_path / "a")),
                 LoRARequest("b", 2, str(tmp_path / "b"))]
        outputs[use_triton] = llm.generate(prompts, params, use_tqdm=False,
                                           lora_request=[loras[i % 3] for i in range(8)])
        del llm
    lora_layer.USE_TRITON = True
    for i, (torch_out, triton_out) in enumerate(zip(outputs[False], outputs[True])):
        ref = torch_out.outputs[0]
        steps = [{t: lp.logprob for t, lp in s.items()} for s in ref.logprobs]
        assert_same_greedy(triton_out.outputs[0].token_ids, ref.token_ids, steps,
                           NEAR_TIE_ACROSS_BATCH_SHAPES, f"prompt {i}:")
