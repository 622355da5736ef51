"""Scheduler.update_from_output with no model: a step's tokens, written by hand, into its
sequences (append, computed tokens, the token-level stops, free), and the output
processor's one way back in (`finish_on_stop_string`)."""
from __future__ import annotations

import numpy as np

from pagedllm.contract import StepResult
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.scheduler import ScheduledSequenceGroup, SchedulerOutput
from pagedllm.engine.sequence import SequenceStatus
from pagedllm.engine_args import EngineArgs
from pagedllm.sampling_params import SamplingParams
from tests.fake_executor import FakeExecutor

EOS = 63


def result(seq_ids: list[int], ids: list[list[int]], num_samples: list[int] | None = None,
           logprob: float = -0.5) -> StepResult:
    """`ids`: [step][sample]."""
    ids = np.array(ids, dtype=np.int64)
    n = len(seq_ids)
    return StepResult(
        seq_ids=seq_ids, num_samples=num_samples or [1] * n, num_logprobs=[0] * n,
        token_ids=ids, logprobs=np.full(ids.shape, logprob),
        ranks=np.ones(ids.shape, dtype=np.int64),
        top_token_ids=np.zeros((*ids.shape, 0), dtype=np.int64),
        top_logprobs=np.zeros((*ids.shape, 0)))


def engine_with(*requests: tuple[str, list[int], SamplingParams]) -> LLMEngine:
    engine = LLMEngine(EngineArgs(), executor=FakeExecutor(eos_token_id=EOS))
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    return engine


def decode(engine: LLMEngine, *request_ids: str) -> SchedulerOutput:
    """A decode window's schedule (one token per sequence per step) of these requests."""
    return SchedulerOutput(scheduled_seq_groups=[
        ScheduledSequenceGroup(engine.requests[r], 1, True) for r in request_ids])


def seq_of(engine: LLMEngine, request_id: str):
    (seq,) = engine.requests[request_id].get_seqs()
    return seq


def test_prefill_appends_and_eos_stops_and_frees():
    engine = engine_with(("a", [1, 2, 3], SamplingParams(max_tokens=8)),
                         ("b", [7], SamplingParams(max_tokens=8)),
                         ("c", [9], SamplingParams(max_tokens=8, min_tokens=2)))
    out = engine.scheduler.schedule()
    update = engine.scheduler.update_from_output(out, result([0, 1, 2], [[5, EOS, EOS]]))
    a, b, c = (seq_of(engine, r) for r in "abc")
    assert a.output_token_ids == [5] and a.num_computed_tokens == 3
    assert a.status is SequenceStatus.RUNNING and a.cumulative_logprob == -0.5
    assert b.status is SequenceStatus.FINISHED_STOPPED and b.stop_reason is None
    assert b.seq_id not in engine.scheduler.block_manager.block_tables
    assert c.status is SequenceStatus.RUNNING  # EOS before min_tokens is a token like any
    assert update.num_new == {0: 1, 1: 1, 2: 1}
    # A finished row of a step that ran meanwhile (async scheduling) is skipped.
    again = engine.scheduler.update_from_output(decode(engine, "b"), result([1], [[4]]))
    assert again.rows == [] and b.output_token_ids == [EOS]


def test_window_stops_on_a_stop_token_and_at_max_tokens():
    engine = engine_with(("a", [1, 2, 3], SamplingParams(max_tokens=9, stop_token_ids=[12])),
                         ("b", [4], SamplingParams(max_tokens=3, ignore_eos=True)),
                         ("c", [6], SamplingParams(max_tokens=9, ignore_eos=True)))
    scheduler = engine.scheduler
    scheduler.update_from_output(scheduler.schedule(), result([0, 1, 2], [[5, 5, 5]]))
    steps = [[10, EOS, EOS], [11, 20, EOS], [12, 21, 30], [13, 22, 31]]
    update = scheduler.update_from_output(decode(engine, "a", "b", "c"),
                                          result([0, 1, 2], steps))
    a, b, c = (seq_of(engine, r) for r in "abc")
    # the tokens after a stop are dropped; each appended token but the last is computed
    assert a.output_token_ids == [5, 10, 11, 12] and a.stop_reason == 12
    assert a.status is SequenceStatus.FINISHED_STOPPED and a.num_computed_tokens == 6
    assert b.output_token_ids == [5, EOS, 20] and b.status is SequenceStatus.FINISHED_LENGTH
    assert c.output_token_ids == [5, EOS, EOS, 30, 31] and c.num_computed_tokens == 5
    assert c.status is SequenceStatus.RUNNING and c.cumulative_logprob == -2.5
    assert update.num_new == {0: 3, 1: 2, 2: 4}
    tables = scheduler.block_manager.block_tables
    assert a.seq_id not in tables and b.seq_id not in tables and c.seq_id in tables


def test_first_sample_of_n_forks_and_stop_string_drops_the_rest():
    engine = engine_with(("a", [1, 2], SamplingParams(n=2, max_tokens=9, stop=["x"])))
    scheduler = engine.scheduler
    out = scheduler.schedule()
    engine.batch_builder.build(out)  # the parent is sent: it can be forked
    update = scheduler.update_from_output(out, result([0], [[5, 6]], num_samples=[2]))
    parent, child = engine.requests["a"].get_seqs()
    assert (parent.output_token_ids, child.output_token_ids) == ([5], [6])
    assert child.num_computed_tokens == parent.num_computed_tokens == 2
    assert update.num_new == {parent.seq_id: 1, child.seq_id: 1}
    update = scheduler.update_from_output(
        decode(engine, "a"), result([parent.seq_id, child.seq_id], [[7, 8], [9, 10], [11, 12]],
                                    logprob=-1.0))
    # the output processor saw a stop string end at the 2nd output token of the parent
    scheduler.finish_on_stop_string(parent, "x", 2, update)
    assert parent.output_token_ids == [5, 7] and parent.cumulative_logprob == -1.5
    assert parent.status is SequenceStatus.FINISHED_STOPPED and parent.stop_reason == "x"
    assert update.num_new[parent.seq_id] == 1
    assert parent.seq_id not in scheduler.block_manager.block_tables
    assert child.output_token_ids == [6, 8, 10, 12] and child.status is SequenceStatus.RUNNING
