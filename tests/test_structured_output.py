"""Structured output on the default model: JSON schemas, regexes, choices and grammars are
enforced while sampling (llguidance matchers in the engine, bitmasks applied by the worker),
with every engine path: sampled and greedy, forks, preemption by recompute and by swap."""
from __future__ import annotations

import gc
import json
import re
import threading

import jsonschema
import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.layers.token_bitmask import apply_token_bitmask
from pagedllm.sampling_params import StructuredOutputsParams
from tests.paged_helpers import NEAR_TIE_ACROSS_BATCH_SHAPES, assert_same_greedy
from tests.test_step_contract import make_runner, tiny, token_of  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16},
                           "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "color", "tags", "address"],
    "additionalProperties": False,
}
# Structure ~40 tokens + at most 56 characters of strings + numbers: always under this.
PERSON_MAX_TOKENS = 140

SUBJECTS = ["a pirate", "a chef", "a pilot", "a farmer", "a poet", "a nurse", "a robot",
            "a king", "a child", "a painter"]


def chat(llm, text: str) -> str:
    return llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)


@pytest.fixture(scope="module")
def llm():
    from pagedllm import LLM

    engine = LLM(kv_cache_memory=256 << 20, max_num_batched_tokens=2048)
    yield engine
    del engine
    gc.collect()


def _no_leaks(llm):
    bm = llm.engine.scheduler.block_manager
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks
    assert not llm.engine.has_unfinished_requests()
    assert not llm.engine.structured.matchers


def test_50_sampled_json_outputs_all_validate(llm):
    prompts = [chat(llm, f"Describe {SUBJECTS[i % 10]} (number {i}) as a JSON object.")
               for i in range(50)]
    constraint = StructuredOutputsParams(json=PERSON)
    # Unseeded: seeded rows draw their noise one row at a time (a few seconds at 50 rows).
    params = SamplingParams(temperature=1.0, max_tokens=PERSON_MAX_TOKENS,
                            structured_outputs=constraint)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), PERSON)
    assert len({o.outputs[0].text for o in outs}) > 25  # sampled, not one answer
    _no_leaks(llm)


def test_regex_and_choice_always_match(llm):
    prompts = [chat(llm, f"Give a code for {s}.") for s in SUBJECTS]
    pattern = r"[A-Z]{2}-\d{3}(-[a-z]{1,4})?"
    outs = llm.generate(prompts, SamplingParams(
        temperature=1.0, max_tokens=20,
        structured_outputs=StructuredOutputsParams(regex=pattern)), use_tqdm=False)
    for out in outs:
        assert out.outputs[0].finish_reason == "stop"
        assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text
    choices = ["yes", "no", "it depends"]
    prompts = [chat(llm, f"Is {s} happy?") for s in SUBJECTS]
    outs = llm.generate(prompts, SamplingParams(
        temperature=1.0, max_tokens=8, n=2,
        structured_outputs=StructuredOutputsParams(choice=choices)), use_tqdm=False)
    texts = [c.text for o in outs for c in o.outputs]
    assert len(texts) == 20 and set(texts) <= set(choices)
    assert all(c.finish_reason == "stop" for o in outs for c in o.outputs)
    _no_leaks(llm)


def test_grammar_and_json_object(llm):
    lark = 'start: "The answer is " NUMBER "."\nNUMBER: /[1-9][0-9]{0,2}/'
    gbnf = 'root ::= ("cat" | "dog") " " [0-9]'
    outs = llm.generate([chat(llm, "What is 6 times 7?")] * 2, [
        SamplingParams(temperature=1.0, max_tokens=16,
                       structured_outputs=StructuredOutputsParams(grammar=lark)),
        SamplingParams(temperature=1.0, max_tokens=16,
                       structured_outputs=StructuredOutputsParams(grammar=gbnf)),
    ], use_tqdm=False)
    assert re.fullmatch(r"The answer is [1-9][0-9]{0,2}\.", outs[0].outputs[0].text)
    assert re.fullmatch(r"(cat|dog) [0-9]", outs[1].outputs[0].text)
    outs = llm.generate([chat(llm, f"Describe {s} in JSON.") for s in SUBJECTS[:3]],
                        SamplingParams(temperature=0.0, max_tokens=64,
                                       structured_outputs=StructuredOutputsParams(json_object=True)),
                        use_tqdm=False)
    for out in outs:
        text = out.outputs[0].text
        assert text.startswith("{")
        if out.outputs[0].finish_reason == "stop":  # a free-form object may run long
            assert isinstance(json.loads(text), dict)
        else:
            print("json_object ran to max_tokens:", text)
    _no_leaks(llm)


