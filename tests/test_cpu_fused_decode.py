"""The CPU's fused decode (models/cpu_decode.py, kernels/cpu/fused_decode.c) against the
per-op path it replaces, on the same model: a tiny GGUF of mixed block types and the default
model; and the steps and models that must keep the per-op path."""
from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.kernels.cpu import build, quant
from pagedllm.layers import dispatch
from tests.paged_helpers import NEAR_TIE_ACROSS_BATCH_SHAPES, PagedRunner, assert_same_greedy
from tests.prompts import OPENINGS, QUESTIONS, SHARED_PREFIX
import tests.test_gguf_model as gguf_model_tests
from tests.quant_helpers import QT
from tests.test_gguf_model import VOCAB, write_mixed_gguf

pytestmark = pytest.mark.skipif(build.load_library() is None,
                                reason="no C compiler: GGUF weights cannot stay packed")

# Both paths run the same kernels (the packed matmul with 16-bit activations, the C norm,
# rotary, cache write and attention) on the same inputs in the same order, so their logits
# agree to fp32 rounding; skipping an op or taking another layer's weights moves them by
# far more than their whole scale times this.
RTOL = 1e-5


def tiny_llm(tmp_path, arch: str = "llama", **kwargs) -> LLM:
    path = tmp_path / f"{arch}.gguf"
    write_mixed_gguf(path, arch, tied=arch != "llama")
    return LLM(model=str(path), quantization="gguf", kv_cache_memory=16 << 20,
               max_num_batched_tokens=256, **kwargs)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llm(tmp_path_factory.mktemp("fused")).engine.worker.model


