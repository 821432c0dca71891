"""A pool of fixed-size device KV-cache blocks: reference counts, and which free
blocks still hold reusable (cached) content.

Blocks are identified by their index into the executor's KV tensors. The pool
only counts and hands out ids; it never touches tensor memory. A block shared
by several requests (a common prefix) has one reference per user. When the
last user lets go, a block that holds a full, hashed block of tokens stays
*cached*: free, but findable by its hash until its id is needed again. Blocks
that hold nothing reusable are handed out first (oldest freed first); cached
ones are evicted only then, lowest retention priority first and least recently
used within a priority (``EvictionQueue``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from kvcache.block_hash import BlockHash
from kvcache.eviction_queue import DEFAULT_RETENTION_PRIORITY, EvictionQueue

# Called when allocation evicts a cached block: (block_id, its hash, its retention priority).
EvictionHook = Callable[[int, BlockHash, int], None]


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


class BlockPool:
    """Hands out block ids in ``[0, num_blocks)`` and takes them back."""

    __slots__ = ("num_blocks", "cached", "on_evict", "_ref_counts", "_empty", "_cached_free", "_hash_of", "_priority")

    def __init__(self, num_blocks: int, on_evict: EvictionHook | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.on_evict = on_evict
        self.cached: dict[BlockHash, int] = {}  # hash -> the block holding it (in use or free)
        self._ref_counts = [0] * num_blocks
        self._empty: deque[int] = deque(range(num_blocks))  # free, nothing reusable: handed out first
        self._cached_free = EvictionQueue()  # free but holding a cached block: evicted last
        self._hash_of: list[BlockHash | None] = [None] * num_blocks
        self._priority = [DEFAULT_RETENTION_PRIORITY] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request uses, cached ones included (they are evictable)."""
        return len(self._empty) + len(self._cached_free)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._cached_free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` free blocks, each with reference count 1, evicting cached ones if need be."""
        if count > self.num_free_blocks:
            raise NoFreeBlocksError(f"asked for {count} blocks, {self.num_free_blocks} free")
        blocks = []
        for _ in range(count):
            if self._empty:
                block_id = self._empty.popleft()
            else:
                block_id = self._cached_free.pop()
                block_hash = self._hash_of[block_id]
                assert block_hash is not None
                self._hash_of[block_id] = None
                del self.cached[block_hash]
                if self.on_evict is not None:
                    self.on_evict(block_id, block_hash, self._priority[block_id])
            self._ref_counts[block_id] = 1
            self._priority[block_id] = DEFAULT_RETENTION_PRIORITY
            blocks.append(block_id)
        return blocks

    def share(self, block_ids: list[int]) -> None:
        """Add a user to each block: one in use, or a free one that still holds cached content."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                if block_id not in self._cached_free:
                    raise ValueError(f"block {block_id} is free and holds nothing reusable")
                self._cached_free.remove(block_id)
            self._ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one user from each block; blocks with no user left become free.

        Blocks are released in reverse so that the tail of a sequence (least
        likely to be shared) is evicted, or handed out again, before its head.
        """
        for block_id in reversed(block_ids):
            count = self._ref_counts[block_id]
            if count <= 0:
                raise ValueError(f"block {block_id} freed twice")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                if self._hash_of[block_id] is not None:
                    self._cached_free.push(block_id, self._priority[block_id])
                else:
                    self._empty.append(block_id)

    def register(self, block_id: int, block_hash: BlockHash, priority: int = DEFAULT_RETENTION_PRIORITY) -> bool:
        """Mark an in-use block as holding ``block_hash``; False when another block already does."""
        if self._ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} is not in use")
        if block_hash in self.cached:
            return False
        if self._hash_of[block_id] is not None:
            raise ValueError(f"block {block_id} already holds a cached block")
        self.cached[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        self._priority[block_id] = priority
        return True

    def raise_priority(self, block_id: int, priority: int) -> None:
        """A block shared by requests keeps the highest retention priority any of them asked for."""
        if self._ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} is not in use")
        self._priority[block_id] = max(self._priority[block_id], priority)

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self.cached.get(block_hash)

    def hash_of(self, block_id: int) -> BlockHash | None:
        return self._hash_of[block_id]

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def eviction_order(self) -> list[int]:
        """Free blocks in the order allocation hands them out (for tests and debugging)."""
        return list(self._empty) + self._cached_free.order()