def test_forks_each_follow_their_own_grammar_state(llm):
    params = SamplingParams(n=2, best_of=3, temperature=1.0, max_tokens=PERSON_MAX_TOKENS,
                            seed=3, structured_outputs=StructuredOutputsParams(json=PERSON))
    outs = llm.generate([chat(llm, f"Describe {s} as JSON.") for s in SUBJECTS[:4]], params,
                        use_tqdm=False)
    for out in outs:
        assert len(out.outputs) == 2
        for c in out.outputs:
            jsonschema.validate(json.loads(c.text), PERSON)
    _no_leaks(llm)


def _greedy_run(llm, prompts, extra):
    plain = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2)
    outs = llm.generate(prompts + [p for p, _ in extra], [plain] * len(prompts)
                        + [params for _, params in extra], use_tqdm=False)
    return outs[:len(prompts)], outs[len(prompts):]


def test_unconstrained_greedy_output_unchanged_by_constrained_neighbours(llm):
    prompts = [chat(llm, f"Tell me about {s}.") for s in SUBJECTS[:4]]
    alone, _ = _greedy_run(llm, prompts, [])
    # The same prompts again as constrained neighbours: the batch keeps its shape while
    # they run, so any difference would be the masks leaking into other rows.
    neighbours = [(p, SamplingParams(temperature=1.0, max_tokens=24, seed=i,
                                     structured_outputs=StructuredOutputsParams(
                                         regex=r"[a-z ]{10,40}")))
                  for i, p in enumerate(prompts)]
    shared, constrained = _greedy_run(llm, prompts, neighbours)
    for a, b in zip(shared, alone):
        want = b.outputs[0]
        steps = [{t: lp.logprob for t, lp in step.items()} for step in want.logprobs]
        agreed = assert_same_greedy(a.outputs[0].token_ids, want.token_ids, steps,
                                    NEAR_TIE_ACROSS_BATCH_SHAPES)
        assert agreed >= 8
    for c in constrained:
        assert re.fullmatch(r"[a-z ]{10,40}", c.outputs[0].text) or \
            c.outputs[0].finish_reason == "length"
    _no_leaks(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_constraints_survive_preemption(llm, mode):
    from pagedllm import LLM

    prompts = [chat(llm, f"Describe {s} as JSON.") for s in SUBJECTS[:6]]
    small = LLM(kv_cache_memory=10 << 20, max_num_seqs=6, preemption_mode=mode,
                swap_space=0.05, max_num_batched_tokens=1024)
    try:
        params = SamplingParams(temperature=1.0, max_tokens=PERSON_MAX_TOKENS, seed=11,
                                structured_outputs=StructuredOutputsParams(json=PERSON))
        outs = small.generate(prompts, params, use_tqdm=False)
        stats = small.engine.scheduler.stats
        key = "num_preemptions_swap" if mode == "swap" else "num_preemptions_recompute"
        assert getattr(stats, key) > 0
        for out in outs:
            jsonschema.validate(json.loads(out.outputs[0].text), PERSON)
        _no_leaks(small)
    finally:
        del small
        gc.collect()


@pytest.mark.parametrize("kwargs, message", [
    ({"json": {"type": "integer", "minimum": "zero"}}, "invalid JSON schema: "),
    ({"json": "{not json"}, "invalid JSON schema: not valid JSON"),
    ({"regex": "a(?=b)"}, "invalid regex: "),
    ({"grammar": "start: missing_rule"}, "invalid grammar: "),
    ({"choice": []}, "choice must be a non-empty list of non-empty strings, got []"),
    ({}, "structured_outputs takes exactly one of json, regex, choice, grammar, json_object; "
         "got none"),
    ({"json": {}, "regex": "a"}, "structured_outputs takes exactly one of json, regex, choice, "
                                 "grammar, json_object; got json, regex"),
])
def test_bad_constraints_are_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError) as info:
        StructuredOutputsParams(**kwargs)
    assert str(info.value).startswith(message), str(info.value)


