"""Device mapping: layers spread over device groups, each with its own KV cache and its own
copy of the step's metadata (acceptance of the device-map issue, CPU part).

All groups are on the CPU here; groups stay distinct on one physical device, so the grouping,
the per-group caches and metadata and the transfers at group boundaries are what is tested.
"""
from __future__ import annotations

import json
import logging

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import ModelConfig
from pagedllm.kernels.metadata import PagedAttentionInputMetadata
from pagedllm.models.device_map import DeviceMap
from pagedllm.loader import initialize_dummy_weights
from pagedllm.models.registry import build_model
from pagedllm.worker import memory
from pagedllm.worker.cache_engine import CacheEngine, bytes_per_block
from pagedllm.worker.placement import (
    PlacementInputs, WeightSizes, check_weights_fit, describe, plan_auto,
)
from tests.paged_helpers import NEAR_TIE_ACROSS_BATCH_SHAPES, PagedRunner, assert_same_greedy
from tests.prompts import OPENINGS, QUESTIONS, SHARED_PREFIX

CPU = torch.device("cpu")
GPU0, GPU1 = torch.device("cuda", 0), torch.device("cuda", 1)  # placement figures only
MiB = 1 << 20


# ------------------------------------------------------------------ parsing
def test_parse_keeps_groups_distinct_on_one_device():
    dm = DeviceMap.parse("cpu:10, cpu:12,cpu:8", 30)
    assert [(g.index, g.device, g.start, g.end) for g in dm.groups] == [
        (0, CPU, 0, 10), (1, CPU, 10, 22), (2, CPU, 22, 30)
    ]
    assert dm.devices == [CPU] and dm.layers_on(CPU) == 30
    assert dm.layer_devices == [CPU] * 30
    assert list(dm.groups[1].layers) == list(range(10, 22))
    assert dm.spec() == "cpu:10,cpu:12,cpu:8"


def test_from_layer_devices_merges_runs():
    dm = DeviceMap.from_layer_devices([GPU0, GPU0, CPU, CPU, CPU, GPU0])
    assert [(g.device, g.num_layers) for g in dm.groups] == [(GPU0, 2), (CPU, 3), (GPU0, 1)]
    assert dm.devices == [GPU0, CPU] and dm.layers_on(GPU0) == 3
    assert dm.input_device == GPU0 and dm.output_device == GPU0


SHAPE = "must look like DEVICE:LAYERS, e.g. cuda:0:20 or cpu:12"


@pytest.mark.parametrize("spec, message", [
    ("cpu", f"device map entry 'cpu' {SHAPE}"),
    ("cpu:0,cpu:30", f"device map entry 'cpu:0' {SHAPE}"),
    ("cpu:ten", f"device map entry 'cpu:ten' {SHAPE}"),
    ("cpu:20,", f"device map entry '' {SHAPE}"),
    ("gpu0:30", "device map names an unknown device 'gpu0'"),
    ("meta:30", "device map names an unsupported device 'meta' (use cuda:N or cpu)"),
    ("cpu:10,cpu:10", "device map 'cpu:10,cpu:10' places 20 layers but the model has 30"),
    ("cpu:20,cpu:20", "device map 'cpu:20,cpu:20' places 40 layers but the model has 30"),
])
def test_bad_maps(spec, message):
    with pytest.raises(ValueError) as e:
        DeviceMap.parse(spec, 30)
    assert str(e.value) == message


def test_map_naming_a_missing_cuda_device():
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError) as e:
        DeviceMap.parse(f"cpu:20,cuda:{count}:10", 30)
    assert str(e.value) == (
        f"device map names 'cuda:{count}' but this machine has {count} CUDA device(s)"
    )


def test_weights_that_do_not_fit():
    check_weights_fit({CPU: 100}, {CPU: 100})
    with pytest.raises(ValueError) as e:
        check_weights_fit({GPU0: 3 << 30, CPU: 1}, {GPU0: 2 << 30, CPU: 10})
    assert str(e.value) == "device map puts 3.00 GiB of weights on cuda:0, which has 2.00 GiB free"


