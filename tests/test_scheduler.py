"""Scheduler: token budget, chunked prefill, prefix hits, preemption, swapping, forks, aborts."""
from __future__ import annotations

import itertools

import pytest

from pagedllm.config import CacheConfig, SchedulerConfig
from tests.scheduler_helpers import mark_step_computed
from pagedllm.engine.scheduler import Scheduler, SchedulerOutput
from pagedllm.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.sampling_params import SamplingParams

BS = 4
_ids = itertools.count()


def make_scheduler(
    num_gpu_blocks: int = 64,
    num_cpu_blocks: int = 16,
    caching: bool = False,
    **scheduler_kwargs,
) -> Scheduler:
    scheduler_kwargs.setdefault("max_model_len", 256)
    return Scheduler(
        SchedulerConfig(**scheduler_kwargs),
        CacheConfig(block_size=BS, enable_prefix_caching=caching),
        num_gpu_blocks,
        num_cpu_blocks,
    )


def add(scheduler: Scheduler, tokens: list[int], request_id: str | None = None,
        **params) -> SequenceGroup:
    seq = Sequence(next(_ids), tokens, BS)
    group = SequenceGroup(request_id or f"req-{seq.seq_id}", [seq], SamplingParams(**params))
    scheduler.add_seq_group(group)
    return group


def step(scheduler: Scheduler, token: int = 1) -> SchedulerOutput:
    """One engine step: schedule, 'run the model', append a token to every sampled sequence."""
    out = scheduler.schedule()
    mark_step_computed(scheduler, out)
    for scheduled in out.scheduled_seq_groups:
        if scheduled.do_sample:
            for seq in scheduled.seq_group.get_seqs(SequenceStatus.RUNNING):
                seq.append_token(token)
    scheduler.block_manager.check_invariants()
    return out


def chunks(out: SchedulerOutput) -> dict[str, tuple[int, bool]]:
    return {s.seq_group.request_id: (s.token_chunk_size, s.do_sample)
            for s in out.scheduled_seq_groups}


def finish(scheduler: Scheduler, group: SequenceGroup) -> None:
    for seq in group.get_seqs():
        seq.status = SequenceStatus.FINISHED_STOPPED
    scheduler.free_finished_seq_groups()


def test_chunked_prefill_splits_a_long_prompt_under_the_budget():
    s = make_scheduler(max_num_batched_tokens=32)
    group = add(s, list(range(100)), "a")
    seq = group.get_seqs()[0]
    seen = []
    for _ in range(4):
        out = step(s)
        seen.append(chunks(out)["a"])
        assert out.num_batched_tokens == seen[-1][0]
        # The table always covers the whole prompt, and the step's tokens.
        assert len(out.block_tables[seq.seq_id]) == 25
    assert seen == [(32, False), (32, False), (32, False), (4, True)]
    assert seq.num_computed_tokens == 100 and seq.get_output_len() == 1
    assert chunks(step(s)) == {"a": (1, True)}  # decode
    assert seq.num_computed_tokens == 101


def test_without_chunked_prefill_a_prompt_runs_in_one_step_or_waits():
    s = make_scheduler(max_num_batched_tokens=128, max_model_len=128,
                       enable_chunked_prefill=False)
    add(s, list(range(100)), "a")
    add(s, list(range(50)), "b")
    assert chunks(step(s)) == {"a": (100, True)}  # "b" does not fit the rest of the budget
    assert chunks(step(s)) == {"a": (1, True), "b": (50, True)}


def test_requests_share_the_token_budget_in_arrival_order():
    s = make_scheduler(max_num_batched_tokens=32)
    add(s, list(range(20)), "a")
    add(s, list(range(20)), "b")
    add(s, list(range(20)), "c")
    out = step(s)
    assert chunks(out) == {"a": (20, True), "b": (12, False)} and out.num_batched_tokens == 32
    out = step(s)
    assert chunks(out) == {"a": (1, True), "b": (8, True), "c": (20, True)}
    assert out.num_batched_tokens == 29
    assert chunks(step(s)) == {"a": (1, True), "b": (1, True), "c": (1, True)}


