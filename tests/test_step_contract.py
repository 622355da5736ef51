"""The plain step contract between engine and worker (pagedllm/contract.py): the worker builds its
own state from the batches' deltas, batches survive pickling (tensor parallelism will send
them to other ranks), and async scheduling (the next decode window launched before the
running one's samples are read) gives the synchronous results."""
from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.config import CacheConfig, ModelConfig, SchedulerConfig
from tests.scheduler_helpers import mark_step_computed
from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.sequence import Sequence, SequenceGroup
from pagedllm.loader import initialize_dummy_weights
from pagedllm.models.registry import build_model
from pagedllm.contract import Fork, NewSequence, StepBatch
from pagedllm.worker.model_runner import ModelRunner

PROMPT = "Once upon a time, in a small village by the sea, there lived"
CPU = torch.device("cpu")


# ------------------------------------------------------------- the worker's own state


@pytest.fixture(scope="module")
def tiny():
    config = ModelConfig(
        architecture="llama", vocab_size=97, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
        max_position_embeddings=64,
    )
    model = build_model(config)
    initialize_dummy_weights(model, seed=3)
    return model.eval(), config


def make_runner(tiny, block_size=4, num_blocks=16):
    model, c = tiny
    runner = ModelRunner(model, block_size, eos_token_ids=[], layer_devices=[CPU] * 2)
    shape = (2, num_blocks, block_size, c.num_key_value_heads, c.head_dim)
    return runner, [torch.zeros(shape) for _ in range(c.num_hidden_layers)]


def token_of(result, seq_id, step=0):
    return result.samples()[step][seq_id][0].token_id


GREEDY = SamplingParams(temperature=0.0)


def test_a_decode_token_not_sent_yet_comes_from_the_last_step(tiny):
    """Async scheduling: step 2 is launched before the engine saw step 1's sample; the
    worker feeds that sample from the device and computes what the synchronous step does."""
    prompts = {0: [5, 9, 13, 2, 7, 40], 1: [3, 3, 8]}
    results = {}
    for mode in ("sync", "async"):
        runner, caches = make_runner(tiny)
        first = StepBatch(new_seqs=[NewSequence(i, p, GREEDY) for i, p in prompts.items()],
                          block_tables={0: (0, [3, 7]), 1: (0, [1])})
        for i, p in prompts.items():
            first.add_row(i, [], 0, len(p), True)
        r1 = runner.launch(first, caches).wait()
        second = StepBatch(block_tables={1: (1, [12])})  # seq 1 grows into a second block
        for i, p in prompts.items():
            sent = [token_of(r1, i)] if mode == "sync" else []
            second.add_row(i, sent, len(p), 1, True)
        r2 = runner.launch(second, caches).wait()
        results[mode] = [(token_of(r1, i), token_of(r2, i)) for i in prompts]
        assert runner.seqs[1].block_table == [1, 12]
        assert runner.seqs[0].output_token_ids == ([token_of(r1, 0)] if mode == "sync" else [])
    assert results["async"] == results["sync"]


def test_the_worker_rejects_tokens_it_was_never_sent(tiny):
    runner, caches = make_runner(tiny)
    batch = StepBatch(new_seqs=[NewSequence(0, [1, 2, 3], GREEDY)], block_tables={0: (0, [0])})
    batch.add_row(0, [], 0, 3, False)  # a prompt chunk: nothing sampled
    runner.launch(batch, caches).wait()
    decode = StepBatch()
    decode.add_row(0, [], 3, 1, True)
    with pytest.raises(ValueError, match=r"sequence 0: tokens \[3, 4\) were never sent to the "
                                         r"worker \(it holds 3\) and are not the last step's"):
        runner.launch(decode, caches).wait()
    unknown = StepBatch()
    unknown.add_row(7, [4], 3, 1, True)
    with pytest.raises(ValueError, match="sequence 7 is not known to the worker"):
        runner.launch(unknown, caches).wait()