# --------------------------------------------------------- block count rule
def test_block_count_is_the_minimum_over_devices():
    per_layer_block = 1000
    layers = {GPU0: 20, CPU: 10}
    block_bytes = {d: n * per_layer_block for d, n in layers.items()}
    # cuda:0: 2e6 / 20e3 = 100 blocks; cpu: 5e5 / 10e3 = 50 blocks -> the CPU limits,
    # although it holds fewer layers.
    assert memory.num_blocks_for_budgets({GPU0: 2_000_000, CPU: 500_000}, block_bytes) == 50
    # A bigger CPU budget moves the limit to cuda:0; a partial block does not count.
    assert memory.num_blocks_for_budgets({GPU0: 2_019_999, CPU: 5_000_000}, block_bytes) == 100


def test_block_count_ignores_devices_without_layers_and_names_the_short_one():
    assert memory.num_blocks_for_budgets({GPU0: 10_000, CPU: 0}, {GPU0: 1000, CPU: 0}) == 10
    with pytest.raises(ValueError) as e:
        memory.num_blocks_for_budgets({GPU0: 10_000, CPU: 999}, {GPU0: 1000, CPU: 1000})
    assert str(e.value) == (
        "no memory is left for the KV cache on cpu: its budget of 999 bytes is less than one "
        "block (1000 bytes); lower the batch limits or give the cache more memory"
    )


def test_per_device_values():
    devices = [GPU0, CPU]
    assert memory.per_device_values("x", "0.5", devices, float) == {GPU0: 0.5, CPU: 0.5}
    assert memory.per_device_values("x", "1e9,2e9", devices, int) == {GPU0: 10**9, CPU: 2 * 10**9}
    assert memory.per_device_values("x", [3, 4], devices, int) == {GPU0: 3, CPU: 4}
    assert memory.per_device_values("x", None, devices, int) == {GPU0: None, CPU: None}
    with pytest.raises(ValueError) as e:
        memory.per_device_values("kv_cache_memory", "1,2,3", devices, int)
    assert str(e.value) == (
        "kv_cache_memory has 3 values but the device map uses 2 device(s): cuda:0, cpu"
    )
    with pytest.raises(ValueError) as e:
        memory.per_device_values("kv_cache_memory", "lots", devices, int)
    assert str(e.value) == "kv_cache_memory must be a number or comma-separated numbers, got 'lots'"


# ------------------------------------------------------------ auto placement
def inputs(num_layers=10, layer=100 * MiB, embed=50 * MiB, head=50 * MiB, kv=1 * MiB,
           peak=20 * MiB, min_blocks=8) -> PlacementInputs:
    return PlacementInputs(WeightSizes([layer] * num_layers, embed, head), kv, peak, min_blocks)


def counts(dm: DeviceMap) -> list[tuple[torch.device, int]]:
    return [(g.device, g.num_layers) for g in dm.groups]


def device_cost(p: PlacementInputs, start: int, end: int, num_blocks: int) -> int:
    """What a device holding layers [start, end) must hold, written out from the rule."""
    w = p.weights
    cost = p.activation_peak + sum(w.layer_bytes[start:end])
    cost += (end - start) * num_blocks * p.kv_block_bytes
    cost += w.embed_bytes if start == 0 else 0
    cost += w.head_bytes if end == len(w.layer_bytes) else 0
    return cost


def test_auto_model_that_fits_one_gpu_stays_there():
    p = inputs()
    assert counts(plan_auto([(GPU0, 8 << 30), (CPU, 64 << 30)], p)) == [(GPU0, 10)]


def test_auto_spills_to_the_cpu_only_what_the_gpu_cannot_hold():
    p = inputs()
    gpu_free = 700 * MiB
    dm = plan_auto([(GPU0, gpu_free), (CPU, 64 << 30)], p)
    (gpu, n_gpu), (cpu, n_cpu) = counts(dm)
    assert (gpu, cpu, n_gpu + n_cpu) == (GPU0, CPU, 10)
    # Filled in order: cuda:0 holds as many layers as fit with the minimum KV cache.
    assert device_cost(p, 0, n_gpu, p.min_blocks) <= gpu_free
    assert device_cost(p, 0, n_gpu + 1, p.min_blocks) > gpu_free
    assert dm.input_device == GPU0 and dm.output_device == CPU  # embedding / head follow