class PerOpAndFused:
    """The same steps through two paged caches of one model: the per-op path and the fused
    one (each with its own shuffled blocks of 4 tokens, so sequences cross blocks often)."""

    def __init__(self, model) -> None:
        self.model = model
        self.runners = [PagedRunner(model, model.config, num_blocks=256, block_size=4, seed=s)
                        for s in (0, 1)]

    def step(self, chunks: dict[int, list[int]]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Both paths' logits, and how many steps ran fused."""
        steps = self.model.cpu_decode.steps
        out = []
        for fused, runner in zip((False, True), self.runners):
            self.model.fused_decode_enabled = fused
            out.append(runner.step(chunks))
        self.model.fused_decode_enabled = True
        return out[0], out[1], self.model.cpu_decode.steps - steps


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert (got - want).abs().max().item() <= RTOL * want.abs().max().item()


@pytest.mark.parametrize("num_seqs", [1, 3, 10])  # 10 rows: the tiled matmul, not the int one
def test_tiny_model_decode_matches_the_per_op_path(tiny, num_seqs):
    assert tiny.cpu_decode.supported()
    rng = np.random.default_rng(num_seqs)
    both = PerOpAndFused(tiny)
    prompts = {s: rng.integers(0, VOCAB, int(rng.integers(1, 20))).tolist()
               for s in range(num_seqs)}
    want, got, fused = both.step(prompts)  # a prompt step: per-op in both
    assert fused == 0
    assert_close(got, want)
    ends = np.cumsum([len(p) for p in prompts.values()]) - 1
    tokens = {s: int(want[i].argmax()) for s, i in zip(prompts, ends)}
    for _ in range(10):
        want, got, fused = both.step({s: [t] for s, t in tokens.items()})
        assert fused == 1
        assert_close(got, want)
        tokens = {s: int(row.argmax()) for s, row in zip(tokens, want)}


# Every projection in a type with 8-bit activations: a one-row step runs fused_decode.c's
# shared-queue path (the threads claim chunks of rows), the per-op path the same kernel.
INT8_TYPES = {"attn_q": QT.Q4_0, "attn_k": QT.Q8_0, "attn_v": QT.Q4_1, "attn_output": QT.Q4_1,
              "ffn_gate": QT.Q8_0, "ffn_up": QT.Q4_0, "ffn_down": QT.Q4_1, "output": QT.Q8_0}


# With the 8-row copies (kernels/cpu/quant_x8.c) the Q4 GEMVs sum their blocks in another
# fp32 order, and each layer's activations are quantized to int8 again, so a rounding
# difference can move a value by one quantization step: the paths agree to the int8
# error, not to fp32 rounding. A wrong nibble order or block scale moves the logits by
# their whole scale.
X8_RTOL = 1e-2


@pytest.mark.parametrize("x8", [False, True])
@pytest.mark.parametrize("threads,num_seqs", [(1, 1), (2, 1), (3, 1), (2, 3)])
def test_int8_decode_matches_the_per_op_path(tmp_path, monkeypatch, threads, num_seqs, x8):
    """One row: fused_decode.c's shared-queue path (the threads claim chunks of rows and
    the attention's heads from two halves of each phase; 3 threads: more threads than
    halves); 3 rows: its general loop (gguf_x8_matmul where x8)."""
    monkeypatch.setattr(gguf_model_tests, "TYPES", INT8_TYPES)
    if not x8:
        monkeypatch.setattr(quant, "x8_repackable", lambda qtype, n, k: False)
    model = tiny_llm(tmp_path, cpu_activations="int8").engine.worker.model
    rng = np.random.default_rng(threads + num_seqs)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        both = PerOpAndFused(model)
        prompts = {s: rng.integers(0, VOCAB, 11 + s).tolist() for s in range(num_seqs)}
        want, got, fused = both.step(prompts)
        ends = np.cumsum([len(p) for p in prompts.values()]) - 1
        tokens = {s: int(want[i].argmax()) for s, i in zip(prompts, ends)}
        for _ in range(12):  # crossing blocks of 4 tokens
            want, got, fused = both.step({s: [t] for s, t in tokens.items()})
            assert fused == 1
            if x8:
                err = (got - want).abs().max().item()
                assert err <= X8_RTOL * want.abs().max().item()
            else:
                assert_close(got, want)
            tokens = {s: int(row.argmax()) for s, row in zip(tokens, want)}
        assert bool(model.cpu_decode._plan.copies) == x8  # the Q4 projections' copies
    finally:
        torch.set_num_threads(before)


def test_tiny_model_mixed_step_takes_the_per_op_path(tiny):
    rng = np.random.default_rng(7)
    both = PerOpAndFused(tiny)
    both.step({0: rng.integers(0, VOCAB, 9).tolist(), 1: rng.integers(0, VOCAB, 3).tolist()})
    want, got, fused = both.step({0: [5], 1: [6]})
    assert fused == 1
    # a decode row beside a prompt chunk, then the two decoding again
    want, got, fused = both.step({0: [7], 1: [8], 2: rng.integers(0, VOCAB, 5).tolist()})
    assert fused == 0
    assert_close(got, want)
    want, got, fused = both.step({0: [9], 1: [10], 2: [11]})
    assert fused == 1
    assert_close(got, want)


def test_moved_weights_are_picked_up(tiny):
    """The fused step points at the weights' memory: a weight replaced after a fused step
    (its old memory then zeroed) must be the one the next fused step reads."""
    both = PerOpAndFused(tiny)
    both.step({0: [1, 2, 3]})
    assert both.step({0: [4]})[2] == 1
    for module in (tiny.layers[1].mlp.down_proj, tiny.layers[0].input_layernorm):
        name = "qweight" if hasattr(module, "qweight") else "weight"
        old = getattr(module, name)
        if name == "qweight":
            module.qweight = old.clone()
        else:
            module.weight = torch.nn.Parameter(old.detach().clone(), requires_grad=False)
        with torch.no_grad():
            old.zero_()
        want, got, fused = both.step({0: [5]})
        assert fused == 1
        assert_close(got, want)


def test_moved_weights_are_picked_up_with_int8_activations(tmp_path, monkeypatch):
    """The same with int8 activations, where both paths read 8-row copies of the weights:
    a replaced weight gets copies of its own (the old ones hold the old values)."""
    monkeypatch.setattr(gguf_model_tests, "TYPES", INT8_TYPES)
    model = tiny_llm(tmp_path, cpu_activations="int8").engine.worker.model
    both = PerOpAndFused(model)
    both.step({0: [1, 2, 3]})
    assert both.step({0: [4]})[2] == 1
    for layer in (0, 1):  # each layer's down_proj gets the other's weight
        proj, other = model.layers[layer].mlp.down_proj, model.layers[1 - layer].mlp.down_proj
        proj.qweight = other.qweight.clone()
        want, got, fused = both.step({0: [5 + layer]})
        assert fused == 1
        for seg, copy in zip(proj.segments, proj.x8_copies):  # the new weight's bytes
            assert torch.equal(copy, quant.repack_x8(proj._data(seg), seg.qtype, seg.rows,
                                                     proj.in_features))
        assert (got - want).abs().max().item() <= X8_RTOL * want.abs().max().item()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])  # q|k|v bias; per-head q/k norms