def test_forks_copy_the_parent_and_freed_sequences_are_dropped(tiny):
    runner, caches = make_runner(tiny)
    seeded = SamplingParams(temperature=1.0, seed=11, n=2)
    batch = StepBatch(new_seqs=[NewSequence(0, [4, 5, 6], seeded, seed=11)],
                      block_tables={0: (0, [2])}, num_samples={0: 2})
    batch.add_row(0, [], 0, 3, True)
    first = runner.launch(batch, caches).wait().samples()[0][0]
    assert len(first) == 2  # the parent's row drew both samples
    fork = StepBatch(forks=[Fork(0, 1, seed=12)], block_tables={1: (0, [2])})
    fork.add_row(0, [first[0].token_id], 3, 1, True)
    fork.add_row(1, [first[1].token_id], 3, 1, True)
    runner.launch(fork, caches).wait()
    child = runner.seqs[1]
    assert child.prompt_token_ids == [4, 5, 6] and child.output_token_ids == [first[1].token_id]
    assert child.generator is not None and child.generator is not runner.seqs[0].generator
    runner.launch(StepBatch(freed_seq_ids=[0, 1]), caches).wait()
    assert runner.seqs == {}


# ------------------------------------------------------------------ the engine's side

PLAIN_TYPES = (int, float, bool, str, type(None), SamplingParams)


def assert_plain(value, path="batch"):
    """Only ints, floats, strings, lists, tuples, dicts, SamplingParams and the contract's
    own dataclasses: no engine object crosses."""
    if dataclasses.is_dataclass(value) and not isinstance(value, SamplingParams):
        assert type(value) in (StepBatch, NewSequence, Fork), f"{path}: {type(value)}"
        for f in dataclasses.fields(value):
            assert_plain(getattr(value, f.name), f"{path}.{f.name}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            assert_plain(v, f"{path}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            assert_plain(k, f"{path} key")
            assert_plain(v, f"{path}[{k!r}]")
    else:
        assert isinstance(value, PLAIN_TYPES), f"{path}: {type(value)}"


def _no_leaks(llm):
    engine = llm.engine
    bm = engine.scheduler.block_manager
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks
    assert not engine.has_unfinished_requests()


def test_batches_are_plain_data_that_survive_pickling(default_llm, monkeypatch):
    """Forks (n/best_of), seeded sampling and prompt logprobs give the same results when
    every batch goes through pickle, as it will to another rank."""
    prompts = [PROMPT, "The capital of France is"]
    params = [SamplingParams(n=2, best_of=3, temperature=0.9, seed=3, max_tokens=6, logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=5, prompt_logprobs=2)]
    engine = default_llm.engine
    direct = default_llm.generate(prompts, params, use_tqdm=False)
    launch = engine.worker.execute
    batches = []

    def pickled(batch):
        assert_plain(batch)
        batches.append(batch)
        return launch(pickle.loads(pickle.dumps(batch)))

    monkeypatch.setattr(engine.worker, "execute", pickled)
    again = default_llm.generate(prompts, params, use_tqdm=False)
    assert any(b.forks for b in batches) and any(b.freed_seq_ids for b in batches)
    for a, b in zip(direct, again):
        assert [o.token_ids for o in b.outputs] == [o.token_ids for o in a.outputs]
    for got, want in zip(again[1].prompt_logprobs[1:], direct[1].prompt_logprobs[1:]):
        assert got.keys() == want.keys()
        assert [e.logprob for e in got.values()] == pytest.approx(
            [e.logprob for e in want.values()], abs=1e-4)
    _no_leaks(default_llm)


def _count_continuations(engine, monkeypatch) -> list[int]:
    """The step count of every window async scheduling launched ahead."""
    launched: list[int] = []
    schedule_continuation = engine.scheduler.schedule_continuation

    def counting(prev, max_num_steps, structured_ok=False):
        out = schedule_continuation(prev, max_num_steps, structured_ok)
        if out is not None:
            launched.append(out.num_steps)
        return out

    monkeypatch.setattr(engine.scheduler, "schedule_continuation", counting)
    return launched


def _assert_same_outputs(sync, overlapped) -> None:
    """The same tokens, text and finish reasons, and the first request's logprobs."""
    for a, b in zip(sync, overlapped):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].text == a.outputs[0].text
        assert b.outputs[0].finish_reason == a.outputs[0].finish_reason
    for got, want in zip(overlapped[0].outputs[0].logprobs, sync[0].outputs[0].logprobs):
        assert got.keys() == want.keys()
        for token, entry in got.items():
            assert entry.rank == want[token].rank
            assert entry.logprob == pytest.approx(want[token].logprob, abs=1e-4)