def test_auto_spreads_over_gpus_for_a_larger_shared_cache():
    p = inputs()
    dm = plan_auto([(GPU0, 2 << 30), (GPU1, 2 << 30), (CPU, 64 << 30)], p)
    (d0, n0), (d1, n1) = counts(dm)
    assert (d0, d1, n0 + n1) == (GPU0, GPU1, 10)
    assert abs(n0 - n1) <= 1  # equal GPUs, equal layers: about half each
    # The shared block count it reached beats what one GPU alone could give.
    one_gpu = plan_auto([(GPU0, 2 << 30), (CPU, 64 << 30)], p)
    assert counts(one_gpu) == [(GPU0, 10)]

    def max_blocks(start, end, free):
        n = 0
        while device_cost(p, start, end, n + 1) <= free:
            n += 1
        return n

    spread = min(max_blocks(0, n0, 2 << 30), max_blocks(n0, 10, 2 << 30))
    assert spread > max_blocks(0, 10, 2 << 30)


def test_auto_head_moves_the_last_layer_on():
    # Room for all 10 layers on cuda:0, but not for the LM head as well.
    p = inputs(head=500 * MiB)
    free = device_cost(p, 0, 10, p.min_blocks) - 1
    assert counts(plan_auto([(GPU0, free), (CPU, 64 << 30)], p)) == [(GPU0, 9), (CPU, 1)]


def test_auto_cannot_fit():
    with pytest.raises(ValueError) as e:
        plan_auto([(GPU0, 500 * MiB), (CPU, 400 * MiB)], inputs())
    assert str(e.value) == (
        "device map 'auto' cannot fit the model: 1.07 GiB of weights plus a KV cache of 8 "
        "blocks and activations, with usable memory cuda:0 0.49 GiB, cpu 0.39 GiB"
    )


# --------------------------------------------------------------- cache engine
def tiny_config(architecture="llama", layers=6) -> ModelConfig:
    return ModelConfig(architecture=architecture, vocab_size=97, hidden_size=32,
                       num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=4 if architecture == "bloom" else 2,
                       intermediate_size=64, max_position_embeddings=128,
                       tie_word_embeddings=architecture == "bloom")


def test_cache_engine_groups_swap_and_copy_every_group():
    config = tiny_config()
    dm = DeviceMap.parse("cpu:1,cpu:3,cpu:2", 6)
    engine = CacheEngine(config, 4, num_gpu_blocks=5, num_cpu_blocks=3, dtype=torch.float32,
                         device_map=dm)
    assert [tuple(c.shape[:3]) for c in engine.group_caches] == [(1, 2, 5), (3, 2, 5), (2, 2, 5)]
    assert len(engine.gpu_cache) == 6
    # A layer's cache is a view of its group's tensor.
    assert engine.gpu_cache[4].data_ptr() == engine.group_caches[2][0].data_ptr()
    for i, layer in enumerate(engine.gpu_cache):
        layer.copy_(torch.randn(layer.shape))
    before = [c.clone() for c in engine.gpu_cache]
    engine.swap_out([(1, 0), (3, 2)])
    for c in engine.gpu_cache:  # the swapped-out blocks get reused
        c[:, 1].zero_(), c[:, 3].zero_()
    engine.swap_in([(0, 4), (2, 0)])  # back, into other blocks
    engine.copy([(4, 2)])
    for layer, old in zip(engine.gpu_cache, before):
        assert torch.equal(layer[:, 4], old[:, 1]) and torch.equal(layer[:, 0], old[:, 3])
        assert torch.equal(layer[:, 2], old[:, 1])
    assert engine.group_bytes(1) == 3 * bytes_per_block(config, 4, torch.float32, 1) * 5


# ------------------------------------------------- model forward over groups
class TransferLog:
    """Counts DeviceMap.transfer calls by what they move."""

    def __init__(self, monkeypatch):
        self.metadata = self.hidden = 0
        original = DeviceMap.transfer
        log = self

        def counted(dm, value, group):
            if isinstance(value, PagedAttentionInputMetadata):
                log.metadata += 1
            else:
                log.hidden += 1
            return original(dm, value, group)

        monkeypatch.setattr(DeviceMap, "transfer", counted)


