"""EngineCore.step against a fake executor (tests/fake_executor.py): schedule -> execute ->
sample -> update, with no model. The fake's tokens follow a rule, so the outputs, the
stops and the order of the executor's calls (async scheduling executes the next window
before it samples this one) are known exactly."""
from __future__ import annotations

from pagedllm.engine.block_manager import AllocStatus
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine_args import EngineArgs
from pagedllm.sampling_params import SamplingParams
from tests.fake_executor import FakeExecutor


def run(engine: LLMEngine) -> dict:
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def make(**kwargs) -> tuple[LLMEngine, FakeExecutor]:
    fake = FakeExecutor(**kwargs)
    return LLMEngine(EngineArgs(), executor=fake), fake


def assert_all_freed(engine: LLMEngine) -> None:
    bm = engine.scheduler.block_manager
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks
    assert not engine.requests


def test_one_step_at_a_time_executes_then_samples_each_batch():
    engine, fake = make()
    assert engine.num_scheduler_steps == 4  # the CPU's default window
    engine.num_scheduler_steps = 1
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))
    engine.add_request("b", [20], SamplingParams(max_tokens=2, ignore_eos=True))
    done = run(engine)
    assert done["a"].outputs[0].token_ids == [4, 5, 6, 7, 8]
    assert done["b"].outputs[0].token_ids == [21, 22]
    assert done["a"].outputs[0].finish_reason == "length"
    kinds = [kind for kind, _ in fake.calls]
    assert kinds == ["execute", "sample"] * (len(kinds) // 2)
    first = fake.calls[0][1]
    assert first.seq_ids == [0, 1] and first.num_scheduled_tokens == [3, 1]
    assert all(batch.num_steps == 1 for _, batch in fake.calls)
    # the executor's own copy of each sequence is what the engine appended
    assert fake.tokens[0] == [1, 2, 3, 4, 5, 6, 7]
    assert_all_freed(engine)


def test_async_windows_execute_ahead_and_drop_samples_past_a_stop():
    """On a GPU-like executor: decode windows of 8 steps, the next executed before this
    one's samples are read; a sequence stopping on EOS mid-window keeps nothing after it."""
    engine, fake = make(on_cuda=True, eos_token_id=30)
    engine.add_request("long", [10], SamplingParams(max_tokens=40, ignore_eos=True))
    engine.add_request("eos", [12], SamplingParams(max_tokens=40))
    done = run(engine)
    assert done["long"].outputs[0].token_ids == list(range(11, 51))
    assert done["eos"].outputs[0].token_ids == list(range(13, 31))
    assert done["eos"].outputs[0].finish_reason == "stop"
    assert any(batch.num_steps == 8 for _, batch in fake.calls)
    kinds = [kind for kind, _ in fake.calls]
    assert "execute execute sample" in " ".join(kinds)  # launched ahead
    executed = [id(b) for kind, b in fake.calls if kind == "execute"]
    sampled = [id(b) for kind, b in fake.calls if kind == "sample"]
    assert sorted(executed) == sorted(sampled)  # every executed batch was sampled once
    assert engine._in_flight is None
    assert_all_freed(engine)


def test_a_window_ends_with_the_longest_row_s_max_tokens():
    """The end of a decode window: batch-1 with max_tokens=2 runs its prefill and one
    decode sub-step, not a whole window of 8; in a batch, the window runs as long as the
    row with the most tokens left needs, no longer."""
    engine, fake = make(on_cuda=True)
    engine.add_request("short", [5], SamplingParams(max_tokens=2, ignore_eos=True))
    done = run(engine)
    assert done["short"].outputs[0].token_ids == [6, 7]
    assert fake.forwards == 2
    engine, fake = make(on_cuda=True)
    engine.add_request("a", [5], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.add_request("b", [9], SamplingParams(max_tokens=5, ignore_eos=True))
    done = run(engine)
    assert done["b"].outputs[0].token_ids == [10, 11, 12, 13, 14]
    assert [b.num_steps for kind, b in fake.calls if kind == "execute"] == [1, 4]
    assert fake.forwards == 5
    assert_all_freed(engine)


def test_steps_with_prompt_chunks_are_launched_ahead_and_answer_what_never_fits():
    """Async scheduling continues a step with prompt chunks too: the pending samples'
    decodes and the next admissions are executed before its samples are read, with the
    tokens of the rule. A request found there never to fit in the KV cache is answered
    with its error, not dropped."""
    engine, fake = make(on_cuda=True, num_gpu_blocks=8)  # 8 blocks of 16 tokens
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True))
    engine.step()  # the prompt, and the decode after it launched ahead
    engine.add_request("huge", [5, 6], SamplingParams(max_tokens=2))
    engine.add_request("b", [7, 8], SamplingParams(max_tokens=3, ignore_eos=True))
    bm = engine.scheduler.block_manager
    can_allocate = bm.can_allocate
    # The block manager's verdict on a prompt bigger than the cache (the engine's own
    # admission check refuses those before they reach the scheduler).
    bm.can_allocate = lambda group: AllocStatus.NEVER if group.request_id == "huge" \
        else can_allocate(group)
    done = run(engine)
    assert done["a"].outputs[0].token_ids == [4, 5, 6, 7, 8, 9]
    assert done["b"].outputs[0].token_ids == [9, 10, 11]
    assert "can never fit in the KV cache (128 tokens)" in done["huge"].error
    executed = [b for kind, b in fake.calls if kind == "execute"]
    assert executed[1].num_computed_tokens == [3]  # a's pending sample, before it was read
    assert any(b.new_seqs and b.seq_ids[0] == 0 and b.num_scheduled_tokens == [1, 2]
               for b in executed)  # b admitted in a step launched ahead
    assert engine._in_flight is None
    assert_all_freed(engine)
