"""Block pool and per-request block tables."""

import pytest

from kvcache import BlockPool, KVCacheManager, NoFreeBlocksError
from kvcache.layout import slot_mapping


def test_pool_allocates_distinct_blocks_and_takes_them_back():
    pool = BlockPool(8)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert len(set(a + b)) == 8 and pool.num_free_blocks == 0
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    pool.free(a)
    assert pool.num_free_blocks == 3
    with pytest.raises(ValueError, match="freed twice"):
        pool.free(a)


def test_shared_block_is_free_only_after_last_user():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.share(blocks)
    pool.free(blocks)
    assert pool.num_free_blocks == 2
    pool.free(blocks)
    assert pool.num_free_blocks == 4


def test_freed_blocks_are_reused_oldest_first():
    pool = BlockPool(4)
    first = pool.allocate(4)
    pool.free([first[0]])
    pool.free([first[2]])
    assert pool.allocate(2) == [first[0], first[2]]


def test_reservation_guarantees_growth_and_blocks_admission():
    kv = KVCacheManager(num_blocks=10, tokens_per_block=4)
    kv.reserve("a", 20)  # 5 blocks promised
    assert kv.num_free_blocks == 5
    assert not kv.can_reserve(24)  # 6 blocks: would break a's guarantee
    assert kv.can_reserve(20)
    assert kv.allocate_slots("a", 3) and len(kv.block_table("a")) == 1
    assert kv.allocate_slots("a", 4) == []  # still fits in the first block
    assert len(kv.allocate_slots("a", 9)) == 2
    assert kv.num_free_blocks == 5  # allocation drew on a's reservation
    kv.free("a")
    assert kv.num_free_blocks == 10 and kv.pool.num_free_blocks == 10


def test_slot_mapping_follows_block_table():
    table = [7, 2]
    assert slot_mapping(table, 2, 6, tokens_per_block=4) == [30, 31, 8, 9]


# -- block hashes --------------------------------------------------------------------

from kvcache import BlockHashes, BlockKeys, KVCacheManager as _Manager, KvCacheRetention, NotReusedTokens, hash_block  # noqa: E402
from kvcache.eviction_queue import EvictionQueue  # noqa: E402


def hashes_of(tokens, salt="", block=4):
    h = BlockHashes(block, BlockKeys(salt))
    h.extend(tokens)
    return h


def test_block_hashes_chain_on_parent_tokens_and_salt():
    a = hashes_of(list(range(10)))
    assert len(a) == 2  # only full blocks are hashed
    assert a.hashes == hashes_of(list(range(10))).hashes  # deterministic
    # Same second block after a different first block: a different hash.
    b = hashes_of([9, 9, 9, 9] + list(range(4, 8)))
    assert b.hashes[1] != a.hashes[1]
    # Same tokens under another salt: every block differs (the salt is chained on)...
    salted = hashes_of(list(range(10)), salt="tenant-a")
    assert not set(salted.hashes) & set(a.hashes)
    # ...but the content chain without the salt is the unsalted chain.
    assert salted.content_hashes == a.hashes
    assert hash_block(None, [1, 2], ("ab", "c")) != hash_block(None, [1, 2], ("a", "bc"))


def test_block_hashes_extend_incrementally():
    grown = BlockHashes(4)
    tokens = list(range(12))
    for end in range(1, 13):
        grown.extend(tokens[:end])
    assert grown.hashes == hashes_of(tokens).hashes


# -- eviction order -----------------------------------------------------------------


def test_eviction_queue_lowest_priority_first_then_lru():
    q = EvictionQueue()
    for item, priority in [(1, 35), (2, 80), (3, 35), (4, 10), (5, 80)]:
        q.push(item, priority)
    q.remove(3)
    q.push(3, 35)  # touched: most recently used of its priority
    assert q.order() == [4, 1, 3, 2, 5]
    assert [q.pop() for _ in range(5)] == [4, 1, 3, 2, 5]


def test_cached_blocks_survive_release_and_are_evicted_last_lru_first():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        assert pool.register(b, hash_block(None, [i]))
    pool.free(blocks[:1])
    pool.free(blocks[1:])  # freed in reverse: blocks[2] first, then blocks[1]
    assert pool.num_free_blocks == 4 and pool.num_cached_free_blocks == 3
    assert pool.lookup(hash_block(None, [0])) == blocks[0]
    # The empty block goes first; then cached blocks, least recently freed first.
    assert pool.eviction_order() == [3, blocks[0], blocks[2], blocks[1]]
    evicted = []
    pool.on_evict = lambda block_id, block_hash, priority: evicted.append(block_id)
    assert pool.allocate(2) == [3, blocks[0]]
    assert evicted == [blocks[0]] and pool.lookup(hash_block(None, [0])) is None


