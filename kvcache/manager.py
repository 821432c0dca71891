"""Per-request block tables over the device pool and the host tier: prefix reuse,
admission control and the copies between the tiers.

The scheduler asks: which prefix of a request is cached (``find_cached_prefix``),
can it start (``can_admit``) and with which blocks (``admit``), which new blocks
does it need to hold its tokens this step (``allocate_slots``), which of its
full blocks may others reuse now that they are computed
(``cache_computed_blocks``), and give everything back (``free``).

Admission under TensorRT-LLM's GUARANTEED_NO_EVICT sets aside (reserves) blocks
for a request's whole lifetime, prompt + max_tokens, so a running request never
runs out; the blocks are allocated lazily as tokens are computed. Without a
lifetime (MAX_UTILIZATION) only the blocks of the first step are needed, and a
later ``allocate_slots`` may find none free: the scheduler then preempts.

Blocks become reusable only once the step that computed them has finished
(``cache_computed_blocks`` runs on the step's result), so no request ever reads
a block that is still being written.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from kvcache.block_hash import BlockHash, BlockHashes
from kvcache.block_pool import BlockPool, NoFreeBlocksError
from kvcache.eviction_queue import DEFAULT_RETENTION_PRIORITY, KvCacheRetention
from kvcache.host_tier import BlockCopies, HostTier
from kvcache.prefix_hit import PrefixHit
from kvcache.reuse_stats import KVCacheStats, MissedBlock, MissExplainer, NotReusedTokens


def blocks_for_tokens(num_tokens: int, tokens_per_block: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens (ceiling division)."""
    return -(-num_tokens // tokens_per_block)


@dataclass(slots=True)
class _Table:
    block_ids: list[int]
    retention: KvCacheRetention | None
    reserved: int = 0  # blocks promised (GUARANTEED_NO_EVICT) but not yet allocated
    num_registered: int = 0  # leading blocks that are in the prefix cache


class KVCacheManager:
    """Owns the block pool, the host tier and every request's block table."""

    def __init__(self, num_blocks: int, tokens_per_block: int, enable_prefix_caching: bool = True, num_host_blocks: int = 0) -> None:
        if tokens_per_block <= 0:
            raise ValueError(f"tokens_per_block must be positive, got {tokens_per_block}")
        self.tokens_per_block = tokens_per_block
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, on_evict=self._on_device_evict)
        self.host = HostTier(num_host_blocks if enable_prefix_caching else 0)
        self.explainer = MissExplainer(max_evicted=4 * (num_blocks + self.host.num_slots) + 1024)
        self._tables: dict[str, _Table] = {}
        self._num_reserved = 0
        self._copies = BlockCopies()
        self._arriving: dict[int, tuple[int, BlockHash, int]] = {}  # device block -> (slot, hash, priority), this step
        self._query_tokens = self._hit_tokens = 0
        self._not_reused = NotReusedTokens()
        self._num_evicted = self._num_swapped_out = self._num_swapped_in = self._num_host_evicted = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks neither in use nor promised to an admitted request."""
        return self.pool.num_free_blocks - self._num_reserved

    @property
    def num_requests(self) -> int:
        return len(self._tables)

    def block_table(self, request_id: str) -> list[int]:
        entry = self._tables.get(request_id)
        return entry.block_ids if entry is not None else []

    # -- admission ---------------------------------------------------------------

    def find_cached_prefix(self, hashes: BlockHashes, num_tokens: int) -> PrefixHit:
        """Cached blocks (either tier) matching the request's leading full blocks.

        Never the whole sequence: the block holding the last token is computed,
        so the step has logits to sample from.
        """
        hit = PrefixHit()
        if not self.enable_prefix_caching:
            return hit
        for block_hash in hashes.hashes[: (num_tokens - 1) // self.tokens_per_block]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None and block_hash not in self.host.cached:
                break
            hit.hashes.append(block_hash)
            hit.device_blocks.append(block_id)
            if block_id is not None and self.pool.ref_count(block_id) == 0:
                hit.num_free_device += 1
        return hit

    def can_admit(self, hit: PrefixHit, num_tokens: int, lifetime_tokens: int | None = None) -> bool:
        """Whether a request with ``hit`` can hold ``num_tokens`` tokens now; with ``lifetime_tokens``
        (GUARANTEED_NO_EVICT) blocks for all of them must be free to set aside."""
        wanted = num_tokens if lifetime_tokens is None else max(num_tokens, lifetime_tokens)
        needed = blocks_for_tokens(wanted, self.tokens_per_block) - hit.num_on_device
        return needed + hit.num_free_device <= self.num_free_blocks

    def admit(
        self, request_id: str, hit: PrefixHit, num_tokens: int, lifetime_tokens: int | None = None,
        retention: KvCacheRetention | None = None,
    ) -> list[int]:
        """Give a request its cached prefix plus blocks for ``num_tokens`` tokens; returns its block table.

        Host-resident blocks of the prefix get fresh device blocks and a swap-in each.
        """
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already has a block table")
        if not self.can_admit(hit, num_tokens, lifetime_tokens):
            raise NoFreeBlocksError(f"request {request_id!r} does not fit in {self.num_free_blocks} free blocks")
        self.pool.share([b for b in hit.device_blocks if b is not None])
        # Host blocks leave the host tier before allocating can evict device blocks into it.
        taken = iter([self.host.take(h) for h, b in zip(hit.hashes, hit.device_blocks) if b is None])
        arriving = iter(self.pool.allocate(hit.num_blocks - hit.num_on_device))
        table: list[int] = []
        for index, (block_hash, block_id) in enumerate(zip(hit.hashes, hit.device_blocks)):
            priority = self._priority(retention, index)
            if block_id is None:
                slot, host_priority = next(taken)
                block_id = next(arriving)
                self.pool.register(block_id, block_hash, max(priority, host_priority))
                self._copies.swap_in.append((slot, block_id))
                self._arriving[block_id] = (slot, block_hash, host_priority)
                self._num_swapped_in += 1
            else:
                self.pool.raise_priority(block_id, priority)
            table.append(block_id)
        entry = _Table(table, retention, num_registered=len(table))
        self._tables[request_id] = entry
        if lifetime_tokens is not None:
            entry.reserved = max(0, blocks_for_tokens(lifetime_tokens, self.tokens_per_block) - len(table))
            self._num_reserved += entry.reserved
        new_blocks = self.allocate_slots(request_id, num_tokens)
        assert new_blocks is not None, "can_admit promised these blocks"
        return table

    def can_reserve(self, num_tokens: int) -> bool:
        """GUARANTEED_NO_EVICT admission of a request with nothing cached."""
        return self.can_admit(PrefixHit(), 0, num_tokens)

    def reserve(self, request_id: str, num_tokens: int) -> None:
        """Set aside blocks for a request's whole lifetime, nothing cached (admission)."""
        self.admit(request_id, PrefixHit(), 0, lifetime_tokens=num_tokens)

    # -- growth and release ------------------------------------------------------------

    def unreserved_blocks_for(self, request_id: str, num_tokens: int) -> int:
        """Free blocks (beyond the request's reservation) that growing it to ``num_tokens`` tokens would take."""
        entry = self._tables[request_id]
        missing = blocks_for_tokens(num_tokens, self.tokens_per_block) - len(entry.block_ids)
        return max(0, missing - entry.reserved)

    def allocate_slots(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request's table to hold ``num_tokens`` tokens; return the new block ids,
        or None when not enough blocks are free (only without a reservation).

        Draws on the request's reservation first, then on unreserved free blocks.
        """
        entry = self._tables[request_id]
        num_held = len(entry.block_ids)
        if num_tokens <= num_held * self.tokens_per_block:
            return []  # the common case (a generation step within its last block): no division needed
        missing = blocks_for_tokens(num_tokens, self.tokens_per_block) - num_held
        from_reservation = min(missing, entry.reserved)
        if missing - from_reservation > self.num_free_blocks:
            return None
        new_blocks = self.pool.allocate(missing)
        entry.reserved -= from_reservation
        self._num_reserved -= from_reservation
        entry.block_ids.extend(new_blocks)
        return new_blocks

    def cache_computed_blocks(
        self, request_id: str, hashes: BlockHashes, num_computed_tokens: int,
        prompt_token_ids: Sequence[int], output_token_ids: Sequence[int] = (),
    ) -> int:
        """Make the request's full, computed blocks reusable by others (cheap when no block filled).

        Returns how many leading blocks of the request's table are registered now (0 without a
        table). Until the table is freed that count only grows, so a later call with no more full
        computed blocks than it does nothing: callers may skip it.
        """
        entry = self._tables.get(request_id)
        if entry is None:
            return 0
        if not self.enable_prefix_caching:
            return entry.num_registered
        block = self.tokens_per_block
        num_full = min(num_computed_tokens // block, len(entry.block_ids))
        if num_full <= entry.num_registered:
            return entry.num_registered
        token_ids = [*prompt_token_ids, *output_token_ids][: num_full * block]
        hashes.extend(token_ids)
        for index in range(entry.num_registered, num_full):
            block_id, block_hash = entry.block_ids[index], hashes.hashes[index]
            if self.pool.hash_of(block_id) is not None:
                continue
            was_cached = block_hash in self.pool.cached or block_hash in self.host.cached
            if block_hash in self.host.cached:  # computed again: the device copy replaces the host one
                self.host.discard(block_hash)
            if self.pool.register(block_id, block_hash, self._priority(entry.retention, index)) and not was_cached:
                tokens = token_ids[index * block : (index + 1) * block]
                self.explainer.cached(MissedBlock(block_hash, hashes.content_hashes[index], hashes.parent_key(index), tokens))
        entry.num_registered = num_full
        return num_full

    def free(self, request_id: str) -> None:
        """Release a request's blocks (full computed ones stay cached) and what is left of its reservation."""
        entry = self._tables.pop(request_id, None)
        if entry is None:
            return
        self.pool.free(entry.block_ids)
        self._num_reserved -= entry.reserved

    def take_copies(self) -> BlockCopies:
        """The copies the step being planned must do before its forward; starts the next step."""
        copies, self._copies = self._copies, BlockCopies()
        self._arriving.clear()
        self.host.end_step()
        return copies

    def _on_device_evict(self, block_id: int, block_hash: BlockHash, priority: int) -> None:
        self._num_evicted += 1
        arriving = self._arriving.pop(block_id, None)
        if arriving is not None:  # evicted before its swap-in ran: cancel it, the host slot still holds the block
            slot, _, host_priority = arriving
            self._copies.swap_in.remove((slot, block_id))
            self._num_swapped_in -= 1
            self.host.restore(block_hash, slot, host_priority)
            return
        stored = self.host.store(block_hash, priority) if self.host.num_slots else None
        if stored is None:
            self.explainer.dropped(block_hash)
            return
        slot, evicted = stored
        self._copies.swap_out.append((block_id, slot))
        self._num_swapped_out += 1
        if evicted is not None:
            self._num_host_evicted += 1
            self.explainer.dropped(evicted)

    def _priority(self, retention: KvCacheRetention | None, index: int) -> int:
        return DEFAULT_RETENTION_PRIORITY if retention is None else retention.priority_of_block(index, self.tokens_per_block)

    # -- accounting ----------------------------------------------------------------------

    def explain_prompt(self, hashes: BlockHashes, prompt_token_ids: Sequence[int], num_hit_blocks: int) -> NotReusedTokens:
        """Why the prompt's tokens past the first ``num_hit_blocks`` blocks were not reused
        (call once per request, at its first admission); adds to the running totals."""
        out = NotReusedTokens()
        length, block = len(prompt_token_ids), self.tokens_per_block
        if not self.enable_prefix_caching:
            out.caching_disabled = length
        else:
            reusable = (length - 1) // block  # the block of the last prompt token is always computed
            out.partial_last_block = length - reusable * block
            missed = (reusable - num_hit_blocks) * block
            if missed > 0:
                i = num_hit_blocks
                first_miss = MissedBlock(
                    hashes.hashes[i], hashes.content_hashes[i], hashes.parent_key(i), prompt_token_ids[i * block : (i + 1) * block]
                )
                self.explainer.explain(first_miss, missed, out)
        self._query_tokens += length
        self._hit_tokens += num_hit_blocks * block
        self._not_reused.add(out)
        return out

    def stats(self) -> KVCacheStats:
        not_reused = NotReusedTokens()
        not_reused.add(self._not_reused)
        return KVCacheStats(
            num_blocks=self.num_blocks, num_free_blocks=self.num_free_blocks,
            num_cached_free_blocks=self.pool.num_cached_free_blocks, num_host_blocks=self.host.num_slots,
            num_cached_host_blocks=self.host.num_cached, query_tokens=self._query_tokens, hit_tokens=self._hit_tokens,
            not_reused=not_reused, num_evicted_blocks=self._num_evicted, num_swapped_out_blocks=self._num_swapped_out,
            num_swapped_in_blocks=self._num_swapped_in, num_host_evicted_blocks=self._num_host_evicted,
        )

    def check_consistency(self) -> list[str]:
        """Every way the books could disagree (block leaks, lost host slots); empty when sound."""
        problems = []
        users = Counter(b for entry in self._tables.values() for b in entry.block_ids)
        for block_id in range(self.num_blocks):
            if self.pool.ref_count(block_id) != users[block_id]:
                problems.append(f"block {block_id}: {self.pool.ref_count(block_id)} references, {users[block_id]} tables")
        if self.pool.num_free_blocks + len(users) != self.num_blocks:
            problems.append(f"{self.pool.num_free_blocks} free + {len(users)} in use != {self.num_blocks} blocks")
        if self._num_reserved != sum(entry.reserved for entry in self._tables.values()):
            problems.append(f"{self._num_reserved} reserved, tables hold {sum(e.reserved for e in self._tables.values())}")
        host = self.host
        if host.num_free_slots + host.num_cached + host.num_releasing != host.num_slots:
            problems.append(f"host: {host.num_free_slots} free + {host.num_cached} cached + {host.num_releasing} in flight != {host.num_slots}")
        for block_hash, block_id in self.pool.cached.items():
            if self.pool.hash_of(block_id) != block_hash:
                problems.append(f"block {block_id} is indexed under a hash it does not hold")
            if block_hash in host.cached:
                problems.append(f"block {block_id}'s content is in both tiers")
        return problems