def test_an_eos_id_past_the_tokenizers_vocabulary_is_left_out(llm):
    """A model whose vocabulary is wider than its tokenizer's (a dummy Qwen3 shape with
    SmolLM2's tokenizer, as `bench structured` runs at nano's shape) may name an EOS id the
    tokenizer has no token for; grammars still end on the tokenizer's own EOS."""
    from pagedllm.engine.structured_output import ll_tokenizer

    tokenizer = llm.get_tokenizer()
    eos = tokenizer.eos_token_id
    ll = ll_tokenizer(tokenizer, [eos, 151645])
    assert ll.eos_token == eos and ll.vocab_size <= len(tokenizer) + 31


def test_look_around_regex_names_the_problem():
    with pytest.raises(ValueError, match="look-around, including look-ahead and look-behind, "
                                         "is not supported"):
        StructuredOutputsParams(regex="a(?=b)")


def test_bitmask_masks_only_its_rows():
    logits = torch.randn(3, 70)
    before = logits.clone()
    mask = torch.zeros(1, 2, dtype=torch.int32)  # 64 ids: allow 5 and 40 only
    mask[0, 0] = 1 << 5
    mask[0, 1] = 1 << 8
    apply_token_bitmask(logits, mask, [1])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed == [5, 40]  # ids 64..69 lie past the mask: refused
    whole = before.clone()
    apply_token_bitmask(whole, torch.full((3, 3), -1, dtype=torch.int32), [0, 1, 2])
    assert torch.equal(whole, before)


def test_multi_step_and_async_scheduling_with_constraints(llm, monkeypatch):
    """CUDA's engine order on the CPU: decode windows of 4 steps, launched ahead, with the
    constrained sequences in them: each step of a window samples once the step before's
    tokens advanced the grammars (its mask filled then), and a window launched ahead gets
    its first masks once the window before has sampled. Greedy output is the synchronous
    single steps' output."""
    from pagedllm.worker.model_runner import DecodeWindow

    prompts = [chat(llm, "Count to twenty."), chat(llm, "Give a code."),
               chat(llm, "Describe a cat as a JSON object.")]
    plain_tokens = PERSON_MAX_TOKENS + 20  # outlives the constrained ones
    params = [SamplingParams(temperature=0.0, max_tokens=plain_tokens, ignore_eos=True,
                             logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=12, logprobs=2,
                             structured_outputs=StructuredOutputsParams(regex=r"[A-Z]{3}-\d{4}")),
              SamplingParams(temperature=0.0, max_tokens=PERSON_MAX_TOKENS, logprobs=2,
                             structured_outputs=StructuredOutputsParams(json=PERSON))]
    sync = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.engine
    monkeypatch.setattr(engine, "num_scheduler_steps", 4)
    monkeypatch.setattr(engine, "async_scheduling", True)
    windows, masked = [], []
    launch, sample = engine._launch, DecodeWindow.sample_with_bitmask

    def record(out, defer_masks=False):
        windows.append((out.num_steps, bool(engine.structured), defer_masks))
        return launch(out, defer_masks)

    def count(self, bitmask, rows):
        masked.append(len(rows))
        return sample(self, bitmask, rows)

    monkeypatch.setattr(engine, "_launch", record)
    monkeypatch.setattr(DecodeWindow, "sample_with_bitmask", count)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert re.fullmatch(r"[A-Z]{3}-\d{4}", outs[1].outputs[0].text)
    jsonschema.validate(json.loads(outs[2].outputs[0].text), PERSON)
    assert len(outs[0].outputs[0].token_ids) == plain_tokens
    assert any(steps == 4 and defer for steps, constrained, defer in windows if constrained)
    assert any(steps == 4 for steps, constrained, _ in windows if not constrained)
    # each window step with constrained rows sampled under masks, 2 rows while both ran
    assert len(masked) >= 10 and max(masked) == 2
    for got, want in zip(outs, sync):
        steps = [{t: lp.logprob for t, lp in step.items()} for step in want.outputs[0].logprobs]
        assert_same_greedy(got.outputs[0].token_ids, want.outputs[0].token_ids, steps,
                           NEAR_TIE_ACROSS_BATCH_SHAPES)
    assert engine._in_flight is None and not engine.structured._ahead
    _no_leaks(llm)


