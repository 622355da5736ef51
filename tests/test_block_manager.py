"""BlockAllocator and BlockSpaceManager: ref counts, prefix caching, copy-on-write, swapping."""
from __future__ import annotations

import itertools
import time

import pytest

from pagedllm.engine import block_manager
from pagedllm.engine.block import BlockAllocator
from pagedllm.engine.block_manager import AllocStatus, BlockSpaceManager, hash_block_tokens
from pagedllm.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.sampling_params import SamplingParams

BS = 4
_ids = itertools.count()


def make_group(tokens: list[int], **params) -> SequenceGroup:
    seq = Sequence(next(_ids), tokens, BS)
    return SequenceGroup(f"req-{seq.seq_id}", [seq], SamplingParams(**params))


def seq_of(group: SequenceGroup) -> Sequence:
    return group.get_seqs()[0]


def admit(bm: BlockSpaceManager, tokens: list[int], **params) -> Sequence:
    group = make_group(tokens, **params)
    bm.allocate(group)
    seq = seq_of(group)
    seq.status = SequenceStatus.RUNNING
    return seq


def compute_all(bm: BlockSpaceManager, seq: Sequence) -> None:
    """What a finished step does: every token now has K/V in the cache."""
    seq.num_computed_tokens = seq.get_len()
    bm.mark_blocks_computed(seq)


# ---- BlockAllocator --------------------------------------------------------------------------


def test_allocator_hands_out_distinct_blocks_and_counts_refs():
    a = BlockAllocator("gpu", BS, 3, enable_caching=False)
    blocks = [a.allocate() for _ in range(3)]
    assert sorted(b.block_number for b in blocks) == [0, 1, 2]
    assert all(b.ref_count == 1 for b in blocks)
    assert a.get_num_free_blocks() == 0
    with pytest.raises(ValueError, match="out of gpu KV-cache blocks"):
        a.allocate()
    blocks[1].ref_count += 1  # a second table shares it
    a.free(blocks[1])
    assert a.get_num_free_blocks() == 0 and blocks[1].ref_count == 1
    a.free(blocks[1])
    assert a.get_num_free_blocks() == 1
    with pytest.raises(ValueError, match="double free of gpu block 1"):
        a.free(blocks[1])
    assert a.allocate() is blocks[1]


def test_allocator_rejects_foreign_block():
    gpu = BlockAllocator("gpu", BS, 1, enable_caching=False)
    cpu = BlockAllocator("cpu", BS, 1, enable_caching=False)
    with pytest.raises(ValueError, match="is a cpu block, not gpu"):
        gpu.free(cpu.allocate())


def test_allocator_evicts_least_recently_freed_cached_block():
    a = BlockAllocator("gpu", BS, 3, enable_caching=True)
    b1, b2, b3 = a.allocate(11), a.allocate(22), a.allocate(33)
    for b in (b2, b1, b3):
        a.free(b)
    # Freed cached blocks stay findable and count as free.
    assert a.get_num_free_blocks() == 3 and a.get_num_evictable_blocks() == 3
    assert all(a.contains_hash(h) for h in (11, 22, 33))
    assert a.allocate() is b2 and not a.contains_hash(22) and b2.block_hash is None
    reused = a.allocate_cached(11)
    assert reused is b1 and b1.ref_count == 1 and a.get_num_evictable_blocks() == 1
    assert a.allocate() is b3  # b1 is in use now, so b3 is the only one left to evict
    with pytest.raises(ValueError, match="out of gpu"):
        a.allocate()


def test_allocator_prefers_free_list_over_evicting():
    a = BlockAllocator("gpu", BS, 2, enable_caching=True)
    cached, plain = a.allocate(5), a.allocate()
    a.free(cached)
    a.free(plain)
    assert a.allocate() is plain and a.contains_hash(5)


def test_allocator_hash_errors():
    a = BlockAllocator("gpu", BS, 2, enable_caching=True)
    a.allocate(7)
    with pytest.raises(ValueError, match="block hash 7 is already cached"):
        a.allocate(7)
    with pytest.raises(ValueError, match="block hash 8 is not cached on gpu"):
        a.allocate_cached(8)


