"""Which cached block to evict next: lowest retention priority first, then least
recently used. Used for free device blocks that still hold reusable content and
for the host tier's slots.

Retention priorities follow TensorRT-LLM's KvCacheRetentionConfig: integers in
[0, 100], default 35; a request may give the blocks of its first N tokens
(a system prompt, say) a higher priority so they outlive ordinary blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

MIN_RETENTION_PRIORITY = 0
MAX_RETENTION_PRIORITY = 100
DEFAULT_RETENTION_PRIORITY = 35


@dataclass(frozen=True, slots=True)
class KvCacheRetention:
    """Keep the blocks of a request's first ``num_prefix_tokens`` tokens at ``priority``."""

    num_prefix_tokens: int = 0
    priority: int = DEFAULT_RETENTION_PRIORITY

    def priority_of_block(self, index: int, tokens_per_block: int) -> int:
        """Priority of block ``index``: the request's only when the block lies wholly in the prefix."""
        if (index + 1) * tokens_per_block <= self.num_prefix_tokens:
            return self.priority
        return DEFAULT_RETENTION_PRIORITY


class EvictionQueue:
    """Ids in LRU order per priority. push, remove and pop are O(1) in the number
    of ids (pop scans the priorities in use, at most 101)."""

    __slots__ = ("_levels", "_priority_of")

    def __init__(self) -> None:
        self._levels: dict[int, OrderedDict[int, None]] = {}
        self._priority_of: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._priority_of)

    def __contains__(self, item: int) -> bool:
        return item in self._priority_of

    def push(self, item: int, priority: int) -> None:
        """Add ``item`` as the most recently used of its priority."""
        if item in self._priority_of:
            raise ValueError(f"{item} is already queued")
        self._levels.setdefault(priority, OrderedDict())[item] = None
        self._priority_of[item] = priority

    def remove(self, item: int) -> None:
        priority = self._priority_of.pop(item)
        level = self._levels[priority]
        del level[item]
        if not level:
            del self._levels[priority]

    def pop(self) -> int:
        """Take the id to evict: the least recently used of the lowest priority."""
        priority = min(self._levels)
        level = self._levels[priority]
        item, _ = level.popitem(last=False)
        if not level:
            del self._levels[priority]
        del self._priority_of[item]
        return item

    def order(self) -> list[int]:
        """Every id, in the order they would be evicted (for tests and debugging)."""
        return [item for priority in sorted(self._levels) for item in self._levels[priority]]
