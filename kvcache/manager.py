"""Per-request block tables on top of the block pool, with admission control.

The scheduler asks three questions of this class: can a request be admitted
(``can_reserve``), which new blocks does it need to hold its tokens this step
(``allocate_slots``), and give everything back (``free``).

Admission follows TensorRT-LLM's GUARANTEED_NO_EVICT policy: a request is
admitted only when blocks for its whole lifetime (prompt + max_tokens) can be
set aside, so a running request can never run out of KV cache. The blocks are
*reserved* (counted) at admission but *allocated* lazily as tokens are
computed, so plans carry new block ids step by step and a request that stops
early never held memory it did not use.
"""

from __future__ import annotations

from kvcache.block_pool import BlockPool, NoFreeBlocksError


def blocks_for_tokens(num_tokens: int, tokens_per_block: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens (ceiling division)."""
    return -(-num_tokens // tokens_per_block)


class KVCacheManager:
    """Owns the block pool and every request's block table."""

    def __init__(self, num_blocks: int, tokens_per_block: int) -> None:
        if tokens_per_block <= 0:
            raise ValueError(f"tokens_per_block must be positive, got {tokens_per_block}")
        self.pool = BlockPool(num_blocks)
        self.tokens_per_block = tokens_per_block
        self._tables: dict[str, list[int]] = {}
        # Blocks promised to a request but not yet allocated to it.
        self._reserved: dict[str, int] = {}
        self._num_reserved = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks neither allocated nor promised to an admitted request."""
        return self.pool.num_free_blocks - self._num_reserved

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def can_reserve(self, num_tokens: int) -> bool:
        return blocks_for_tokens(num_tokens, self.tokens_per_block) <= self.num_free_blocks

    def reserve(self, request_id: str, num_tokens: int) -> None:
        """Set aside blocks for a request's whole lifetime (admission)."""
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already has a block table")
        needed = blocks_for_tokens(num_tokens, self.tokens_per_block)
        if needed > self.num_free_blocks:
            raise NoFreeBlocksError(f"request {request_id!r} needs {needed} blocks, {self.num_free_blocks} free")
        self._tables[request_id] = []
        self._reserved[request_id] = needed
        self._num_reserved += needed

    def allocate_slots(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow the request's table to hold ``num_tokens`` tokens; return the new block ids.

        Draws on the request's reservation first, then on unreserved free blocks.
        """
        table = self._tables[request_id]
        missing = blocks_for_tokens(num_tokens, self.tokens_per_block) - len(table)
        if missing <= 0:
            return []
        from_reservation = min(missing, self._reserved.get(request_id, 0))
        if missing - from_reservation > self.num_free_blocks:
            raise NoFreeBlocksError(f"request {request_id!r} needs {missing} more blocks")
        new_blocks = self.pool.allocate(missing)
        self._reserved[request_id] -= from_reservation
        self._num_reserved -= from_reservation
        table.extend(new_blocks)
        return new_blocks

    def free(self, request_id: str) -> None:
        """Release a request's blocks and what is left of its reservation."""
        table = self._tables.pop(request_id, None)
        if table is None:
            return
        self.pool.free(table)
        self._num_reserved -= self._reserved.pop(request_id, 0)

    @property
    def num_requests(self) -> int:
        return len(self._tables)
