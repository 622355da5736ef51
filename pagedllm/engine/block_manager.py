"""BlockSpaceManager: the block table of every sequence, on the GPU pool or the CPU swap pool.

Prefix caching: a full block is known by a chained hash, hash((parent_hash, its tokens)), so
the same tokens after a different prefix never match. A hit compares tokens too: a cached
block keeps its BlockTokens (its token ids and its parent's BlockTokens), and a lookup matches
only when the whole prefix is equal, so a hash collision is a miss, never another prompt's
KV. A block becomes findable only once its K/V are computed (`mark_blocks_computed`); a new
prompt then reuses its longest run of cached leading blocks, but never its last token, which
must be computed to produce logits. Cached blocks are always full and never written again,
so they are shared without copy-on-write.

Per decode step the common case (the last block has room and is not shared, no block fills
up) costs a few attribute checks: `num_blocks_to_append`, `append_slots` and
`mark_blocks_computed` each test for it first and only then take the general path.
"""
from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable

from pagedllm.engine.block import BlockAllocator, PhysicalTokenBlock
from pagedllm.engine.sequence import Sequence, SequenceGroup, SequenceStatus

BlockTable = list[PhysicalTokenBlock]


class AllocStatus(enum.Enum):
    OK = "ok"  # fits now
    LATER = "later"  # fits once other requests free their blocks
    NEVER = "never"  # bigger than the whole GPU pool


def hash_block_tokens(parent_hash: int | None, token_ids: Iterable[int]) -> int:
    return hash((parent_hash, tuple(token_ids)))


class BlockTokens:
    """The content of one full block: its token ids after those of the blocks before it
    (`parent`, None for a sequence's first block), and its chained hash."""

    __slots__ = ("parent", "token_ids", "hash")

    def __init__(self, parent: BlockTokens | None, token_ids: Iterable[int]) -> None:
        self.parent = parent
        self.token_ids = tuple(token_ids)
        self.hash = hash_block_tokens(parent.hash if parent is not None else None, self.token_ids)

    def same_as(self, other: BlockTokens) -> bool:
        """Every token of the two prefixes is equal. Callers build a block's content on the
        content they matched for the block before it, so the walk usually stops at once on
        a shared parent."""
        a: BlockTokens | None = self
        b: BlockTokens | None = other
        while a is not b:
            if a is None or b is None or a.hash != b.hash or a.token_ids != b.token_ids:
                return False
            a, b = a.parent, b.parent
        return True