@pytest.mark.parametrize("architecture", ["llama", "bloom"])
def test_forward_over_groups_matches_one_group(architecture, monkeypatch):
    config = tiny_config(architecture)
    model = build_model(config)
    initialize_dummy_weights(model, seed=0)  # build_model leaves the embedding uninitialized
    model.eval()
    chunks = [{0: [5, 9, 2, 7, 1], 1: [3, 4]}, {0: [8], 1: [6]}, {0: [2], 1: [9]}]
    log = TransferLog(monkeypatch)
    single = PagedRunner(model, config, num_blocks=16, block_size=4)
    expected = [single.step(c) for c in chunks]
    assert (log.metadata, log.hidden) == (0, 0)  # one group: nothing moves
    model.device_map = DeviceMap.parse("cpu:2,cpu:1,cpu:3", 6)
    split = PagedRunner(model, config, num_blocks=16, block_size=4)
    for c, want in zip(chunks, expected):
        # The same computation moved between groups: equal up to fp32 rounding (a BLAS may
        # pick its kernel by the operands' alignment, which a copy can change).
        torch.testing.assert_close(split.step(c), want, rtol=1e-5, atol=1e-5)
    # Per step: one metadata copy per later group, one hidden-state move per boundary.
    assert (log.metadata, log.hidden) == (2 * len(chunks), 2 * len(chunks))


def test_distribute_gives_each_group_its_own_metadata():
    dm = DeviceMap.parse("cpu:2,cpu:2", 4)
    meta = PagedAttentionInputMetadata.build([0, 1], [0, 1], [2], [2], [[0]])
    first, second = dm.distribute({CPU: meta})
    assert first is meta and second is not meta
    assert torch.equal(second.slot_mapping, meta.slot_mapping)
    assert DeviceMap.single(CPU, 4).distribute(meta) == [meta]
    with pytest.raises(ValueError) as e:
        dm.distribute([meta])
    assert str(e.value) == "got 1 metadata for 2 device groups"


def test_describe_lines():
    dm = DeviceMap.parse("cpu:2,cpu:1", 3)
    lines = describe(dm, [3 * MiB, MiB // 2], [2 * MiB, MiB], {CPU: 5 << 30})
    assert lines == [
        "device group 0 on cpu: layers 0-1 (2), weights 3.0 MiB, KV cache 2.0 MiB; "
        "cpu has 5.00 GiB free",
        "device group 1 on cpu: layers 2-2 (1), weights 0.5 MiB, KV cache 1.0 MiB; "
        "cpu has 5.00 GiB free",
    ]


# ------------------------------------------------ the engine, on a tiny model
@pytest.fixture
def tiny_model(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 97, "hidden_size": 32,
        "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 64, "max_position_embeddings": 128,
    }))
    return str(path)


def tiny_llm(model, **kwargs) -> LLM:
    return LLM(model, load_format="dummy", swap_space=0.001, **kwargs)


@pytest.mark.parametrize("spec, message", [
    ("cpu:4", "device map 'cpu:4' places 4 layers but the model has 6"),
    ("cpu:4,cuda:99:2", "device map names 'cuda:99' but this machine has "
     f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} CUDA device(s)"),
])
def test_llm_rejects_bad_maps(tiny_model, spec, message):
    with pytest.raises(ValueError) as e:
        tiny_llm(tiny_model, device_map=spec)
    assert str(e.value) == message