def test_max_num_seqs_caps_running_sequences():
    s = make_scheduler(max_num_seqs=2)
    for name in "abc":
        add(s, [1, 2, 3], name)
    assert set(chunks(step(s))) == {"a", "b"}
    assert s.num_waiting == 1 and s.num_running == 2
    finish(s, s.running[0])
    assert set(chunks(step(s))) == {"b", "c"}


def test_best_of_reserves_its_forks_at_admission():
    s = make_scheduler(max_num_seqs=3)
    add(s, [1, 2], "a", n=1, best_of=2)
    add(s, [1, 2], "b", n=1, best_of=2)
    assert set(chunks(step(s))) == {"a"}
    with pytest.raises(ValueError, match="needs 4 sequences .* at most 3"):
        add(s, [1], "c", n=4)


def test_prefix_cache_hit_skips_computed_blocks():
    s = make_scheduler(caching=True)
    prompt = list(range(30))
    add(s, prompt, "a")
    assert chunks(step(s)) == {"a": (30, True)}
    group = add(s, prompt[:24] + [99, 98], "b")
    out = step(s)
    assert chunks(out)["b"] == (2, True)  # 24 cached tokens, 2 computed
    assert group.num_cached_tokens == 24
    assert group.get_seqs()[0].num_computed_tokens == 26
    # Block lookups: "a" 7 (all missed), "b" 6 (all hit).
    assert s.prefix_cache_hit_rate == pytest.approx(6 / (7 + 6))


def test_recompute_preempts_the_newest_group_first():
    s = make_scheduler(num_gpu_blocks=3, num_cpu_blocks=0, preemption_mode="recompute")
    a, b, c = (add(s, [1, 2, 3, 4], name) for name in "abc")
    out = step(s)  # each prompt fills its one block; each now needs a second block
    assert set(chunks(out)) == {"a", "b", "c"}
    out = step(s)
    # "a" takes the block of "c" (the newest); "b" then is the newest left and yields itself.
    assert chunks(out) == {"a": (1, True)}
    assert out.num_preempted == 2 and s.stats.num_preemptions_recompute == 2
    assert [g.request_id for g in s.waiting] == ["b", "c"]
    for group in (b, c):
        seq = group.get_seqs()[0]
        assert seq.status == SequenceStatus.WAITING and seq.num_computed_tokens == 0
        assert seq.get_output_len() == 1 and seq.seq_id not in s.block_manager.block_tables
    finish(s, a)
    out = step(s)
    # "b" recomputes prompt + its output, and samples the next token.
    assert chunks(out) == {"b": (5, True)}


def test_swap_preemption_moves_the_newest_group_to_cpu_and_back():
    s = make_scheduler(num_gpu_blocks=2, num_cpu_blocks=4, preemption_mode="swap")
    a, b = add(s, [1, 2, 3, 4], "a"), add(s, [5, 6, 7, 8], "b")
    step(s)
    out = step(s)
    assert chunks(out) == {"a": (1, True)}
    b_seq = b.get_seqs()[0]
    assert len(out.blocks_to_swap_out) == 1 and s.stats.num_preemptions_swap == 1
    assert b_seq.status == SequenceStatus.SWAPPED and list(s.swapped) == [b]
    assert b_seq.num_computed_tokens == 4  # its K/V are kept, on the CPU
    assert s.cpu_cache_usage == pytest.approx(0.25)
    # A swap-out's source block may go to another sequence in the same step.
    assert out.blocks_to_swap_out[0][0] in out.block_tables[a.get_seqs()[0].seq_id]
    finish(s, a)
    out = step(s)
    assert chunks(out) == {"b": (1, True)}
    assert len(out.blocks_to_swap_in) == 1 and not s.swapped
    assert b_seq.status == SequenceStatus.RUNNING and b_seq.num_computed_tokens == 5
    assert s.cpu_cache_usage == 0.0


def test_swap_falls_back_to_recompute_without_cpu_space():
    s = make_scheduler(num_gpu_blocks=2, num_cpu_blocks=0, preemption_mode="swap")
    add(s, [1, 2, 3, 4], "a")
    add(s, [5, 6, 7, 8], "b")
    step(s)
    step(s)
    assert [g.request_id for g in s.waiting] == ["b"] and not s.swapped
    assert s.stats.num_preemptions_recompute == 1 and s.stats.num_preemptions_swap == 0