def root_block(seq: Sequence) -> BlockTokens | None:
    """The parent of a sequence's first block: None for the base model; under a LoRA
    adapter a block of its id alone, so chains (and hits) never cross adapters."""
    return BlockTokens(None, (-seq.lora_int_id,)) if seq.lora_int_id else None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockSpaceManager:
    def __init__(
        self,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        enable_caching: bool = True,
        watermark: float = 0.01,
    ) -> None:
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.block_size = block_size
        self.num_total_gpu_blocks = num_gpu_blocks
        self.num_total_cpu_blocks = num_cpu_blocks
        self.enable_caching = enable_caching
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.gpu_allocator = BlockAllocator("gpu", block_size, num_gpu_blocks, enable_caching)
        self.cpu_allocator = BlockAllocator("cpu", block_size, num_cpu_blocks, False)
        self.block_tables: dict[int, BlockTable] = {}
        # The same tables as block numbers, kept in step with `block_tables` so a step can hand
        # them to the model runner without building new lists (see `live_block_table`).
        self.block_number_tables: dict[int, list[int]] = {}
        # Each sequence's leading full blocks whose K/V are computed: their BlockTokens
        # (with their chained hashes).
        self.computed_hashes: dict[int, list[BlockTokens]] = {}

    # ---- admission -------------------------------------------------------------------------

    def can_allocate(self, seq_group: SequenceGroup) -> AllocStatus:
        seq = self._waiting_seq(seq_group)
        num_required = _cdiv(seq.get_len(), self.block_size)
        if num_required > self.num_total_gpu_blocks:
            return AllocStatus.NEVER
        # Cached leading blocks that other sequences hold cost no free block.
        hits, _ = self._cached_prefix(seq_group, seq)
        num_held_hits = sum(block.ref_count > 0 for block in hits)
        return AllocStatus.OK if self._fits(num_required - num_held_hits) else AllocStatus.LATER

    def allocate(self, seq_group: SequenceGroup) -> None:
        """Give the waiting sequence a block table covering all its tokens."""
        seq = self._waiting_seq(seq_group)
        if seq.seq_id in self.block_tables:
            raise ValueError(f"sequence {seq.seq_id} already has a block table")
        hits, num_queried = self._cached_prefix(seq_group, seq)
        table = [self.gpu_allocator.allocate_cached(block.block_hash) for block in hits]
        if num_queried:
            self.gpu_allocator.record_prefix_lookup(num_queried, len(hits))
        num_blocks = _cdiv(seq.get_len(), self.block_size)
        while len(table) < num_blocks:
            table.append(self.gpu_allocator.allocate())
        self._set_table(seq.seq_id, table)
        self.computed_hashes[seq.seq_id] = [block.content for block in hits]
        num_cached = len(hits) * self.block_size
        seq.num_computed_tokens = num_cached
        seq_group.num_cached_tokens = min(num_cached, seq.get_prompt_len())

    def _waiting_seq(self, seq_group: SequenceGroup) -> Sequence:
        seqs = seq_group.get_seqs(SequenceStatus.WAITING)
        if not seqs:
            raise ValueError(f"request {seq_group.request_id!r} has no waiting sequence")
        return seqs[0]

    def _cached_prefix(
        self, seq_group: SequenceGroup, seq: Sequence
    ) -> tuple[list[PhysicalTokenBlock], int]:
        """The cached blocks holding the sequence's longest run of leading full blocks, and
        how many leading full blocks a hit could cover (never the last token)."""
        if not self.enable_caching:
            return [], 0
        # Cached tokens are never run through the model, so they get no prompt logprobs.
        if getattr(seq_group.sampling_params, "prompt_logprobs", None) is not None:
            return [], 0
        # Nor hidden states: a mean over the prompt needs every token's.
        if getattr(seq_group, "pooling", None) == "mean":
            return [], 0
        tokens = seq.get_token_ids()
        bs = self.block_size
        num_full = (len(tokens) - 1) // bs
        hits: list[PhysicalTokenBlock] = []
        parent = root_block(seq)
        for i in range(num_full):
            block = self.gpu_allocator.lookup(BlockTokens(parent, tokens[i * bs: (i + 1) * bs]))
            if block is None:
                break
            hits.append(block)
            parent = block.content
        return hits, num_full

    def _fits(self, num_blocks: int) -> bool:
        """Room for `num_blocks` more while keeping the watermark free; an empty pool always
        admits what it can hold, or a request bigger than pool - watermark would wait forever."""
        free = self.gpu_allocator.get_num_free_blocks()
        if free - num_blocks >= self.watermark_blocks:
            return True
        return free == self.num_total_gpu_blocks and num_blocks <= free

    # ---- prefix-cache registration ---------------------------------------------------------

    def mark_blocks_computed(self, seq: Sequence) -> None:
        """Register every full block of `seq` that now lies inside its computed tokens."""
        if not self.enable_caching:
            return
        hashes = self.computed_hashes.get(seq.seq_id)
        # Fast path: no block became full since the last call (most decode steps).
        if hashes is None or seq.num_computed_tokens // self.block_size <= len(hashes):
            return
        table = self.block_tables[seq.seq_id]
        if not table or table[0].device != "gpu":
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(table))
        for i in range(len(hashes), num_full):
            content = BlockTokens(hashes[-1] if hashes else root_block(seq),
                                  self._block_tokens(seq, i))
            block = table[i]
            # The same content may already be cached in another block (two identical
            # prompts computed side by side); this one then just stays unregistered, and
            # the sequence's chain continues from the cached content. A different content
            # under the same hash (a collision) stays unregistered too.
            cached = self.gpu_allocator.lookup(content)
            if cached is not None:
                content = cached.content
            elif block.block_hash is None and not self.gpu_allocator.contains_hash(content.hash):
                self.gpu_allocator.register(block, content.hash, content)
            hashes.append(content)

    def _block_tokens(self, seq: Sequence, i: int) -> list[int]:
        start, end = i * self.block_size, (i + 1) * self.block_size
        prompt = seq.prompt_token_ids
        if end <= len(prompt):
            return prompt[start:end]
        out_start = max(0, start - len(prompt))
        return prompt[start:end] + seq.output_token_ids[out_start: end - len(prompt)]

    # ---- growth and copy-on-write ----------------------------------------------------------

    def can_append_slots(self, seq_group: SequenceGroup) -> bool:
        seqs = seq_group.get_seqs(SequenceStatus.RUNNING)
        return self.num_blocks_to_append(seqs) <= self.gpu_allocator.get_num_free_blocks()

    def _owns_its_write_range(self, seq: Sequence, table: BlockTable) -> bool:
        """The common decode case: the table covers every token and the only block left to
        write (the last one) is not shared, so `append_slots` has nothing to do."""
        n = len(table)
        bs = self.block_size
        return (
            table[-1].ref_count == 1
            and n * bs >= seq.get_len()
            and seq.num_computed_tokens >= (n - 1) * bs
        )

    def num_blocks_to_append(self, seqs: list[Sequence]) -> int:
        """New blocks `append_slots` takes for these sequences (one group's running ones):
        growth plus copy-on-write. 0 also means `append_slots` has nothing to do for any of
        them (no growth, no shared block to write), so a caller may skip it."""
        needed = 0
        # id(block) -> sequences that will write into it; built only once a shared block
        # shows up (forks), as it costs more than the rest of a decode step's check.
        writers: Counter[int] | None = None
        shared: dict[int, PhysicalTokenBlock] = {}
        for seq in seqs:
            table = self.block_tables[seq.seq_id]
            if table and self._owns_its_write_range(seq, table):
                continue
            needed += max(0, _cdiv(seq.get_len(), self.block_size) - len(table))
            for block in self._write_range(seq, table):
                if block.ref_count > 1:
                    if writers is None:
                        writers = Counter()
                    writers[id(block)] += 1
                    shared[id(block)] = block
        if writers is None:
            return needed
        for key, n in writers.items():
            # Each writer copies, except the last one when nobody else holds the block.
            needed += n - 1 if shared[key].ref_count == n else n
        return needed

    def _write_range(self, seq: Sequence, table: BlockTable) -> BlockTable:
        """The blocks holding tokens not computed yet: the ones the next steps write."""
        return table[seq.num_computed_tokens // self.block_size:]

    def append_slots(self, seq: Sequence, num_new_tokens: int = 1) -> list[tuple[int, int]]:
        """Make the table cover all tokens of `seq` and own every block it will write.

        Returns (src, dst) block pairs the cache engine must copy (copy-on-write).
        """
        if seq.num_computed_tokens + num_new_tokens > seq.get_len():
            raise ValueError(
                f"sequence {seq.seq_id}: {num_new_tokens} new tokens after "
                f"{seq.num_computed_tokens} computed exceed its {seq.get_len()} tokens"
            )
        table = self._gpu_table(seq)
        if table and self._owns_its_write_range(seq, table):
            return []
        numbers = self.block_number_tables[seq.seq_id]
        while len(table) < _cdiv(seq.get_len(), self.block_size):
            block = self.gpu_allocator.allocate()
            table.append(block)
            numbers.append(block.block_number)
        copies: list[tuple[int, int]] = []
        first = seq.num_computed_tokens // self.block_size
        for i in range(first, len(table)):
            old = table[i]
            if old.ref_count == 1:
                continue
            assert old.block_hash is None, f"cached block {old.block_number} is in a write range"
            new = self.gpu_allocator.allocate()
            copies.append((old.block_number, new.block_number))
            self.gpu_allocator.free(old)
            table[i] = new
            numbers[i] = new.block_number
        return copies

    def num_lookahead_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks that `reserve_lookahead(seq, num_tokens)` would take."""
        return max(0, _cdiv(seq.get_len() + num_tokens, self.block_size)
                   - len(self._gpu_table(seq)))

    def reserve_lookahead(self, seq: Sequence, num_tokens: int) -> None:
        """Multi-step: extend the table over `num_tokens` tokens past the sequence's end, the
        slots of tokens it will sample and compute before the host sees them. New blocks
        are the sequence's own (ref count 1); they are freed with it."""
        table = self._gpu_table(seq)
        numbers = self.block_number_tables[seq.seq_id]
        for _ in range(self.num_lookahead_blocks(seq, num_tokens)):
            block = self.gpu_allocator.allocate()
            table.append(block)
            numbers.append(block.block_number)

    def trim(self, seq: Sequence) -> int:
        """Speculative decoding's rollback: give back the blocks past the sequence's tokens
        (reserved for proposals that were rejected). Their slots held only unaccepted K/V,
        which nothing reads: the next step overwrites the slots it keeps. Returns how many
        blocks went back."""
        table = self.block_tables.get(seq.seq_id)
        if not table or table[0].device != "gpu":
            return 0
        keep = _cdiv(seq.get_len(), self.block_size)
        if len(table) <= keep:
            return 0
        numbers = self.block_number_tables[seq.seq_id]
        extra = table[keep:]
        del table[keep:]
        del numbers[keep:]
        for block in reversed(extra):
            assert block.block_hash is None, f"cached block {block.block_number} past the end"
            self.gpu_allocator.free(block)
        return len(extra)

    def fork(self, parent_seq: Sequence, child_seq: Sequence) -> None:
        """The child shares every block of the parent."""
        table = self._gpu_table(parent_seq)
        if child_seq.seq_id in self.block_tables:
            raise ValueError(f"sequence {child_seq.seq_id} already has a block table")
        for block in table:
            block.ref_count += 1
        self._set_table(child_seq.seq_id, list(table))
        self.computed_hashes[child_seq.seq_id] = list(self.computed_hashes[parent_seq.seq_id])

    def _gpu_table(self, seq: Sequence) -> BlockTable:
        table = self.block_tables.get(seq.seq_id)
        if table is None:
            raise ValueError(f"sequence {seq.seq_id} has no block table")
        if table and table[0].device != "gpu":
            raise ValueError(f"sequence {seq.seq_id} is swapped out")
        return table

    # ---- freeing ---------------------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; a no-op for a sequence without blocks."""
        table = self.block_tables.pop(seq.seq_id, None)
        self.block_number_tables.pop(seq.seq_id, None)
        self.computed_hashes.pop(seq.seq_id, None)
        if table is None:
            return
        # Last block first: the evictor then drops a prefix from its tail, keeping its head.
        for block in reversed(table):
            self._allocator(block).free(block)

    def _allocator(self, block: PhysicalTokenBlock) -> BlockAllocator:
        return self.gpu_allocator if block.device == "gpu" else self.cpu_allocator

    # ---- swapping --------------------------------------------------------------------------

    def can_swap_out(self, seq_group: SequenceGroup) -> bool:
        blocks = self._unique_blocks(seq_group.get_seqs(SequenceStatus.RUNNING))
        return len(blocks) <= self.cpu_allocator.get_num_free_blocks()

    def swap_out(self, seq_group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the running sequences' blocks to the CPU pool: (gpu, cpu) pairs to copy."""
        return self._move(seq_group.get_seqs(SequenceStatus.RUNNING), self.cpu_allocator)

    def can_swap_in(self, seq_group: SequenceGroup) -> AllocStatus:
        seqs = seq_group.get_seqs(SequenceStatus.SWAPPED)
        # Blocks to bring back plus what the next step's append_slots takes (at most one
        # block per sequence: either growth or a copy-on-write).
        num_required = len(self._unique_blocks(seqs)) + self.num_blocks_to_append(seqs)
        if num_required > self.num_total_gpu_blocks:
            return AllocStatus.NEVER
        return AllocStatus.OK if self._fits(num_required) else AllocStatus.LATER

    def swap_in(self, seq_group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the swapped sequences' blocks to the GPU pool: (cpu, gpu) pairs to copy."""
        return self._move(seq_group.get_seqs(SequenceStatus.SWAPPED), self.gpu_allocator)

    def _unique_blocks(self, seqs: list[Sequence]) -> dict[int, PhysicalTokenBlock]:
        return {id(b): b for s in seqs for b in self.block_tables.get(s.seq_id, ())}

    def _move(self, seqs: list[Sequence], dst: BlockAllocator) -> list[tuple[int, int]]:
        """Re-home the tables of `seqs` on `dst`; a block shared by several moves once."""
        moved: dict[int, PhysicalTokenBlock] = {}
        copies: list[tuple[int, int]] = []
        for seq in seqs:
            table = self.block_tables.get(seq.seq_id)
            if table is None:
                raise ValueError(f"sequence {seq.seq_id} has no block table")
            hashes = self.computed_hashes[seq.seq_id]
            new_table: BlockTable = []
            for i, block in enumerate(table):
                if block.device == dst.device:
                    raise ValueError(f"sequence {seq.seq_id} is already on {dst.device}")
                new = moved.get(id(block))
                if new is not None:
                    new.ref_count += 1
                else:
                    new, needs_copy = self._new_home(dst, hashes[i] if i < len(hashes) else None)
                    if needs_copy:
                        copies.append((block.block_number, new.block_number))
                    moved[id(block)] = new
                new_table.append(new)
            for block in reversed(table):
                self._allocator(block).free(block)
            self._set_table(seq.seq_id, new_table)
        return copies

    def _new_home(
        self, dst: BlockAllocator, content: BlockTokens | None
    ) -> tuple[PhysicalTokenBlock, bool]:
        """A block on `dst` for a block of a table, and whether its content must be copied."""
        if dst.device == "gpu" and content is not None and self.enable_caching:
            # Swap-in: the content may still be cached on the GPU (no copy needed); else
            # the copy lands before the step's forward, so the block can be registered now.
            cached = dst.lookup(content)
            if cached is not None:
                return dst.allocate_cached(cached.block_hash), False
            if not dst.contains_hash(content.hash):
                return dst.allocate(content.hash, content), True
        return dst.allocate(), True

    def _set_table(self, seq_id: int, table: BlockTable) -> None:
        self.block_tables[seq_id] = table
        self.block_number_tables[seq_id] = [b.block_number for b in table]

    # ---- queries ---------------------------------------------------------------------------

    def get_block_table(self, seq: Sequence) -> list[int]:
        """A snapshot of the sequence's block numbers."""
        return list(self.block_number_tables[seq.seq_id])

    def live_block_table(self, seq: Sequence) -> list[int]:
        """The block numbers of the sequence, as the live list this manager keeps updating:
        it grows with `append_slots` and changes on copy-on-write. Read it, never write it;
        it is stale once the sequence is swapped or freed (those give it a new list)."""
        return self.block_number_tables[seq.seq_id]

    def get_num_free_gpu_blocks(self) -> int:
        return self.gpu_allocator.get_num_free_blocks()

    def get_num_free_cpu_blocks(self) -> int:
        return self.cpu_allocator.get_num_free_blocks()

    def gpu_usage(self) -> float:
        """Fraction of GPU blocks held by sequences (evictable cached blocks count as free)."""
        if self.num_total_gpu_blocks == 0:
            return 0.0
        return 1.0 - self.get_num_free_gpu_blocks() / self.num_total_gpu_blocks

    def cpu_usage(self) -> float:
        if self.num_total_cpu_blocks == 0:
            return 0.0
        return 1.0 - self.get_num_free_cpu_blocks() / self.num_total_cpu_blocks

    def prefix_cache_hit_rate(self) -> float:
        """Cached blocks found / full prompt blocks looked up, over all admissions."""
        a = self.gpu_allocator
        return a.num_cache_hits / a.num_cache_queries if a.num_cache_queries else 0.0

    def check_invariants(self) -> None:
        """Assert the pools and tables agree: each block is free, evictable or owned (once),
        its ref_count equals its number of table references, and the hash index is exact."""
        refs: Counter[tuple[str, int]] = Counter()
        for seq_id, table in self.block_tables.items():
            devices = {b.device for b in table}
            assert len(devices) <= 1, f"sequence {seq_id} has blocks on {devices}"
            for b in table:
                allocator = self._allocator(b)
                assert allocator.blocks[b.block_number] is b, f"foreign block {b} in seq {seq_id}"
                refs[(b.device, b.block_number)] += 1
        for allocator in (self.gpu_allocator, self.cpu_allocator):
            free_ids = [b.block_number for b in allocator.free_blocks]
            assert len(set(free_ids)) == len(free_ids), f"{allocator.device}: free list repeats"
            free_set = set(free_ids)
            evictable = set(allocator.evictor)
            assert not free_set & evictable, f"{allocator.device}: free and evictable overlap"
            for b in allocator.blocks:
                n = refs[(allocator.device, b.block_number)]
                assert b.ref_count == n, f"{b}: ref_count {b.ref_count} but {n} table references"
                places = (b.block_number in free_set) + (b.block_number in evictable) + (n > 0)
                assert places == 1, f"{b} is in {places} places (free/evictable/owned)"
                if b.block_number in free_set:
                    assert b.block_hash is None, f"{b} is on the free list with a hash"
                if b.block_number in evictable:
                    assert allocator.evictor[b.block_number] is b
                    assert b.block_hash is not None, f"{b} is evictable without a hash"
                if b.block_hash is not None:
                    assert allocator.cached_blocks.get(b.block_hash) is b, f"{b} not indexed"
                    assert b.content is None or b.content.hash == b.block_hash, f"{b} content"
            for h, b in allocator.cached_blocks.items():
                assert b.block_hash == h, f"hash index {h} points at {b}"
        assert self.block_number_tables.keys() == self.block_tables.keys()
        for seq_id, table in self.block_tables.items():
            numbers = [b.block_number for b in table]
            assert self.block_number_tables[seq_id] == numbers, f"seq {seq_id}: stale numbers"
        for seq_id, hashes in self.computed_hashes.items():
            assert seq_id in self.block_tables, f"hashes kept for freed sequence {seq_id}"
            assert len(hashes) <= len(self.block_tables[seq_id])
        assert self.computed_hashes.keys() == self.block_tables.keys()
