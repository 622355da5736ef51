"""PhysicalTokenBlock and BlockAllocator: one pool of KV-cache blocks on one device.

Every operation is O(1): free blocks sit in a deque, cached blocks in a dict keyed by their
content hash, and freed-but-cached blocks in an LRU evictor (an OrderedDict, oldest first).
A cached block also keeps its content (the token ids of its whole prefix, see
block_manager.BlockTokens): a lookup by content (`lookup`) is a hit only when those tokens are
equal, so two prompts whose hashes collide never share KV.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any


@dataclass(eq=False)
class PhysicalTokenBlock:
    """One block of `block_size` token slots in a KV-cache pool."""

    block_number: int
    device: str  # "gpu" (the compute device, whatever it is) or "cpu" (swap space)
    ref_count: int = 0
    # Chained hash of the tokens this block holds; set only once its K/V are computed.
    block_hash: int | None = None
    # What the hash stands for (a BlockTokens): compared on every lookup by content.
    content: Any = None

    def __repr__(self) -> str:
        return (
            f"PhysicalTokenBlock({self.device}#{self.block_number}, ref={self.ref_count}, "
            f"hash={self.block_hash})"
        )


class BlockAllocator:
    """Hands out blocks of one device; with caching, keeps freed hashed blocks reusable."""

    def __init__(self, device: str, block_size: int, num_blocks: int, enable_caching: bool) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be non-negative, got {num_blocks}")
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [PhysicalTokenBlock(i, device) for i in range(num_blocks)]
        self.free_blocks: deque[PhysicalTokenBlock] = deque(self.blocks)
        self.cached_blocks: dict[int, PhysicalTokenBlock] = {}
        # ref_count == 0 and still holding a hash; least recently used first.
        self.evictor: OrderedDict[int, PhysicalTokenBlock] = OrderedDict()
        self.num_cache_queries = 0
        self.num_cache_hits = 0

    def allocate(self, block_hash: int | None = None, content: Any = None) -> PhysicalTokenBlock:
        """A fresh block (ref_count 1), registered under `block_hash` if one is given."""
        if block_hash is not None and block_hash in self.cached_blocks:
            raise ValueError(f"block hash {block_hash} is already cached; use allocate_cached")
        if self.free_blocks:
            block = self.free_blocks.popleft()
        elif self.evictor:
            _, block = self.evictor.popitem(last=False)
            del self.cached_blocks[block.block_hash]
            block.block_hash = block.content = None
        else:
            raise ValueError(f"out of {self.device} KV-cache blocks (all {self.num_blocks} in use)")
        block.ref_count = 1
        if block_hash is not None:
            self.register(block, block_hash, content)
        return block

    def allocate_cached(self, block_hash: int) -> PhysicalTokenBlock:
        """Reuse the block already holding `block_hash`: one more reference to it."""
        block = self.cached_blocks.get(block_hash)
        if block is None:
            raise ValueError(f"block hash {block_hash} is not cached on {self.device}")
        if block.ref_count == 0:
            del self.evictor[block.block_number]
        block.ref_count += 1
        return block

    def free(self, block: PhysicalTokenBlock) -> None:
        """Drop one reference; at zero the block becomes free, or evictable if it is cached."""
        if block.device != self.device:
            raise ValueError(
                f"block {block.block_number} is a {block.device} block, not {self.device}"
            )
        if block.ref_count <= 0:
            raise ValueError(f"double free of {self.device} block {block.block_number}")
        block.ref_count -= 1
        if block.ref_count > 0:
            return
        if block.block_hash is not None:
            self.evictor[block.block_number] = block
        else:
            self.free_blocks.append(block)

    def register(self, block: PhysicalTokenBlock, block_hash: int, content: Any = None) -> None:
        """Make a computed, full block findable by its hash."""
        if not self.enable_caching:
            return
        if block.block_hash is not None:
            raise ValueError(f"block {block.block_number} already has hash {block.block_hash}")
        if block_hash in self.cached_blocks:
            raise ValueError(f"block hash {block_hash} is already cached")
        block.block_hash = block_hash
        block.content = content
        self.cached_blocks[block_hash] = block

    def contains_hash(self, block_hash: int) -> bool:
        return block_hash in self.cached_blocks

    def lookup(self, content: Any) -> PhysicalTokenBlock | None:
        """The cached block holding exactly `content` (a BlockTokens); None on a miss,
        including a block whose hash is the same but whose tokens are not."""
        block = self.cached_blocks.get(content.hash)
        if block is None or block.content is None or not content.same_as(block.content):
            return None
        return block

    def record_prefix_lookup(self, num_queried_blocks: int, num_hit_blocks: int) -> None:
        self.num_cache_queries += num_queried_blocks
        self.num_cache_hits += num_hit_blocks

    def get_num_free_blocks(self) -> int:
        """Blocks an allocation can take: the free list plus evictable cached blocks."""
        return len(self.free_blocks) + len(self.evictor)

    def get_num_evictable_blocks(self) -> int:
        return len(self.evictor)
