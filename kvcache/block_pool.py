"""A pool of fixed-size KV-cache blocks with reference counts and a free list.

Blocks are identified by their index into the executor's KV tensors. The pool
only counts and hands out ids; it never touches tensor memory. Reference counts
exist so that a block can later be shared by several requests (prefix reuse):
a block returns to the free list when its last user lets it go.

The free list is a FIFO of freed blocks: the block freed longest ago is handed
out first. That is the order least-recently-used eviction of cached blocks
needs, so prefix caching can keep blocks "free but still holding their
tokens" in this same list without a second data structure.
"""

from __future__ import annotations

from collections import deque


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


class BlockPool:
    """Hands out block ids in ``[0, num_blocks)`` and takes them back."""

    __slots__ = ("num_blocks", "_free", "_ref_counts")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` free blocks, each with reference count 1."""
        if count > len(self._free):
            raise NoFreeBlocksError(f"asked for {count} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for block_id in blocks:
            self._ref_counts[block_id] = 1
        return blocks

    def share(self, block_ids: list[int]) -> None:
        """Add a user to blocks that are already allocated."""
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0:
                raise ValueError(f"block {block_id} is not allocated")
            self._ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one user from each block; blocks with no user left become free.

        Blocks are released in reverse so that the tail of a sequence (least
        likely to be shared) is handed out again before its head.
        """
        for block_id in reversed(block_ids):
            count = self._ref_counts[block_id]
            if count <= 0:
                raise ValueError(f"block {block_id} freed twice")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                self._free.append(block_id)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]