def test_forked_groups_are_always_swapped():
    s = make_scheduler(num_gpu_blocks=5, num_cpu_blocks=8, preemption_mode="recompute")
    add(s, [1, 2, 3, 4], "a")
    b = add(s, [1, 2, 3, 4, 5], "b", n=1, best_of=2)
    step(s)
    parent = b.get_seqs()[0]
    child = parent.fork(next(_ids))
    s.fork_seq(parent, child)
    assert child.status == SequenceStatus.RUNNING and b.num_seqs() == 2
    out = step(s)  # "a" grows into a 2nd block; "b"'s forks copy their shared partial block
    assert chunks(out) == {"a": (1, True), "b": (1, True)}
    assert out.num_batched_tokens == 3 and len(out.blocks_to_copy) == 1
    assert s.block_manager.get_num_free_gpu_blocks() == 0
    for _ in range(2):
        assert chunks(step(s)) == {"a": (1, True), "b": (1, True)}
    out = step(s)
    # Both forks need a 3rd block: "b" goes to the CPU (forks cannot be recomputed).
    assert chunks(out) == {"a": (1, True)} and out.num_preempted == 1
    assert list(s.swapped) == [b] and s.stats.num_preemptions_swap == 1
    assert len(out.blocks_to_swap_out) == 3  # the shared first block moves once
    assert all(seq.status == SequenceStatus.SWAPPED for seq in b.get_seqs())


def test_a_prompt_that_never_fits_is_ignored():
    s = make_scheduler(num_gpu_blocks=4, max_model_len=64)
    too_big = add(s, list(range(17)), "big")  # 5 blocks > 4
    too_long = add(s, list(range(65)), "long")  # longer than max_model_len
    ok = add(s, list(range(5)), "ok")
    out = step(s)
    assert [g.request_id for g in out.ignored_seq_groups] == ["big", "long"]
    for group in (too_big, too_long):
        assert group.get_seqs()[0].status == SequenceStatus.FINISHED_IGNORED
    assert chunks(out) == {"ok": (5, True)} and ok.get_seqs()[0].get_output_len() == 1
    assert s.get_num_unfinished_seq_groups() == 1


def test_a_lone_sequence_that_outgrows_the_pool_is_ignored():
    s = make_scheduler(num_gpu_blocks=1, num_cpu_blocks=4, preemption_mode="swap")
    group = add(s, [1, 2, 3, 4], "a")
    step(s)
    out = step(s)  # needs a second block, and nothing else can give one up
    assert out.ignored_seq_groups == [group] and not s.has_unfinished_seqs()
    assert group.get_seqs()[0].status == SequenceStatus.FINISHED_IGNORED
    assert s.block_manager.get_num_free_gpu_blocks() == 1


def test_waiting_requests_wait_while_preemption_happens_or_groups_are_swapped():
    s = make_scheduler(num_gpu_blocks=2, num_cpu_blocks=4, preemption_mode="swap")
    add(s, [1, 2, 3, 4], "a")
    add(s, [5, 6, 7, 8], "b")
    step(s)
    add(s, [9], "c")
    out = step(s)  # "b" is swapped out: nothing new is admitted this step
    assert out.num_preempted == 1 and "c" not in chunks(out)
    out = step(s)  # "b" cannot swap back in yet, so "c" still waits behind it
    assert set(chunks(out)) == {"a"} and s.num_waiting == 1


def test_abort_frees_blocks_in_every_queue():
    s = make_scheduler(num_gpu_blocks=2, num_cpu_blocks=4, preemption_mode="swap")
    a, b = add(s, [1, 2, 3, 4], "a"), add(s, [5, 6, 7, 8], "b")
    c = add(s, [9], "c")
    step(s)
    step(s)  # a running, b swapped, c waiting
    assert s.num_running == 1 and s.num_swapped == 1 and s.num_waiting == 1
    s.abort_seq_group(["a", "b", "unknown"])
    s.abort_seq_group("c")
    for group in (a, b, c):
        assert group.get_seqs()[0].status == SequenceStatus.FINISHED_ABORTED
    assert not s.has_unfinished_seqs() and s.get_num_unfinished_seq_groups() == 0
    assert s.block_manager.get_num_free_gpu_blocks() == 2
    assert s.block_manager.get_num_free_cpu_blocks() == 4
    assert s.schedule().is_empty()
    s.block_manager.check_invariants()