def test_retention_priority_outlives_lru():
    pool = BlockPool(3)
    system, ordinary = pool.allocate(2)
    pool.register(system, hash_block(None, [1]), priority=90)
    pool.register(ordinary, hash_block(None, [2]))
    pool.free([system])  # least recently used, but kept at a higher priority
    pool.free([ordinary])
    assert pool.allocate(2)[1] == ordinary
    assert pool.lookup(hash_block(None, [1])) == system


def test_reusing_a_cached_free_block_takes_it_off_the_free_list():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.register(b, hash_block(None, [7]))
    pool.free([b])
    pool.share([b])  # a prefix hit
    assert pool.ref_count(b) == 1 and pool.num_free_blocks == 1
    pool.share([b])  # a second user
    pool.free([b])
    assert pool.num_free_blocks == 1  # still used by one
    pool.free([b])
    assert pool.num_free_blocks == 2 and pool.lookup(hash_block(None, [7])) == b
    with pytest.raises(ValueError, match="holds nothing"):
        pool.share([1 - b])


# -- the manager: hits, misses and why -------------------------------------------------


def run_request(kv: _Manager, rid: str, tokens: list[int], salt: str = "", retention=None) -> tuple[int, NotReusedTokens]:
    """Admit a request, 'compute' its prompt, cache its blocks; return (cached tokens, reasons)."""
    hashes = hashes_of(tokens, salt, kv.tokens_per_block)
    hit = kv.find_cached_prefix(hashes, len(tokens))
    kv.admit(rid, hit, len(tokens), retention=retention)
    reasons = kv.explain_prompt(hashes, tokens, hit.num_blocks)
    kv.cache_computed_blocks(rid, hashes, len(tokens), tokens)
    return hit.num_blocks * kv.tokens_per_block, reasons


def test_prefix_hit_shares_blocks_and_never_covers_the_last_token():
    kv = _Manager(num_blocks=16, tokens_per_block=4)
    prompt = list(range(100, 112))  # 3 full blocks
    assert run_request(kv, "a", prompt)[0] == 0
    cached, reasons = run_request(kv, "b", prompt)
    assert cached == 8  # not 12: the block of the last token is computed for its logits
    assert reasons == NotReusedTokens(partial_last_block=4)
    assert kv.block_table("b")[:2] == kv.block_table("a")[:2]
    assert kv.pool.ref_count(kv.block_table("a")[0]) == 2
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 16 and not kv.check_consistency()
    assert kv.stats().hit_tokens == 8 and kv.stats().query_tokens == 24


def test_not_reused_reasons():
    kv = _Manager(num_blocks=8, tokens_per_block=4)
    base = list(range(100, 113))  # 13 tokens: 3 full blocks + 1
    cached, reasons = run_request(kv, "first", base)
    assert cached == 0 and reasons == NotReusedTokens(partial_last_block=1, not_cached=12)
    kv.free("first")
    # Diverges two tokens into the third block: 8 reused, 2 shared-but-not-whole, 2 new, 1 partial.
    cached, reasons = run_request(kv, "diverges", base[:10] + [7, 7, 7])
    assert cached == 8 and reasons == NotReusedTokens(prefix_shorter_than_block=2, not_cached=2, partial_last_block=1)
    kv.free("diverges")
    # The same tokens under a salt.
    cached, reasons = run_request(kv, "salted", base, salt="tenant-b")
    assert cached == 0 and reasons == NotReusedTokens(salt_differs=12, partial_last_block=1)
    kv.free("salted")
    # Evict everything (8 blocks, no host tier), then ask again.
    filler = hashes_of(list(range(500, 532)), block=4)
    kv.admit("filler", kv.find_cached_prefix(filler, 32), 32)
    kv.free("filler")
    cached, reasons = run_request(kv, "again", base)
    assert cached == 0 and reasons == NotReusedTokens(evicted=12, partial_last_block=1)
    kv.free("again")
    off = _Manager(num_blocks=8, tokens_per_block=4, enable_prefix_caching=False)
    assert run_request(off, "x", base)[1] == NotReusedTokens(caching_disabled=13)
    assert not kv.check_consistency()