def test_allocator_operations_do_not_scan_the_pool():
    # 50k allocations, frees, evictions: linear scans would take minutes, O(1) well under a second.
    n = 50_000
    a = BlockAllocator("gpu", BS, n, enable_caching=True)
    start = time.perf_counter()
    blocks = [a.allocate(i) for i in range(n)]
    for b in blocks:
        a.free(b)
    for i in range(n):
        a.allocate_cached(i) if i % 2 else a.allocate()
    elapsed = time.perf_counter() - start
    assert a.get_num_free_blocks() == 0
    assert elapsed < 5.0, f"{elapsed:.1f}s for {3 * n} operations"


# ---- prefix caching --------------------------------------------------------------------------


def test_prefix_cache_reuses_the_longest_computed_prefix():
    bm = BlockSpaceManager(BS, num_gpu_blocks=16, num_cpu_blocks=0, enable_caching=True)
    first = admit(bm, list(range(10)))  # blocks [0-3] [4-7] [8 9]
    compute_all(bm, first)
    group = make_group(list(range(8)) + [50, 51, 52])
    bm.allocate(group)
    second = seq_of(group)
    assert second.num_computed_tokens == 8 and group.num_cached_tokens == 8
    assert bm.get_block_table(second)[:2] == bm.get_block_table(first)[:2]
    assert bm.get_block_table(second)[2] != bm.get_block_table(first)[2]
    assert bm.gpu_allocator.blocks[bm.get_block_table(first)[0]].ref_count == 2
    # Only the first block matches here.
    third = admit(bm, list(range(4)) + [9, 9, 9, 9, 9])
    assert third.num_computed_tokens == 4
    # Lookups: 2 blocks per admission (the first one missed both).
    assert bm.prefix_cache_hit_rate() == pytest.approx((0 + 2 + 1) / (2 + 2 + 2))
    bm.check_invariants()


def test_prefix_cache_never_covers_the_last_token():
    bm = BlockSpaceManager(BS, 16, 0, enable_caching=True)
    compute_all(bm, admit(bm, list(range(12))))
    again = admit(bm, list(range(8)))  # two full blocks, both cached
    assert again.num_computed_tokens == 4  # the last block is recomputed for the logits
    assert bm.append_slots(again, 4) == []  # it writes into a block of its own
    bm.check_invariants()


def test_blocks_are_findable_only_once_computed():
    bm = BlockSpaceManager(BS, 16, 0, enable_caching=True)
    first = admit(bm, list(range(12)))
    assert admit(bm, list(range(12))).num_computed_tokens == 0
    first.num_computed_tokens = 5  # one chunk of a chunked prefill
    bm.mark_blocks_computed(first)
    assert admit(bm, list(range(12))).num_computed_tokens == 4
    bm.check_invariants()