def test_sampled_constraints_in_decode_windows_always_validate(llm, monkeypatch):
    """Sampled at temperature 1 in windows of 4 steps launched ahead, beside unconstrained
    rows: every JSON output validates, every regex output matches; nothing consumed ahead
    is left once the requests are done."""
    engine = llm.engine
    monkeypatch.setattr(engine, "num_scheduler_steps", 4)
    monkeypatch.setattr(engine, "async_scheduling", True)
    pattern = r"[A-Z]{2}-\d{3}(-[a-z]{1,4})?"
    prompts, params = [], []
    for i in range(12):
        prompts.append(chat(llm, f"Describe {SUBJECTS[i % 10]} (number {i}) as a JSON object."))
        params.append(SamplingParams(temperature=1.0, max_tokens=PERSON_MAX_TOKENS,
                                     structured_outputs=StructuredOutputsParams(json=PERSON)))
    for i in range(6):
        prompts.append(chat(llm, f"Give a code for {SUBJECTS[i]}."))
        params.append(SamplingParams(temperature=1.0, max_tokens=20,
                                     structured_outputs=StructuredOutputsParams(regex=pattern)))
        prompts.append(chat(llm, f"Tell a story about {SUBJECTS[i]}."))
        params.append(SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True))
    fillers = []
    compute = engine.structured._compute_masks

    def record(which, mask):
        fillers.append(threading.current_thread().name)
        return compute(which, mask)

    monkeypatch.setattr(engine.structured, "_compute_masks", record)
    outs = llm.generate(prompts, params, use_tqdm=False)
    # a window launched ahead fills its masks beside the update of the one before
    assert any(name.startswith("pagedllm-masks") for name in fillers)
    assert engine.structured._filling is None
    for out in outs[:12]:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)
    for out in outs[12::2]:
        assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text
    assert all(len(out.outputs[0].token_ids) == 30 for out in outs[13::2])
    assert not engine.structured._ahead
    _no_leaks(llm)


def test_worker_applies_a_pickled_bitmask_to_its_rows_only(tiny):
    """The step contract: a StepBatch with a bitmask for its second sampled row survives
    pickling (tensor parallelism sends it to every rank); that row samples only allowed
    ids, the other rows sample what they sample without a mask."""
    import pickle

    from pagedllm.contract import NewSequence, StepBatch

    def run(mask):
        runner, caches = make_runner(tiny)
        batch = StepBatch(new_seqs=[NewSequence(i, p, SamplingParams(temperature=0.0))
                                    for i, p in enumerate([[5, 9, 13], [3, 3, 8], [7, 1]])])
        for i, p in enumerate([[5, 9, 13], [3, 3, 8], [7, 1]]):
            batch.add_row(i, [], 0, len(p), True)
            batch.block_tables[i] = (0, [i])
        if mask is not None:
            batch.token_bitmask, batch.token_bitmask_rows = mask, [1]
        batch = pickle.loads(pickle.dumps(batch))
        return [token_of(runner.launch(batch, caches).wait(), i) for i in range(3)]

    free = run(None)
    allowed = [t for t in (11, 42, 90) if t != free[1]]
    mask = torch.zeros(1, 4, dtype=torch.int32)  # 97 ids: 4 words
    for t in allowed:
        mask[0, t // 32] |= 1 << (t % 32)
    masked = run(mask)
    assert masked[1] in allowed
    assert masked[0] == free[0] and masked[2] == free[2]


def test_closing_object_schemas_only_narrows_them():
    from pagedllm.structured_grammar import close_objects

    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
        "c": {"type": "array", "items": {"type": "object", "properties": {"d": {}}}},
        "e": {"type": "object", "properties": {"f": {}}, "additionalProperties": True},
        "g": {"type": "object", "properties": {"h": {}}, "required": ["other"]},
        "i": {"type": "object", "properties": {"j": {}}, "allOf": [{"required": ["k"]}]},
        "l": {"not": {"type": "object", "properties": {"m": {}}}},
        "n": {"enum": [{"properties": {}}]},
    }}
    closed = close_objects(schema)
    props = closed["properties"]
    assert closed["additionalProperties"] is False
    assert props["a"]["additionalProperties"] is False
    assert props["c"]["items"]["additionalProperties"] is False
    assert props["e"]["additionalProperties"] is True
    for kept in ("g", "i", "l", "n"):
        assert props[kept] == schema["properties"][kept]
    assert "additionalProperties" not in schema  # a copy


