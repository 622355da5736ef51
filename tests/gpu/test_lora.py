"""LoRA on CUDA: the Triton shrink/expand pair against the torch path at Llama-3-8B's
projection shapes (bf16); greedy output of a SmolLM2-shaped random model under adapters with
the kernels vs with the torch path; and the decode graphs' LoRA set against eager LoRA
steps, with the graphs counted as replayed (`pagedllm bench lora` times them)."""
from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.benchmarks.lora_bench import write_adapter
from pagedllm.layers import lora as lora_layer
from pagedllm.worker import cuda_graphs
from tests.gpu.random_model import free
from tests.paged_helpers import NEAR_TIE_ACROSS_BATCH_SHAPES, assert_same_greedy

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("k,parts", [(4096, [4096, 1024, 1024]), (4096, [14336, 14336]),
                                     (14336, [4096])])
@pytest.mark.parametrize("num_rows", [1, 37, 256])
def test_kernels_match_the_torch_path(k, parts, num_rows):
    from pagedllm.kernels.triton_lora import lora_expand, lora_shrink

    g = torch.Generator(device="cuda").manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    lora_a = [torch.randn(4, 16, k, generator=g, device=dev, dtype=dt) * 0.02 for _ in parts]
    lora_b = [torch.randn(4, n, 16, generator=g, device=dev, dtype=dt) * 0.02 for n in parts]
    layer = lora_layer.LoRALayer.of_parts(lora_a, lora_b)
    layer.active = [[True] * len(parts) for _ in range(4)]
    slots = torch.tensor([(i % 5) - 1 for i in range(num_rows)])  # base rows and all 4 slots
    x = torch.randn(len(slots), k, generator=g, device=dev, dtype=dt)
    base = torch.randn(len(slots), sum(parts), generator=g, device=dev, dtype=dt)
    rows = lora_layer.LoRARows.build(slots)
    with lora_layer.lora_rows(rows):
        lora_layer.USE_TRITON = False
        want = layer(x, base.clone())
        lora_layer.USE_TRITON = True
    got = base.clone()
    perm, starts = rows.segments_on(x.device, 4)
    y = lora_shrink(x, layer.a_stacked, perm, starts, len(parts))
    lora_expand(got, y, layer.b_stacked, perm, starts, layer.part_ends)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    if num_rows == 1:  # the joint GEMV's columns: every slot's x A^T, the row's slot picked
        got = base.clone()
        lora_expand(got, x @ layer.a_stacked.reshape(-1, k).T, layer.b_stacked, perm, starts,
                    layer.part_ends, y_per_slot=True)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def _generate(model_dir, tmp_path, prompts, params, enforce_eager=False, pick=None):
    """Greedy outputs of a batch mixing two adapters and the base (`pick`: each prompt's
    index into [base, a, b]), and the runner's graph counts: (whether it has a LoRA set,
    its replays with LoRA on), None when eager."""
    llm = LLM(model=model_dir, dtype="float32", device="cuda", enable_lora=True, max_loras=2,
              max_lora_rank=16, gpu_memory_utilization=0.3, enforce_eager=enforce_eager)
    write_adapter(tmp_path / "a", llm.engine.model_config, 16, seed=0)
    write_adapter(tmp_path / "b", llm.engine.model_config, 8, seed=1)
    loras = [None, LoRARequest("a", 1, str(tmp_path / "a")),
             LoRARequest("b", 2, str(tmp_path / "b"))]
    outs = llm.generate(prompts, params, use_tqdm=False,
                        lora_request=[loras[i % 3 if pick is None else pick[i]]
                                      for i in range(len(prompts))])
    graphs = llm.engine.worker.runner.graphs
    counts = None if graphs is None else (graphs.lora is not None, graphs.num_lora_replays)
    llm.engine.shutdown()
    del llm, graphs
    free()  # the next engine of the test sizes its KV cache from the memory left
    return outs, counts


def _assert_same(got, want):
    for i, (a, b) in enumerate(zip(got, want)):
        ref = b.outputs[0]
        steps = [{t: lp.logprob for t, lp in s.items()} for s in ref.logprobs]
        assert_same_greedy(a.outputs[0].token_ids, ref.token_ids, steps,
                           NEAR_TIE_ACROSS_BATCH_SHAPES, f"prompt {i}:")


def _prompts():
    rng = random.Random(0)
    return [[rng.randrange(10000) for _ in range(rng.randint(16, 120))] for _ in range(8)]


def test_greedy_with_kernels_matches_the_torch_path(tmp_path, model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=32, logprobs=2)
    outputs = {}
    for use_triton in (False, True):
        lora_layer.USE_TRITON = use_triton  # off: no LoRA graphs either (they run Triton)
        outputs[use_triton], _ = _generate(model_dir, tmp_path, _prompts(), params)
    lora_layer.USE_TRITON = True
    _assert_same(outputs[True], outputs[False])


def test_lora_graphs_match_eager_steps(tmp_path, model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=32, logprobs=2)
    eager, _ = _generate(model_dir, tmp_path, _prompts(), params, enforce_eager=True)
    graphed, (has_lora_set, lora_replays) = _generate(model_dir, tmp_path, _prompts(), params)
    assert has_lora_set
    assert lora_replays > 0  # the steps with adapter rows replayed the LoRA set
    _assert_same(graphed, eager)


def test_lora_graphs_switch_off(tmp_path, model_dir, monkeypatch):
    monkeypatch.setattr(cuda_graphs, "LORA_GRAPHS", False)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    _, (has_lora_set, lora_replays) = _generate(model_dir, tmp_path, _prompts(), params)
    assert not has_lora_set and lora_replays == 0


@pytest.mark.parametrize("adapter", [1, 2])
def test_one_row_joint_graphs_match_the_torch_path(tmp_path, model_dir, monkeypatch, adapter):
    """One sequence under an adapter: its decode steps replay the one-row LoRA graph over
    joint weights (the shrink inside the base GEMM); the torch path is the oracle."""
    from pagedllm.lora import weights as lora_weights

    monkeypatch.setattr(lora_weights, "JOINT_MAX_SHARE", 1.0)
    params = SamplingParams(temperature=0.0, max_tokens=32, logprobs=2)
    prompts = _prompts()[:1]
    lora_layer.USE_TRITON = False
    want, _ = _generate(model_dir, tmp_path, prompts, params, pick=[adapter])
    lora_layer.USE_TRITON = True
    got, (_, lora_replays) = _generate(model_dir, tmp_path, prompts, params, pick=[adapter])
    assert lora_replays > 0
    _assert_same(got, want)
