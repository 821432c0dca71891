"""The host-memory tier of the prefix cache: slots for blocks evicted from the device.

It is a victim cache: a cached block evicted from the device pool moves to a
host slot (when there is one; the host tier evicts its own least valuable
block, with the same priority-then-LRU rule, to make room), and a prefix hit
on a host-resident block moves it back to a device block. A block lives in one
tier at a time. The scheduler owns the slot ids, as it owns device block ids;
the executor copies where the plan says.

Within one step every swap-out runs before every swap-in, and both before the
forward. A slot whose block moves back to the device is read by that step's
swap-in, so it is handed out again only from the next step on
(``end_step``): otherwise a swap-out of the same step could overwrite it first.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvcache.block_hash import BlockHash
from kvcache.eviction_queue import EvictionQueue


@dataclass(slots=True)
class BlockCopies:
    """One step's copies between the tiers, done before its forward: swap-outs, then swap-ins."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host slot)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block)


class HostTier:
    """Host slots ``[0, num_slots)``: free, holding a cached block, or being read this step."""

    __slots__ = ("num_slots", "cached", "_free", "_queue", "_hash_of", "_priority_of", "_releasing")

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        self.cached: dict[BlockHash, int] = {}  # hash -> slot
        self._free: deque[int] = deque(range(num_slots))
        self._queue = EvictionQueue()
        self._hash_of: dict[int, BlockHash] = {}
        self._priority_of: dict[int, int] = {}
        self._releasing: list[int] = []  # read by this step's swap-ins; free from the next step

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_releasing(self) -> int:
        return len(self._releasing)

    def store(self, block_hash: BlockHash, priority: int) -> tuple[int, BlockHash | None] | None:
        """A slot for a block leaving the device: ``(slot, hash evicted from the host to make room)``,
        or None when the tier has no slot to give."""
        if block_hash in self.cached:
            raise ValueError("block is already in the host tier")
        evicted = None
        if self._free:
            slot = self._free.popleft()
        elif self._queue:
            slot = self._queue.pop()
            evicted = self._hash_of.pop(slot)
            del self.cached[evicted]
            del self._priority_of[slot]
        else:
            return None
        self._add(slot, block_hash, priority)
        return slot, evicted

    def take(self, block_hash: BlockHash) -> tuple[int, int]:
        """Move a block out for a swap-in: ``(slot, priority)``. The slot is free from the next step."""
        slot = self.cached.pop(block_hash)
        del self._hash_of[slot]
        self._queue.remove(slot)
        self._releasing.append(slot)
        return slot, self._priority_of.pop(slot)

    def restore(self, block_hash: BlockHash, slot: int, priority: int) -> None:
        """Undo a ``take`` of this step: the swap-in is cancelled and the slot still holds the block."""
        self._releasing.remove(slot)
        self._add(slot, block_hash, priority)

    def discard(self, block_hash: BlockHash) -> None:
        """Forget a block whose content the device holds again (computed anew); the slot is free now."""
        slot = self.cached.pop(block_hash)
        del self._hash_of[slot]
        del self._priority_of[slot]
        self._queue.remove(slot)
        self._free.append(slot)

    def end_step(self) -> None:
        """This step's copies are planned: slots read by its swap-ins may be reused."""
        self._free.extend(self._releasing)
        self._releasing.clear()

    def _add(self, slot: int, block_hash: BlockHash, priority: int) -> None:
        self.cached[block_hash] = slot
        self._hash_of[slot] = block_hash
        self._priority_of[slot] = priority
        self._queue.push(slot, priority)