def test_sequences_of_one_grammar_get_their_own_matchers(llm, monkeypatch):
    """A grammar is compiled once per mask-filling thread (copies of one compiled matcher
    take turns on its lexer) and copied per sequence: advancing one sequence's matcher
    leaves the other's where it was; the compiled ones kept are bounded."""
    from pagedllm.engine import structured_output
    from pagedllm.engine.sequence import Sequence, SequenceGroup

    manager = llm.engine.structured
    monkeypatch.setattr(structured_output, "MAX_CACHED_GRAMMARS", 2)
    monkeypatch.setattr(manager, "_fresh", type(manager._fresh)())
    monkeypatch.setattr(manager, "matchers", {})
    monkeypatch.setattr(manager, "mask_threads", 2)

    def group(choice):
        params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=choice))
        return SequenceGroup("g", [Sequence(0, [1], 16)], params)

    manager.start(100, group(["yes", "no"]))
    manager.start(101, group(["yes", "no"]))
    manager.start(104, group(["yes", "no"]))
    assert len(manager._fresh) == 1
    (fresh,) = manager._fresh.values()
    assert len(fresh.matchers) == 2 and fresh.handed == 3  # one per thread, in turn
    tok = llm.get_tokenizer()
    first = tok.encode("yes", add_special_tokens=False)
    for t in first:
        assert not manager.accept(100, t) or t == first[-1]
    assert manager.matchers[100].is_stopped() or manager.matchers[100].is_accepting()
    assert not manager.matchers[101].is_accepting()  # the copy has consumed nothing
    assert manager.matchers[101].consume_tokens(tok.encode("no", add_special_tokens=False))
    manager.start(102, group(["a", "b"]))
    manager.start(103, group(["c", "d"]))
    assert len(manager._fresh) == 2
    monkeypatch.setattr(structured_output, "MAX_CACHED_GRAMMARS", 10)
    monkeypatch.setattr(structured_output, "MAX_CACHED_MATCHERS", 3)
    manager.start(105, group(["c", "d"]))  # ["c", "d"]'s second fresh matcher: 3 kept
    manager.start(106, group(["e", "f"]))  # 4 kept: ["a", "b"], the least recent, goes
    assert [len(f.matchers) for f in manager._fresh.values()] == [2, 1]
    manager.start(107, group(["e", "f"]))  # 4 kept again: ["c", "d"] goes
    assert [len(f.matchers) for f in manager._fresh.values()] == [2]
    manager.free([100, 101, 102, 103, 104, 105, 106, 107])


def test_a_failed_background_fill_raises_in_its_step_only(llm, monkeypatch):
    """A mask fill that fails on the background thread raises where its step takes the
    masks (finish_fill), not in the calls that only wait for the matchers to be free; the
    next fill works."""
    from types import SimpleNamespace

    from pagedllm.engine.sequence import Sequence, SequenceGroup

    manager = llm.engine.structured
    monkeypatch.setattr(manager, "matchers", {})
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    manager.start(7, SequenceGroup("g", [Sequence(7, [1], 16)], params))
    batch = SimpleNamespace(seq_ids=[7], do_sample=[True], token_bitmask=None,
                            token_bitmask_rows=[])
    compute = manager._compute_masks

    def broken(which, mask):
        raise RuntimeError("lexer gone")

    monkeypatch.setattr(manager, "_compute_masks", broken)
    manager.start_fill(batch)
    manager.fork(7, 8)  # waits for the fill, raises nothing
    with pytest.raises(RuntimeError, match="lexer gone"):
        manager.finish_fill()
    monkeypatch.setattr(manager, "_compute_masks", compute)
    manager.start_fill(batch)
    manager.finish_fill()
    assert batch.token_bitmask_rows == [0] and batch.token_bitmask.shape == (1, manager.words)
    manager.free([7, 8])