def test_llm_kv_budget_is_per_physical_device(tiny_model, caplog):
    budget = 1 << 20
    with caplog.at_level(logging.INFO, logger="pagedllm.worker.worker"):
        llm = tiny_llm(tiny_model, device_map="cpu:2,cpu:4", kv_cache_memory=budget)
    worker = llm.engine.worker
    config = worker.model_config
    # Both groups share the CPU's one budget: 6 layers' worth of bytes per block.
    assert worker.num_gpu_blocks == budget // bytes_per_block(config, 16, torch.float32, 6)
    assert [c.shape[0] for c in worker.cache_engine.group_caches] == [2, 4]
    assert "device group 0 on cpu: layers 0-1 (2)" in caplog.text
    assert "device group 1 on cpu: layers 2-5 (4)" in caplog.text
    with pytest.raises(ValueError) as e:
        tiny_llm(tiny_model, device_map="cpu:2,cpu:4", kv_cache_memory="1e6,2e6")
    assert str(e.value) == "kv_cache_memory has 2 values but the device map uses 1 device(s): cpu"
    with pytest.raises(ValueError) as e:
        tiny_llm(tiny_model, device_map="cpu:2,cpu:4", kv_cache_memory=1000)
    assert str(e.value).startswith(
        "no memory is left for the KV cache on cpu: its budget of 1000 bytes"
    )


def test_llm_auto_on_a_cpu_only_machine(tiny_model, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    llm = tiny_llm(tiny_model, device_map="auto", kv_cache_memory=1 << 20)
    assert llm.engine.worker.device_map.spec() == "cpu:6"
    # No device can take the model: a clear error, before anything is allocated.
    monkeypatch.setattr(memory, "available_host_memory", lambda: 100_000)
    with pytest.raises(ValueError, match=r"^device map 'auto' cannot fit the model: "):
        tiny_llm(tiny_model, device_map="auto", kv_cache_memory=1 << 20)


# -------------------------------- the default model: greedy parity, swap, prefix caching
MAX_TOKENS = 16
# Short openings grow past a block boundary while decoding, which a tiny cache cannot give
# every sequence at once (swap preemption); the questions share a long prefix.
PROMPTS = OPENINGS[:5] + [SHARED_PREFIX + q for q in QUESTIONS[:3]]
ENGINE = dict(preemption_mode="swap", num_gpu_blocks_override=10, enable_prefix_caching=True,
              kv_cache_memory=64 << 20, swap_space=0.05, dtype="float32")


@pytest.fixture(scope="module")
def default_model_once():
    """The default model's source read once for this module's engines (the loader is tested
    elsewhere; here only placement differs between them)."""
    from pagedllm.loader import load_model_source
    from pagedllm.worker import worker

    source = load_model_source()
    weights = list(source.iter_weights(torch.float32))
    source.weight_iterator = lambda dtype: ((n, t.to(dtype)) for n, t in weights)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(worker, "load_model_source", lambda *args, **kwargs: source)
        yield


def greedy(llm: LLM):
    return llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                logprobs=2), use_tqdm=False)


@pytest.fixture(scope="module")
def single_device_outputs(default_model_once):
    llm = LLM(**ENGINE)
    assert len(llm.engine.worker.device_map.groups) == 1
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in step.items()}
                                      for step in o.outputs[0].logprobs])
            for o in greedy(llm)]


@pytest.mark.parametrize("spec", ["cpu:15,cpu:15", "cpu:10,cpu:12,cpu:8"])
def test_greedy_matches_single_device(spec, single_device_outputs, monkeypatch):
    llm = LLM(device_map=spec, **ENGINE)
    num_groups = len(spec.split(","))
    assert len(llm.engine.worker.cache_engine.group_caches) == num_groups
    log = TransferLog(monkeypatch)
    forwards = 0
    model = llm.engine.worker.model
    original = model.forward

    def counted_forward(*args):
        nonlocal forwards
        forwards += 1
        return original(*args)

    monkeypatch.setattr(model, "forward", counted_forward)
    outs = greedy(llm)
    # The same steps, but preemption and the groups' copies may shift batch shapes.
    for i, (out, (want, want_logprobs)) in enumerate(zip(outs, single_device_outputs)):
        assert_same_greedy(out.outputs[0].token_ids, want, want_logprobs,
                           NEAR_TIE_ACROSS_BATCH_SHAPES, f"prompt {i}:")
    assert llm.engine.scheduler.stats.num_preemptions_swap > 0
    assert any(o.num_cached_tokens > 0 for o in outs[5:])  # prefix cache hits
    # Each step's forward: one metadata copy per later group, one move per boundary.
    assert forwards > 0
    assert log.metadata == log.hidden == forwards * (num_groups - 1)