def test_a_finished_fork_frees_its_blocks_while_its_sibling_runs():
    s = make_scheduler(num_gpu_blocks=8)
    group = add(s, [1, 2, 3], "a", n=2)
    step(s)
    parent = group.get_seqs()[0]
    child = parent.fork(next(_ids))
    s.fork_seq(parent, child)
    step(s)
    used = 8 - s.block_manager.get_num_free_gpu_blocks()
    child.status = SequenceStatus.FINISHED_LENGTH
    assert s.free_finished_seq_groups() == []
    assert 8 - s.block_manager.get_num_free_gpu_blocks() < used
    assert chunks(step(s)) == {"a": (1, True)}
    parent.status = SequenceStatus.FINISHED_STOPPED
    assert s.free_finished_seq_groups() == [group]
    assert not s.has_unfinished_seqs() and s.block_manager.get_num_free_gpu_blocks() == 8


def test_bad_requests_raise_clear_errors():
    s = make_scheduler()
    add(s, [1], "a")
    with pytest.raises(ValueError, match="request id 'a' is already scheduled"):
        add(s, [2], "a")
    with pytest.raises(ValueError, match="request 'e' has an empty prompt"):
        add(s, [], "e")
    stranger = Sequence(next(_ids), [1], BS)
    with pytest.raises(ValueError, match=f"sequence {stranger.seq_id} is not running"):
        s.fork_seq(stranger, stranger.fork(next(_ids)))


def test_metrics_report_queues_and_cache_usage():
    s = make_scheduler(num_gpu_blocks=10)
    add(s, list(range(8)), "a")
    add(s, list(range(8)), "b")
    assert (s.num_waiting, s.num_running, s.num_swapped) == (2, 0, 0)
    step(s)
    assert (s.num_waiting, s.num_running) == (0, 2)
    assert s.gpu_cache_usage == pytest.approx(0.4)  # 2 x 2 prompt blocks
    step(s)
    assert s.gpu_cache_usage == pytest.approx(0.6)  # each grew into a third block


# ---- the per-step fast path ------------------------------------------------------------------


def test_block_tables_are_the_block_managers_live_lists():
    s = make_scheduler()
    group = add(s, [1, 2, 3], "a")
    seq = group.get_seqs()[0]
    table = step(s).block_tables[seq.seq_id]  # prompt in one block; len 4 after sampling
    assert table == s.block_manager.get_block_table(seq) == [table[0]]
    assert s.block_manager.get_block_table(seq) is not table  # get_block_table: a snapshot
    assert step(s).block_tables[seq.seq_id] is table and len(table) == 1
    out = step(s)  # the 5th token needs a second block: the same list grows
    assert out.block_tables[seq.seq_id] is table and len(table) == 2
    assert table == s.block_manager.get_block_table(seq)


def test_copy_on_write_shows_in_the_steps_block_tables():
    s = make_scheduler()
    group = add(s, [1, 2, 3, 4, 5], "a", n=2)
    step(s)  # len 6: the second block is partial
    parent = group.get_seqs()[0]
    child = parent.fork(next(_ids))
    s.fork_seq(parent, child)
    out = s.schedule()
    parent_table, child_table = out.block_tables[parent.seq_id], out.block_tables[child.seq_id]
    # The parent writes first, so it copies; the child, the last writer, keeps the original.
    assert out.blocks_to_copy == [(child_table[1], parent_table[1])]
    assert parent_table[0] == child_table[0] and parent_table[1] != child_table[1]
    assert parent_table == s.block_manager.get_block_table(parent)
    s.block_manager.check_invariants()


