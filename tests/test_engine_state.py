"""engine/state.py: the snapshot of GET /v1/engine/state read straight off a Scheduler (no
model): each block's code agrees with the block tables, swaps and prefix hits show, and the
`bench engine-state` workload measures it."""
from __future__ import annotations

import json

import pytest

from pagedllm.benchmarks.engine_state_bench import busy_scheduler, main, run_engine_state_bench
from pagedllm.engine.state import BLOCK_CODES, engine_state
from pagedllm.entrypoints.usage import UsageError
from pagedllm.entrypoints.web.schema import EngineState
from tests.test_scheduler import add, finish, make_scheduler, step


def codes_agree_with_tables(scheduler, state: dict) -> None:
    """Every GPU block of a running entry is used (u) or shared (s), shared exactly when
    several entries hold it; every swapped entry's block is a swapped CPU block."""
    holders: dict[int, int] = {}
    for entry in state["queues"]["running"]:
        for block in entry["blocks"]:
            holders[block] = holders.get(block, 0) + 1
    for block, n in holders.items():
        assert state["gpu_blocks"][block] == ("s" if n > 1 else "u"), (block, n)
    assert state["gpu_blocks"].count("u") + state["gpu_blocks"].count("s") == len(holders)
    evictable = set(scheduler.block_manager.gpu_allocator.evictor)
    assert {i for i, c in enumerate(state["gpu_blocks"]) if c == "c"} == evictable
    swapped = {b for e in state["queues"]["swapped"] for b in e["blocks"]}
    assert {i for i, c in enumerate(state["cpu_blocks"]) if c == "w"} == swapped
    assert set(state["gpu_blocks"] + state["cpu_blocks"]) <= set(BLOCK_CODES)


def test_shared_prefix_blocks_and_counters():
    scheduler = busy_scheduler(num_seqs=8, prompt_len=64, shared_len=32, num_gpu_blocks=0,
                               decode_steps=3)
    state = engine_state(scheduler)
    EngineState.model_validate({**state, "counters": {**state["counters"],
                                                      "generation_tokens": 0}})
    json.dumps(state)
    codes_agree_with_tables(scheduler, state)
    running = state["queues"]["running"]
    assert len(running) == 8 and state["queues"]["waiting"] == []
    # The two blocks of the shared 32 tokens: one copy, held by all eight sequences.
    firsts = {tuple(e["blocks"][:2]) for e in running}
    assert len(firsts) == 1 and state["gpu_blocks"].count("s") == 2
    assert state["counters"]["prefix_cache_hit_blocks"] > 0
    assert all(e["num_output_tokens"] >= 2 for e in running)
    # The snapshot is a copy: the engine's later steps do not change it.
    before = json.dumps(state)
    step(scheduler)
    assert json.dumps(state) == before


def test_swapped_and_cached_blocks_show():
    s = make_scheduler(num_gpu_blocks=2, num_cpu_blocks=4, preemption_mode="swap", caching=True)
    a, b = add(s, [1, 2, 3, 4], "a"), add(s, [5, 6, 7, 8], "b")
    step(s)
    step(s)  # b is swapped out to make room for a
    state = engine_state(s)
    codes_agree_with_tables(s, state)
    assert [e["request_id"] for e in state["queues"]["swapped"]] == ["b"]
    assert state["cpu_blocks"].count("w") == 1
    assert state["counters"]["num_preemptions_swap"] == 1
    finish(s, a)
    state = engine_state(s)
    codes_agree_with_tables(s, state)
    assert "c" in state["gpu_blocks"]  # a's full block stays cached


def test_bench_engine_state(capsys):
    result = run_engine_state_bench(num_seqs=16, prompt_len=32, shared_len=16, num_calls=3)
    assert result.num_seqs == 16 and result.num_calls == 3
    assert 0 < result.snapshot_mean_us <= result.mean_us and result.json_bytes > 1000
    assert main(["--num-seqs", "4", "--num-calls", "2"]) == 0
    assert "engine-state: 4 running seqs" in capsys.readouterr().out
    with pytest.raises(UsageError, match="need num_seqs >= 1"):
        main(["--num-seqs", "0"])