@pytest.mark.parametrize("num_steps", [1, 4])
def test_async_scheduling_gives_the_synchronous_results(default_llm, monkeypatch, num_steps):
    """Greedy with logprobs, seeded sampling, a stop string, EOS and max_tokens of every
    size: the same tokens, text, logprobs and finish reasons when each decode window is
    launched before the previous one's samples are read (the forward is synchronous on
    the CPU, but the engine's order is the CUDA one). A min_tokens that runs out exactly
    where the answer's EOS comes: launched ahead one step at a time, that step must count
    the token still in flight, or EOS stays masked one step too long."""
    engine = default_llm.engine
    hi = default_llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "Hi!"}], tokenize=False, add_generation_prompt=True)
    natural = default_llm.generate(hi, SamplingParams(temperature=0.0, max_tokens=40),
                                   use_tqdm=False)[0].outputs[0]
    assert natural.finish_reason == "stop" and natural.token_ids[-1] in engine.eos_token_ids
    prompts = [PROMPT, "Hello", "The capital of France is", "Count: 1, 2, 3, 4,", PROMPT, hi]
    params = [
        SamplingParams(temperature=0.0, max_tokens=11, logprobs=2),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=9, seed=5),
        SamplingParams(temperature=0.0, max_tokens=40, stop=["."]),
        SamplingParams(temperature=0.0, max_tokens=6),
        SamplingParams(temperature=0.0, max_tokens=2),
        SamplingParams(temperature=0.0, max_tokens=40,
                       min_tokens=len(natural.token_ids) - 1),  # EOS allowed at its place
    ]
    monkeypatch.setattr(engine, "num_scheduler_steps", num_steps)
    sync = default_llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(engine, "async_scheduling", True)
    launched = _count_continuations(engine, monkeypatch)
    overlapped = default_llm.generate(prompts, params, use_tqdm=False)
    assert len(launched) >= 2 and max(launched) == num_steps
    assert sync[2].outputs[0].finish_reason == "stop"
    assert sync[5].outputs[0].token_ids == natural.token_ids
    _assert_same_outputs(sync, overlapped)
    assert engine._in_flight is None
    _no_leaks(default_llm)


@pytest.mark.parametrize("num_steps", [1, 4])
def test_async_scheduling_through_prompt_chunks_and_admissions(default_llm, monkeypatch,
                                                              num_steps):
    """A token budget of 16 chunks every prompt and admits requests while others decode:
    steps with prompt chunks are launched ahead too (the next chunk, the pending sample's
    decode, an admission), with the synchronous tokens, logprobs and finish reasons."""
    engine = default_llm.engine
    prompts = [PROMPT, "Hello", PROMPT + " a fisherman who", "Count: 1, 2, 3, 4, 5, 6, 7,",
               "The capital of France is", PROMPT]
    params = [
        SamplingParams(temperature=0.0, max_tokens=7, logprobs=2),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=9, seed=5),
        SamplingParams(temperature=0.0, max_tokens=12, stop=["."]),
        SamplingParams(temperature=0.0, max_tokens=1),
        SamplingParams(temperature=0.0, max_tokens=6, min_tokens=3),
        SamplingParams(temperature=0.7, max_tokens=8, seed=11, ignore_eos=True),
    ]
    monkeypatch.setattr(engine, "num_scheduler_steps", num_steps)
    monkeypatch.setattr(engine.scheduler.scheduler_config, "max_num_batched_tokens", 16)
    sync = default_llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(engine, "async_scheduling", True)
    mixed = []
    schedule_continuation = engine.scheduler.schedule_continuation

    def recording(prev, max_num_steps, structured_ok=False):
        out = schedule_continuation(prev, max_num_steps, structured_ok)
        if out is not None and out.pending_tokens is not None:
            mixed.append([(x.token_chunk_size, x.do_sample) for x in out.scheduled_seq_groups])
        return out

    monkeypatch.setattr(engine.scheduler, "schedule_continuation", recording)
    overlapped = default_llm.generate(prompts, params, use_tqdm=False)
    chunks = [row for step in mixed for row in step]
    assert (1, True) in chunks and any(c > 1 and not sample for c, sample in chunks)
    assert any(c > 1 and sample for c, sample in chunks)  # a prompt's last chunk
    _assert_same_outputs(sync, overlapped)
    assert engine._in_flight is None
    _no_leaks(default_llm)