def test_models_the_fused_step_does_not_cover_take_the_per_op_path(tmp_path, arch):
    llm = tiny_llm(tmp_path, arch)
    model = llm.engine.worker.model
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4,
                                                   ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert not model.cpu_decode.supported()
    assert model.cpu_decode.steps == 0


def test_layers_off_the_c_kernels_take_the_per_op_path(tmp_path):
    with dispatch.force("torch"):
        llm = tiny_llm(tmp_path)
    model = llm.engine.worker.model
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    assert not model.cpu_decode.supported()
    assert model.cpu_decode.steps == 0


def test_layers_split_by_a_device_map_take_the_per_op_path(tmp_path):
    llm = tiny_llm(tmp_path, device_map="cpu:1,cpu:1")
    model = llm.engine.worker.model
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4,
                                                   ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert model.cpu_decode.steps == 0


# ----------------------------------------------------------------------------- default model


def greedy_runs(fused: bool) -> tuple[list, object]:
    """Prompts of different lengths decoding together through a small cache (preemption), run
    twice (the second time on prefix-cache hits), on a fresh engine: the schedule is the same
    whichever path decodes, so both paths see the same batch shapes."""
    llm = LLM(quantization="gguf", kv_cache_memory=6 << 20, max_num_seqs=4,
              max_num_batched_tokens=256)
    try:
        model = llm.engine.worker.model
        assert model.cpu_decode.supported()
        model.fused_decode_enabled = fused
        prompts = [OPENINGS[0], OPENINGS[12], SHARED_PREFIX + QUESTIONS[1], OPENINGS[7],
                   SHARED_PREFIX + QUESTIONS[2]]
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
        outs = [o.outputs[0] for _ in range(2)
                for o in llm.generate(prompts, params, use_tqdm=False)]
        scheduler = llm.engine.scheduler
        assert scheduler.stats.num_preemptions_recompute > 0
        assert scheduler.prefix_cache_hit_rate > 0
        return outs, model.cpu_decode.steps
    finally:
        del llm
        gc.collect()


def test_default_model_greedy_matches_the_per_op_path():
    want, steps = greedy_runs(fused=False)
    assert steps == 0
    got, steps = greedy_runs(fused=True)
    assert steps >= 2 * 15
    for i, (g, w) in enumerate(zip(got, want)):
        want_logprobs = [{t: lp.logprob for t, lp in step.items()} for step in w.logprobs]
        assert_same_greedy(g.token_ids, w.token_ids, want_logprobs,
                           NEAR_TIE_ACROSS_BATCH_SHAPES, where=f"output {i}")
        for token, step, want_step in zip(g.token_ids, g.logprobs, want_logprobs):
            assert abs(step[token].logprob - want_step[token]) <= 1e-5
