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