def test_retention_keeps_a_system_prompt_cached_under_pressure():
    kv = _Manager(num_blocks=6, tokens_per_block=4)
    system = list(range(1000, 1008))  # 2 blocks
    run_request(kv, "sys", system + [1, 2, 3, 4, 5], retention=KvCacheRetention(num_prefix_tokens=8, priority=90))
    kv.free("sys")
    for i in range(3):  # ordinary traffic that needs every block, one request at a time
        tokens = list(range(2000 + 100 * i, 2000 + 100 * i + 13))
        run_request(kv, f"o{i}", tokens)
        kv.free(f"o{i}")
    cached, _ = run_request(kv, "sys2", system + [9, 9, 9, 9, 9])
    assert cached == 8


def test_guaranteed_no_evict_reservation_counts_reused_blocks_once():
    kv = _Manager(num_blocks=6, tokens_per_block=4)
    run_request(kv, "a", list(range(12)))  # 3 blocks, still running
    hashes = hashes_of(list(range(12)) + [50], block=4)
    hit = kv.find_cached_prefix(hashes, 13)
    assert hit.num_blocks == 3 and hit.num_free_device == 0
    # Lifetime 13 + 11 = 24 tokens = 6 blocks, 3 of them shared: 3 new ones fit exactly.
    assert kv.can_admit(hit, 13, lifetime_tokens=24)
    assert not kv.can_admit(hit, 13, lifetime_tokens=28)
    kv.admit("b", hit, 13, lifetime_tokens=24)
    assert kv.num_free_blocks == 0
    assert kv.allocate_slots("b", 24) is not None  # the reservation holds


def test_allocate_slots_grows_only_past_the_last_block_and_cache_reports_registered_blocks():
    kv = _Manager(num_blocks=8, tokens_per_block=4)
    tokens = list(range(300, 310))
    hashes = hashes_of(tokens, block=4)
    kv.admit("a", kv.find_cached_prefix(hashes, 10), 10)
    assert len(kv.block_table("a")) == 3
    assert kv.allocate_slots("a", 12) == []  # still within its last block
    (grown,) = kv.allocate_slots("a", 13)
    assert kv.block_table("a")[-1] == grown
    # The count of registered blocks: what a caller may skip the next call by.
    assert kv.cache_computed_blocks("a", hashes, 7, tokens) == 1
    assert kv.cache_computed_blocks("a", hashes, 7, tokens) == 1
    assert kv.cache_computed_blocks("a", hashes, 10, tokens) == 2
    assert kv.cache_computed_blocks("missing", hashes, 10, tokens) == 0
    assert not kv.check_consistency()


def test_miss_explainer_keeps_siblings_apart_and_adds_no_tracked_objects():
    """Blocks after the same parent share a sibling entry; dropping one keeps the others; the records are
    plain tuples, which the garbage collector stops tracking (no per-block cost in a full collection)."""
    import gc

    from kvcache.reuse_stats import MissedBlock, MissExplainer

    def block(name: str, tokens: list[int], parent: bytes = b"p") -> MissedBlock:
        return MissedBlock(name.encode(), name.encode() + b"-content", parent, tokens)

    explainer = MissExplainer(max_evicted=4)
    explainer.cached(block("a", [1, 2, 3, 4]))
    explainer.cached(block("b", [1, 2, 9, 9]))
    probe = block("c", [1, 2, 3, 7])
    out = NotReusedTokens()
    explainer.explain(probe, 4, out)
    assert out.prefix_shorter_than_block == 3  # shares three tokens with "a"
    explainer.dropped(b"a")
    out = NotReusedTokens()
    explainer.explain(probe, 4, out)
    assert out.prefix_shorter_than_block == 2  # "b" is still there
    explainer.dropped(b"b")
    out = NotReusedTokens()
    explainer.explain(probe, 4, out)
    assert out == NotReusedTokens(not_cached=4)
    assert not explainer._siblings  # the last sibling took its key with it

    gc.collect()
    before = len(gc.get_objects())
    for i in range(5000):
        explainer.cached(block(f"x{i}", list(range(i, i + 16)), parent=bytes([i % 7])))
    gc.collect()
    assert len(gc.get_objects()) - before < 50
