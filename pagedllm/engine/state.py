"""A snapshot of the engine for people to look at: queues, the KV block pool, counters.

`engine_state(scheduler)` reads the Scheduler and its BlockSpaceManager and returns plain data
(dicts, lists, strings) ready for JSON; it never changes them. Call it on the engine's thread,
between steps (AsyncLLMEngine.run_in_engine_thread), so the tables it reads are consistent.

It must stay cheap on a busy engine: one pass over the sequences' block tables and one over
the evictable cached blocks, never a pass over every block object of the pool. The pool
comes back as one string, a character per block (see BLOCK_CODES).
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.engine.block_manager import BlockSpaceManager
    from pagedllm.engine.scheduler import Scheduler
    from pagedllm.engine.sequence import SequenceGroup

# One character per block, GPU pool ("gpu_blocks") and CPU swap pool ("cpu_blocks").
FREE, USED, SHARED, CACHED, SWAPPED = "f", "u", "s", "c", "w"
BLOCK_CODES = {
    FREE: "free: holds nothing",
    USED: "used: in the block table of one sequence",
    SHARED: "shared: in the tables of several sequences (prefix-cache hit or a fork)",
    CACHED: "cached: no sequence holds it, its K/V stay reusable by the prefix cache",
    SWAPPED: "swapped: a preempted sequence's block in the CPU swap pool",
}


def engine_state(scheduler: Scheduler) -> dict[str, Any]:
    """The whole snapshot of the engine's scheduler (shape: docs/engine_state.md)."""
    bm = scheduler.block_manager
    queues = {
        "running": _entries(scheduler.running, bm),
        "waiting": _entries(scheduler.waiting, bm),
        "swapped": _entries(scheduler.swapped, bm),
    }
    gpu, cpu = pool_codes(bm)
    return {
        "time": time.time(),
        "block_size": bm.block_size,
        "num_gpu_blocks": bm.num_total_gpu_blocks,
        "num_cpu_blocks": bm.num_total_cpu_blocks,
        "gpu_blocks": gpu,
        "cpu_blocks": cpu,
        "kv_cache_usage": bm.gpu_usage(),
        "queues": queues,
        "counters": counters(scheduler),
    }


def pool_codes(bm: BlockSpaceManager) -> tuple[str, str]:
    """The GPU and CPU pools as strings of BLOCK_CODES, one character per block number."""
    gpu = bytearray(FREE.encode() * bm.num_total_gpu_blocks)
    cpu = bytearray(FREE.encode() * bm.num_total_cpu_blocks)
    used, shared, swapped = ord(USED), ord(SHARED), ord(SWAPPED)
    for table in bm.block_tables.values():
        if not table:
            continue
        if table[0].device == "gpu":  # a table's blocks all live on one device
            for block in table:
                gpu[block.block_number] = shared if block.ref_count > 1 else used
        else:
            for block in table:
                cpu[block.block_number] = swapped
    cached = ord(CACHED)
    for number in bm.gpu_allocator.evictor:  # ref_count 0, hash kept
        gpu[number] = cached
    return gpu.decode(), cpu.decode()


def _entries(groups: Iterable[SequenceGroup], bm: BlockSpaceManager) -> list[dict[str, Any]]:
    """One entry per sequence of the queue's requests (a request of n samples gives n).

    Flat dicts of ints and one list each: building and encoding them is most of the
    snapshot's cost, so nothing here goes through a property or an Enum."""
    tables = bm.block_number_tables
    out = []
    for group in groups:
        request_id, cached = group.request_id, group.num_cached_tokens
        for seq in group.seqs_dict.values():
            out.append({
                "request_id": request_id,
                "seq_id": seq.seq_id,
                "num_prompt_tokens": len(seq.prompt_token_ids),
                "num_cached_tokens": cached,
                "num_output_tokens": len(seq.output_token_ids),
                "num_computed_tokens": seq.num_computed_tokens,
                # A copy: the manager's own list changes under later steps.
                "blocks": list(tables.get(seq.seq_id, ())),
            })
    return out


def counters(scheduler: Scheduler) -> dict[str, Any]:
    """Totals since the engine started; a viewer shows their increases as events."""
    stats = scheduler.stats
    allocator = scheduler.block_manager.gpu_allocator
    return {
        "num_preemptions_recompute": stats.num_preemptions_recompute,
        "num_preemptions_swap": stats.num_preemptions_swap,
        "prefix_cache_queried_blocks": allocator.num_cache_queries,
        "prefix_cache_hit_blocks": allocator.num_cache_hits,
    }