def test_async_streaming_and_an_abort_while_a_window_runs(default_llm, monkeypatch):
    """A request aborted while its next window is already launched gets no output after
    the abort; the other request streams the synchronous tokens; every block comes back."""
    engine = default_llm.engine
    monkeypatch.setattr(engine, "stream_outputs", True)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("alone", PROMPT, greedy)
    want = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            want += out.deltas[0][1]
    monkeypatch.setattr(engine, "async_scheduling", True)
    engine.add_request("keep", PROMPT, greedy)
    engine.add_request("drop", "Hello", SamplingParams(max_tokens=30, ignore_eos=True))
    got, after_abort = [], []
    aborted = False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "keep":
                got += out.deltas[0][1]
            elif aborted:
                after_abort.append(out)
        if not aborted and engine._in_flight is not None:
            engine.abort_request("drop")
            aborted = True
    assert aborted and after_abort == []
    assert got == want
    _no_leaks(default_llm)


# ------------------------------------------------------------ the scheduler's side


def scheduler_with(prompts, max_num_seqs=8, num_gpu_blocks=64, max_num_batched_tokens=2048,
                   **params):
    s = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=64,
                                  max_num_batched_tokens=max_num_batched_tokens),
                  CacheConfig(block_size=4, enable_prefix_caching=False), num_gpu_blocks, 0)
    groups = []
    for i, p in enumerate(prompts):
        group = SequenceGroup(f"r{i}", [Sequence(i, p, 4)], SamplingParams(**params))
        s.add_seq_group(group)
        groups.append(group)
    return s, groups


def decode_once(s):
    """Prefill every prompt and append its first token: the next schedule is a decode."""
    out = s.schedule()
    mark_step_computed(s, out)
    for scheduled in out.scheduled_seq_groups:
        for seq in scheduled.seq_group.get_seqs():
            seq.append_token(1)


def test_continuation_assumes_the_running_window_and_reserves_its_slots():
    s, groups = scheduler_with([[1] * 5, [2] * 9], max_tokens=20)
    decode_once(s)
    prev = s.schedule(max_num_steps=3)
    assert prev.num_steps == 3
    nxt = s.schedule_continuation(prev, 3)
    assert nxt.num_pending_tokens == 3 and nxt.num_steps == 3
    for group in groups:
        (seq,) = group.get_seqs()
        assert len(nxt.block_tables[seq.seq_id]) * 4 >= seq.get_len() + 3 + 3 - 1
    s.block_manager.check_invariants()


def test_continuation_leaves_out_what_finishes_by_length_and_waits_when_it_must():
    s, groups = scheduler_with([[1] * 5, [2] * 9], max_tokens=3)
    decode_once(s)
    groups[1].sampling_params.max_tokens = 10
    prev = s.schedule(max_num_steps=2)  # r0 reaches max_tokens=3 in this window
    nxt = s.schedule_continuation(prev, 2)
    assert [x.seq_group.request_id for x in nxt.scheduled_seq_groups] == ["r1"]
    # A waiting request that could start now: the next step must see the samples first.
    s.add_seq_group(SequenceGroup("late", [Sequence(9, [3, 4], 4)], SamplingParams()))
    assert s.schedule_continuation(prev, 2) is None


@pytest.mark.parametrize("params", [dict(repetition_penalty=1.2), dict(n=2)])
def test_no_continuation_for_sampling_that_reads_its_own_output(params):
    s, _ = scheduler_with([[1] * 5], max_tokens=20, **params)
    decode_once(s)
    assert s.schedule_continuation(s.schedule(), 1) is None