def test_steady_decoding_builds_no_status_lists_and_counts_no_slots(monkeypatch):
    s = make_scheduler(max_num_seqs=8)
    for i in range(6):
        add(s, [i, 1, 2], f"r{i}")
    step(s)
    calls = {"get_seqs": 0, "_seq_slots": 0}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(SequenceGroup, "get_seqs", counting("get_seqs", SequenceGroup.get_seqs))
    monkeypatch.setattr(Scheduler, "_seq_slots",
                        staticmethod(counting("_seq_slots", Scheduler._seq_slots)))
    out = s.schedule()
    mark_step_computed(s, out)
    s.free_finished_seq_groups()
    assert len(out.scheduled_seq_groups) == 6
    assert calls == {"get_seqs": 0, "_seq_slots": 0}
    for scheduled in out.scheduled_seq_groups:
        for seq in scheduled.seq_group.seqs_dict.values():
            seq.append_token(1)
    # With a request waiting, each running group is counted once (not once per queue).
    add(s, [9], "w")
    out = s.schedule()
    assert len(out.scheduled_seq_groups) == 7
    assert calls["_seq_slots"] == 6 + 1  # the 6 running groups and the admitted one


def test_a_finished_fork_gives_its_slot_to_a_waiting_request():
    s = make_scheduler(max_num_seqs=2)
    group = add(s, [1, 2, 3], "a", n=2)  # reserves both slots
    step(s)
    add(s, [4, 5], "b")
    parent = group.get_seqs()[0]
    child = parent.fork(next(_ids))
    s.fork_seq(parent, child)
    assert set(chunks(step(s))) == {"a"}
    child.status = SequenceStatus.FINISHED_STOPPED  # its blocks are still held
    assert set(chunks(step(s))) == {"a", "b"}
    assert s.num_waiting == 0


def test_the_scheduler_benchmark_reports_a_decode_step():
    from pagedllm.benchmarks.scheduler_bench import run_scheduler_bench

    r = run_scheduler_bench(num_seqs=4, prompt_len=10, num_steps=6, block_size=4, num_waiting=2)
    assert (r.num_seqs, r.num_steps, r.num_waiting) == (4, 6, 2)
    assert 0 < r.p50_us <= r.p99_us <= r.max_us and r.schedule_mean_us <= r.mean_us
    assert 0 < r.cpu_p50_us and 0 < r.cpu_mean_us
    with pytest.raises(ValueError, match="num_waiting must be non-negative, got -1"):
        run_scheduler_bench(num_seqs=1, num_waiting=-1)


def test_lookahead_slots_cover_the_multi_step_tokens_and_come_back():
    scheduler = make_scheduler(num_gpu_blocks=8)
    a = add(scheduler, [1] * 6)
    b = add(scheduler, [2] * 3)
    step(scheduler)  # prefill: each samples its first token (lengths 7 and 4)
    out = scheduler.schedule()  # a decode of one token each
    bm = scheduler.block_manager
    free = bm.get_num_free_gpu_blocks()
    # 5 tokens past the one this step computes: a covers 7 + 5 = 12 tokens (3 blocks),
    # b covers 4 + 5 = 9 (3 blocks).
    assert scheduler.reserve_lookahead(out, 5)
    assert [len(out.block_tables[g.get_seqs()[0].seq_id]) for g in (a, b)] == [3, 3]
    assert bm.get_num_free_gpu_blocks() == free - 3
    bm.check_invariants()
    # The engine appends the samples of all six steps, then counts them computed.
    for g in (a, b):
        for _ in range(6):
            g.get_seqs()[0].append_token(3)
    mark_step_computed(scheduler, out, 6)
    assert [g.get_seqs()[0].num_computed_tokens for g in (a, b)] == [12, 9]
    out = scheduler.schedule()  # a's 13th token needs a 4th block
    assert chunks(out) == {a.request_id: (1, True), b.request_id: (1, True)}
    assert bm.get_num_free_gpu_blocks() == free - 4
    # Too many for the pool: nothing is reserved.
    assert not scheduler.reserve_lookahead(out, 40)
    assert bm.get_num_free_gpu_blocks() == free - 4
    finish(scheduler, a)
    finish(scheduler, b)
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks
