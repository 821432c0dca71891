"""Why prompt tokens were not reused from the prefix cache, and the cache's running figures.

Each admitted prompt's tokens are either reused (``cached_tokens``) or counted
under exactly one reason:

* ``partial_last_block``: the block holding the last prompt token is always
  computed: a partial block is never cached, and a full last block is
  recomputed so that the step has logits to sample the first output from.
* For the full blocks from the first miss on (the hash chain breaks there, so
  every later block misses too), the first missed block decides:
  ``evicted`` when its content was cached once and evicted since;
  ``salt_differs`` when the same tokens are cached under another cache_salt;
  ``prefix_shorter_than_block`` for the tokens that a cached block after the same
  prefix shares with it (the shared run ends inside the block, and only whole
  blocks are reused), with the rest of the miss under ``not_cached``;
  ``not_cached`` when no cached block ever held these tokens (or the eviction
  is older than the evicted-hash memory).
* ``caching_disabled``: every prompt token, when prefix caching is off.

The bookkeeping is cheap: a counter of content hashes, an index of cached
blocks by (parent hash, first token), and a bounded LRU of evicted hashes;
the work happens once per admitted prompt, at its first missed block.
"""

from __future__ import annotations

from array import array
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, fields

from kvcache.block_hash import BlockHash

SiblingKey = tuple[BlockHash, int]  # (parent hash, first token id)
# Per cached block: (content hash, sibling key, its token ids as array("I") bytes).
CachedInfo = tuple[BlockHash, SiblingKey, bytes]


@dataclass(slots=True)
class NotReusedTokens:
    """Prompt tokens computed instead of reused, by reason (see the module docstring)."""

    prefix_shorter_than_block: int = 0
    evicted: int = 0
    salt_differs: int = 0
    partial_last_block: int = 0
    not_cached: int = 0
    caching_disabled: int = 0

    def add(self, other: NotReusedTokens) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))


@dataclass(frozen=True, slots=True)
class MissedBlock:
    """The first full prompt block that missed, as the explainer needs it."""

    block_hash: BlockHash
    content_hash: BlockHash  # the same chain without the salt
    parent_key: BlockHash
    token_ids: Sequence[int]


class MissExplainer:
    """Remembers enough about cached and evicted blocks to say why a block missed.

    Its per-block records are tuples of bytes and ints (siblings too, not sets):
    the garbage collector stops tracking such tuples, so tens of thousands of
    cached blocks add nothing to a full collection. With an object and a set per
    block, those two were 56,000 of the 58,000 objects a full collection walked
    right after a 4,096-request offline run left 28,672 blocks cached
    (``bench/offline_throughput.py --shape tiny-host``, CPU).
    """

    __slots__ = ("max_evicted", "_info", "_content", "_siblings", "_evicted")

    def __init__(self, max_evicted: int) -> None:
        self.max_evicted = max_evicted
        self._info: dict[BlockHash, CachedInfo] = {}
        self._content: Counter[BlockHash] = Counter()
        self._siblings: dict[SiblingKey, tuple[BlockHash, ...]] = {}
        self._evicted: OrderedDict[BlockHash, None] = OrderedDict()

    def cached(self, block: MissedBlock) -> None:
        """A block's content entered the cache (either tier)."""
        if block.block_hash in self._info or not block.token_ids:
            return
        key = (block.parent_key, block.token_ids[0])
        self._info[block.block_hash] = (block.content_hash, key, array("I", block.token_ids).tobytes())
        self._content[block.content_hash] += 1
        self._siblings[key] = self._siblings.get(key, ()) + (block.block_hash,)
        self._evicted.pop(block.block_hash, None)

    def dropped(self, block_hash: BlockHash) -> None:
        """A block's content left the last tier that held it."""
        info = self._info.pop(block_hash, None)
        if info is None:
            return
        content_hash, sibling_key, _ = info
        self._content[content_hash] -= 1
        if not self._content[content_hash]:
            del self._content[content_hash]
        siblings = tuple(h for h in self._siblings[sibling_key] if h != block_hash)
        if siblings:
            self._siblings[sibling_key] = siblings
        else:
            del self._siblings[sibling_key]
        self._evicted[block_hash] = None
        if len(self._evicted) > self.max_evicted:
            self._evicted.popitem(last=False)

    def explain(self, block: MissedBlock, num_missed_tokens: int, out: NotReusedTokens) -> None:
        """Count ``num_missed_tokens`` (the first missed block and every full block after it) in ``out``."""
        if block.block_hash in self._evicted:
            out.evicted += num_missed_tokens
        elif self._content.get(block.content_hash):
            out.salt_differs += num_missed_tokens
        else:
            shared = self._longest_shared_run(block)
            out.prefix_shorter_than_block += shared
            out.not_cached += num_missed_tokens - shared

    def _longest_shared_run(self, block: MissedBlock) -> int:
        """Leading tokens that some cached block after the same parent has in common with ``block``."""
        candidates = self._siblings.get((block.parent_key, block.token_ids[0]), ())
        mine = block.token_ids
        best = 0
        for block_hash in candidates:
            theirs = array("I")
            theirs.frombytes(self._info[block_hash][2])
            shared = 0
            for a, b in zip(mine, theirs):
                if a != b:
                    break
                shared += 1
            best = max(best, shared)
        return best


@dataclass(slots=True)
class KVCacheStats:
    """The prefix cache's and the pools' figures (the Stats call)."""

    num_blocks: int
    num_free_blocks: int  # neither in use nor reserved (cached ones count: they are evictable)
    num_cached_free_blocks: int  # free device blocks that still hold reusable content
    num_host_blocks: int
    num_cached_host_blocks: int
    query_tokens: int  # prompt tokens of admitted requests, looked up in the cache
    hit_tokens: int  # of those, reused
    not_reused: NotReusedTokens
    num_evicted_blocks: int  # cached device blocks whose id was needed again
    num_swapped_out_blocks: int
    num_swapped_in_blocks: int
    num_host_evicted_blocks: int