def test_windows_and_continuations_for_min_tokens_and_structured_outputs():
    """A pending min_tokens needs only the count (the worker counts each step), a grammar
    its masks step by step after the launch: such sequences decode in windows, and go on
    in continuations, structured ones only where the worker takes masks after the launch
    (`structured_ok`); otherwise one step per schedule, none launched ahead."""
    s, _ = scheduler_with([[1] * 5], max_tokens=20, min_tokens=5)
    decode_once(s)
    prev = s.schedule(max_num_steps=4)
    assert prev.num_steps == 4
    nxt = s.schedule_continuation(prev, 4)
    assert nxt is not None and nxt.num_steps == 4
    for structured_ok, steps in ((False, 1), (True, 4)):
        s, _ = scheduler_with([[1] * 5], max_tokens=20,
                              structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
        decode_once(s)
        prev = s.schedule(max_num_steps=4, structured_ok=structured_ok)
        assert prev.num_steps == steps
        nxt = s.schedule_continuation(prev, 4, structured_ok=structured_ok)
        assert (nxt.num_steps if nxt else None) == (4 if structured_ok else None)


def _rows(out):
    """(request id, chunk, do_sample, pending tokens) of each scheduled group."""
    return [(x.seq_group.request_id, x.token_chunk_size, x.do_sample,
             out.pending_tokens.get(x.seq_group.get_seqs()[0].seq_id, 0))
            for x in out.scheduled_seq_groups]


def test_continuation_after_prompt_chunks_decodes_continues_and_admits():
    """After a step with prompt chunks, the step after it as `schedule` would make it once
    the samples are in: a sequence whose prompt ended decodes its pending sample (its
    input starts after the whole chunk), one in the middle of its prompt takes its next
    chunk under the token budget (sampling when it reaches the prompt's end), and a
    waiting request is admitted with what budget is left."""
    s, groups = scheduler_with([[1] * 5, [2] * 9], max_num_batched_tokens=8, max_tokens=20)
    prev = s.schedule()
    assert [(x.token_chunk_size, x.do_sample) for x in prev.scheduled_seq_groups] == \
        [(5, True), (3, False)]
    s.add_seq_group(SequenceGroup("late", [Sequence(7, [3] * 6, 4)], SamplingParams()))
    nxt = s.schedule_continuation(prev, 4)
    assert nxt.num_steps == 1
    assert _rows(nxt) == [("r0", 1, True, 5), ("r1", 6, True, 3), ("late", 1, False, 0)]
    assert nxt.num_batched_tokens == 8
    (r0,) = groups[0].get_seqs()
    assert len(nxt.block_tables[r0.seq_id]) * 4 >= r0.get_len() + 1  # the pending sample's slot
    s.block_manager.check_invariants()
    # The engine's order: `prev`'s update, then the continuation's.
    mark_step_computed(s, prev)
    r0.append_token(1)
    mark_step_computed(s, nxt)
    assert [seq.num_computed_tokens for g in groups for seq in g.get_seqs()] == [6, 9]
    s.block_manager.check_invariants()


def test_a_continuation_keeps_to_the_token_budget():
    """The rows of a continuation share the token budget in FCFS order, as `schedule`'s: a
    prompt chunk gets what the rows before it left, and a waiting request nothing."""
    s, _ = scheduler_with([[1] * 3, [2] * 9, [3] * 2], max_num_batched_tokens=6,
                          max_tokens=20)
    prev = s.schedule()
    assert [(x.token_chunk_size, x.do_sample) for x in prev.scheduled_seq_groups] == \
        [(3, True), (3, False)]
    s.add_seq_group(SequenceGroup("late", [Sequence(9, [4] * 6, 4)], SamplingParams()))
    nxt = s.schedule_continuation(prev, 1)
    assert _rows(nxt) == [("r0", 1, True, 3), ("r1", 5, False, 3)]
    assert nxt.num_batched_tokens == 6
    assert [g.request_id for g in s.waiting] == ["r2", "late"]


def test_a_continuation_admits_only_what_it_can_carry_on():
    """A waiting request that forks or reads its own output at its first sample, or has a
    grammar, is left for `schedule` (FCFS: nothing after it is admitted either); a step
    with such a sequence running is not continued."""
    for params in (dict(n=2), dict(repetition_penalty=1.2),
                   dict(structured_outputs=StructuredOutputsParams(regex="[a-z]+"))):
        s, _ = scheduler_with([[1] * 5], max_tokens=20)
        prev = s.schedule()
        s.add_seq_group(SequenceGroup("odd", [Sequence(7, [3] * 6, 4)],
                                      SamplingParams(max_tokens=5, **params)))
        s.add_seq_group(SequenceGroup("plain", [Sequence(8, [3] * 6, 4)], SamplingParams()))
        nxt = s.schedule_continuation(prev, 1)
        assert _rows(nxt) == [("r0", 1, True, 5)], params
        s, _ = scheduler_with([[1] * 5], max_tokens=20, **params)
        assert s.schedule_continuation(s.schedule(), 1) is None, params


def test_no_continuation_when_the_slots_do_not_fit():
    s, _ = scheduler_with([[1] * 7], max_tokens=40, num_gpu_blocks=3)
    decode_once(s)
    prev = s.schedule(max_num_steps=4)  # the window fills the 2 blocks it has + 1
    assert prev.num_steps == 4
    assert s.schedule_continuation(prev, 4) is None  # 4 more would need a 4th block
