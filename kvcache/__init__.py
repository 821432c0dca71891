"""Paged KV cache: the block pool, prefix cache, host tier and block tables the
scheduler owns (``block_pool``, ``block_hash``, ``host_tier``, ``manager``) and
the tensor layout the executor allocates (``layout``). Imports neither service."""

from kvcache.block_hash import BlockHash, BlockHashes, BlockKeys, hash_block
from kvcache.block_pool import BlockPool, NoFreeBlocksError
from kvcache.eviction_queue import DEFAULT_RETENTION_PRIORITY, KvCacheRetention
from kvcache.host_tier import BlockCopies, HostTier
from kvcache.layout import KVCacheLayout
from kvcache.manager import KVCacheManager
from kvcache.prefix_hit import PrefixHit
from kvcache.reuse_stats import KVCacheStats, NotReusedTokens

__all__ = [
    "DEFAULT_RETENTION_PRIORITY", "BlockCopies", "BlockHash", "BlockHashes", "BlockKeys", "BlockPool", "HostTier",
    "KVCacheLayout", "KVCacheManager", "KVCacheStats", "KvCacheRetention", "NoFreeBlocksError", "NotReusedTokens",
    "PrefixHit", "hash_block",
]