def test_generated_tokens_fill_cacheable_blocks():
    bm = BlockSpaceManager(BS, 16, 0, enable_caching=True)
    seq = admit(bm, [1, 2, 3])
    for token in (4, 5, 6, 7, 8):  # decode: block [1 2 3 4] then [5 6 7 8] fill up
        compute_all(bm, seq)
        seq.append_token(token)
        bm.append_slots(seq, 1)
    compute_all(bm, seq)
    follower = admit(bm, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert follower.num_computed_tokens == 8
    bm.check_invariants()


def test_block_hashes_chain_over_the_prefix():
    shared_block = [7, 7, 7, 7]
    assert hash_block_tokens(hash_block_tokens(None, [1] * 4), shared_block) != hash_block_tokens(
        hash_block_tokens(None, [2] * 4), shared_block
    )
    bm = BlockSpaceManager(BS, 16, 0, enable_caching=True)
    x = admit(bm, [1] * 4 + shared_block + [0])
    y = admit(bm, [2] * 4 + shared_block + [0])
    compute_all(bm, x)
    compute_all(bm, y)
    x_block = bm.block_tables[x.seq_id][1]
    y_block = bm.block_tables[y.seq_id][1]
    # The same tokens after a different prefix are a different cache entry.
    assert x_block.block_hash is not None and y_block.block_hash is not None
    assert x_block.block_hash != y_block.block_hash
    assert len(bm.gpu_allocator.cached_blocks) == 4
    bm.check_invariants()


def test_a_hash_collision_is_a_cache_miss(monkeypatch):
    """Every block hashes alike: prompts with other tokens never get the cached KV, the same
    tokens still do."""
    monkeypatch.setattr(block_manager, "hash_block_tokens", lambda parent, tokens: 7)
    bm = BlockSpaceManager(BS, 16, 0, enable_caching=True, watermark=0)
    first = admit(bm, list(range(10)))
    compute_all(bm, first)
    assert list(bm.gpu_allocator.cached_blocks) == [7]  # one hash: the first block alone
    other = make_group([50 + t for t in range(10)])
    assert bm.can_allocate(other) == AllocStatus.OK
    bm.allocate(other)
    assert seq_of(other).num_computed_tokens == 0 and other.num_cached_tokens == 0
    assert not set(bm.get_block_table(seq_of(other))) & set(bm.get_block_table(first))
    same = admit(bm, list(range(10)))
    assert same.num_computed_tokens == 4  # block 0 hits; block 1's hash is block 0's
    assert bm.get_block_table(same)[0] == bm.get_block_table(first)[0]
    bm.check_invariants()


def test_a_colliding_block_after_another_prefix_is_a_cache_miss(monkeypatch):
    """Hashes that ignore the prefix: the same block tokens after another prefix collide.
    The hit must compare the whole prefix, not the block's own tokens only."""
    monkeypatch.setattr(block_manager, "hash_block_tokens", lambda parent, tokens: hash(tokens))
    bm = BlockSpaceManager(BS, 16, 0, enable_caching=True)
    shared_block = [7, 7, 7, 7]
    x = admit(bm, [1] * 4 + shared_block + [0])
    compute_all(bm, x)
    y = admit(bm, [2] * 4 + shared_block + [0])
    compute_all(bm, y)  # y's second block collides with x's: it stays uncached
    z = admit(bm, [2] * 4 + shared_block + [5])
    assert z.num_computed_tokens == 4  # y's first block only, never x's second
    assert bm.get_block_table(z)[1] not in bm.get_block_table(x)
    bm.check_invariants()


def test_identical_prompts_computed_side_by_side_cache_one_copy():
    bm = BlockSpaceManager(BS, 16, 0, enable_caching=True)
    a, b = admit(bm, list(range(9))), admit(bm, list(range(9)))
    compute_all(bm, a)
    compute_all(bm, b)
    assert len(bm.gpu_allocator.cached_blocks) == 2
    assert all(blk.block_hash is None for blk in bm.block_tables[b.seq_id])
    bm.free(b)
    bm.free(a)
    assert bm.get_num_free_gpu_blocks() == 16
    bm.check_invariants()


def test_evicted_prefix_loses_its_tail_first():
    bm = BlockSpaceManager(BS, num_gpu_blocks=8, num_cpu_blocks=0, enable_caching=True)
    prefix = list(range(12))
    a = admit(bm, prefix)
    compute_all(bm, a)
    bm.free(a)  # three cached blocks, evictable
    assert bm.get_num_free_gpu_blocks() == 8 and bm.gpu_usage() == 0.0
    b = admit(bm, list(range(100, 124)))  # six blocks: five free ones + one eviction
    bm.free(b)
    again = admit(bm, prefix + [99])
    assert again.num_computed_tokens == 8  # the head survived, the tail block went first
    bm.check_invariants()


def test_prompt_logprobs_requests_skip_the_prefix_cache():
    bm = BlockSpaceManager(BS, 16, 0, enable_caching=True)
    compute_all(bm, admit(bm, list(range(12))))
    assert admit(bm, list(range(12)), prompt_logprobs=1).num_computed_tokens == 0


def test_no_prefix_caching_when_disabled():
    bm = BlockSpaceManager(BS, 16, 0, enable_caching=False)
    compute_all(bm, admit(bm, list(range(12))))
    assert admit(bm, list(range(12))).num_computed_tokens == 0
    assert not bm.gpu_allocator.cached_blocks and bm.prefix_cache_hit_rate() == 0.0


# ---- admission -------------------------------------------------------------------------------


def test_can_allocate_ok_later_never():
    bm = BlockSpaceManager(BS, num_gpu_blocks=4, num_cpu_blocks=0, enable_caching=False,
                           watermark=0)
    assert bm.can_allocate(make_group(list(range(17)))) == AllocStatus.NEVER  # 5 blocks
    admit(bm, list(range(8)))
    assert bm.can_allocate(make_group(list(range(8)))) == AllocStatus.OK
    assert bm.can_allocate(make_group(list(range(9)))) == AllocStatus.LATER


def test_watermark_keeps_blocks_free_but_an_empty_pool_admits_anything_that_fits():
    bm = BlockSpaceManager(BS, num_gpu_blocks=100, num_cpu_blocks=0, enable_caching=False,
                           watermark=0.1)
    assert bm.can_allocate(make_group([0] * 400)) == AllocStatus.OK  # the whole (empty) pool
    admit(bm, [0] * 4)
    assert bm.can_allocate(make_group([0] * 4 * 89)) == AllocStatus.OK  # leaves 10 free
    assert bm.can_allocate(make_group([0] * 4 * 90)) == AllocStatus.LATER


def test_cached_blocks_held_by_others_cost_nothing_at_admission():
    bm = BlockSpaceManager(BS, num_gpu_blocks=5, num_cpu_blocks=0, enable_caching=True, watermark=0)
    compute_all(bm, admit(bm, list(range(13))))  # 4 blocks, 3 of them cached
    assert bm.get_num_free_gpu_blocks() == 1
    # 4 blocks, but its first 3 are the cached ones: only 1 new block needed.
    assert bm.can_allocate(make_group(list(range(12)) + [77])) == AllocStatus.OK
    assert bm.can_allocate(make_group([5] * 13)) == AllocStatus.LATER


# ---- growth, fork and copy-on-write ----------------------------------------------------------


def test_append_slots_grows_one_block_per_block_size_tokens():
    bm = BlockSpaceManager(BS, 8, 0, enable_caching=False)
    seq = admit(bm, [1, 2, 3, 4])
    assert len(bm.get_block_table(seq)) == 1
    compute_all(bm, seq)
    seq.append_token(5)
    assert bm.append_slots(seq, 1) == []
    assert len(bm.get_block_table(seq)) == 2 and bm.get_num_free_gpu_blocks() == 6
    with pytest.raises(ValueError, match="2 new tokens after 4 computed exceed its 5 tokens"):
        bm.append_slots(seq, 2)


def test_fork_shares_blocks_and_copies_the_partial_one_on_write():
    bm = BlockSpaceManager(BS, 8, 0, enable_caching=True)
    parent = admit(bm, [1, 2, 3, 4, 5, 6])
    compute_all(bm, parent)
    parent.append_token(7)
    child = parent.fork(next(_ids))
    bm.fork(parent, child)
    assert bm.get_block_table(child) == bm.get_block_table(parent)
    shared_full, shared_partial = bm.block_tables[parent.seq_id]
    assert shared_full.ref_count == 2 and shared_partial.ref_count == 2
    bm.check_invariants()
    copies = bm.append_slots(parent, 1)
    new_last = bm.get_block_table(parent)[1]
    assert copies == [(shared_partial.block_number, new_last)]
    assert shared_partial.ref_count == 1
    assert bm.append_slots(child, 1) == []  # the child is now the only owner
    assert bm.get_block_table(child)[1] == shared_partial.block_number
    assert shared_full.ref_count == 2  # the full, cached block stays shared
    bm.check_invariants()
    bm.free(parent)
    bm.free(child)
    assert bm.get_num_free_gpu_blocks() == 8
    bm.check_invariants()


def test_fork_at_a_block_boundary_needs_no_copy():
    bm = BlockSpaceManager(BS, 8, 0, enable_caching=False)
    parent = admit(bm, [1, 2, 3, 4])
    compute_all(bm, parent)
    parent.append_token(5)
    child = parent.fork(next(_ids))
    bm.fork(parent, child)
    assert bm.append_slots(parent, 1) == [] and bm.append_slots(child, 1) == []
    assert bm.get_block_table(parent)[1] != bm.get_block_table(child)[1]
    bm.check_invariants()


def test_can_append_slots_counts_the_last_writer_of_a_shared_block_as_free():
    bm = BlockSpaceManager(BS, num_gpu_blocks=3, num_cpu_blocks=0, enable_caching=False)
    group = make_group([1, 2, 3, 4, 5, 6])
    bm.allocate(group)
    parent = seq_of(group)
    parent.status = SequenceStatus.RUNNING
    compute_all(bm, parent)
    parent.append_token(7)
    children = [parent.fork(next(_ids)) for _ in range(2)]
    for child in children:
        bm.fork(parent, child)
        group.add(child)
    # Three writers of the shared partial block, one free block: two copies needed.
    assert not bm.can_append_slots(group)
    group.remove(children[1].seq_id)
    bm.free(children[1])
    assert bm.can_append_slots(group)  # two writers: one copy, the last keeps the original
    assert len(bm.append_slots(parent, 1) + bm.append_slots(children[0], 1)) == 1
    assert bm.get_num_free_gpu_blocks() == 0
    bm.check_invariants()


# ---- swapping --------------------------------------------------------------------------------


def test_swap_out_and_in_round_trip_keeps_contents_and_sharing():
    bm = BlockSpaceManager(BS, num_gpu_blocks=8, num_cpu_blocks=8, enable_caching=True)
    group = make_group(list(range(10)))
    bm.allocate(group)
    parent = seq_of(group)
    parent.status = SequenceStatus.RUNNING
    compute_all(bm, parent)
    parent.append_token(10)
    child = parent.fork(next(_ids))
    child.output_token_ids[-1] = 11
    bm.fork(parent, child)
    group.add(child)
    copies = bm.append_slots(parent, 1) + bm.append_slots(child, 1)
    # A fake KV cache: each block holds the tokens written into it.
    gpu: dict[int, list] = {}
    for seq in (parent, child):
        for i, b in enumerate(bm.get_block_table(seq)):
            gpu[b] = seq.get_token_ids()[i * BS: (i + 1) * BS]
    assert len(copies) == 1

    assert bm.can_swap_out(group)
    out = bm.swap_out(group)
    assert len(out) == 4  # 2 shared blocks + 2 own last blocks, each moved once
    assert bm.get_num_free_gpu_blocks() == 8 and bm.get_num_free_cpu_blocks() == 4
    for seq in (parent, child):
        seq.status = SequenceStatus.SWAPPED
    bm.check_invariants()
    cpu = {dst: gpu[src] for src, dst in out}
    for b in list(gpu):  # freed blocks not kept by the prefix cache may be overwritten
        if b not in bm.gpu_allocator.evictor:
            gpu[b] = None
    with pytest.raises(ValueError, match="is swapped out"):
        bm.append_slots(parent, 1)

    assert bm.can_swap_in(group) == AllocStatus.OK
    back = bm.swap_in(group)
    for src, dst in back:
        gpu[dst] = cpu[src]
    assert len(back) == 2  # the two cached full blocks were found on the GPU again
    for seq in (parent, child):
        seq.status = SequenceStatus.RUNNING
        for i, b in enumerate(bm.get_block_table(seq)):
            assert gpu[b] == seq.get_token_ids()[i * BS: (i + 1) * BS]
    assert bm.get_block_table(parent)[:2] == bm.get_block_table(child)[:2]
    assert bm.get_num_free_cpu_blocks() == 8 and bm.get_num_free_gpu_blocks() == 4
    bm.check_invariants()


def test_can_swap_out_and_in_respect_pool_sizes():
    bm = BlockSpaceManager(BS, num_gpu_blocks=4, num_cpu_blocks=2, enable_caching=False,
                           watermark=0)
    group = make_group(list(range(12)))  # 3 blocks
    bm.allocate(group)
    seq_of(group).status = SequenceStatus.RUNNING
    assert not bm.can_swap_out(group)
    bm2 = BlockSpaceManager(BS, num_gpu_blocks=3, num_cpu_blocks=4, enable_caching=False,
                            watermark=0)
    group = make_group(list(range(12)))
    bm2.allocate(group)
    seq = seq_of(group)
    seq.status = SequenceStatus.RUNNING
    compute_all(bm2, seq)
    seq.append_token(1)
    bm2.swap_out(group)
    seq.status = SequenceStatus.SWAPPED
    # Swapping back needs its 3 blocks plus one to grow into: more than the whole pool.
    assert bm2.can_swap_in(group) == AllocStatus.NEVER


def test_free_unknown_sequence_is_a_no_op_and_tables_are_required():
    bm = BlockSpaceManager(BS, 4, 0)
    stranger = Sequence(next(_ids), [1], BS)
    bm.free(stranger)
    with pytest.raises(ValueError, match=f"sequence {stranger.seq_id} has no block table"):
        bm.append_slots(stranger, 1)
    with pytest.raises(ValueError, match="watermark must be in"):
        BlockSpaceManager(BS, 4, 0, watermark=1.5)


# ---- the decode fast path --------------------------------------------------------------------


def test_num_blocks_to_append_is_zero_exactly_when_append_slots_has_nothing_to_do():
    bm = BlockSpaceManager(BS, 8, 0, enable_caching=False)
    seq = admit(bm, [1, 2, 3])
    live = bm.live_block_table(seq)
    assert bm.num_blocks_to_append([seq]) == 0 and bm.append_slots(seq, 3) == []
    compute_all(bm, seq)
    seq.append_token(4)  # fits the first block
    assert bm.num_blocks_to_append([seq]) == 0 and bm.append_slots(seq, 1) == []
    assert len(live) == 1
    compute_all(bm, seq)
    seq.append_token(5)  # needs a second block
    assert bm.num_blocks_to_append([seq]) == 1
    assert bm.append_slots(seq, 1) == [] and len(live) == 2
    assert bm.num_blocks_to_append([seq]) == 0
    # Forked: both write the shared partial block; one copy, the last writer keeps it.
    child = seq.fork(next(_ids))
    bm.fork(seq, child)
    assert bm.num_blocks_to_append([seq, child]) == 1
    assert bm.num_blocks_to_append([child]) == 1  # alone it still may not write a shared block
    (copy,) = bm.append_slots(seq, 1)
    assert copy == (bm.get_block_table(child)[1], live[1])  # the live list follows the copy
    assert live == bm.get_block_table(seq)
    assert bm.num_blocks_to_append([seq, child]) == 0 and bm.append_slots(child, 1) == []
    bm.check_invariants()


def test_mark_blocks_computed_registers_each_block_once_as_it_fills():
    bm = BlockSpaceManager(BS, 8, 0, enable_caching=True)
    seq = admit(bm, [1, 2, 3])
    for token in range(4, 12):
        seq.num_computed_tokens += 1 if seq.num_computed_tokens else 3
        bm.mark_blocks_computed(seq)
        full = seq.num_computed_tokens // BS
        assert len(bm.computed_hashes[seq.seq_id]) == full
        assert len(bm.gpu_allocator.cached_blocks) == full
        seq.append_token(token)
        bm.append_slots(seq, 1)
    bm.check_invariants()
