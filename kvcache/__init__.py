"""Paged KV cache: the block pool and block tables the scheduler owns
(``block_pool``, ``manager``) and the tensor layout the executor allocates
(``layout``). Imports neither service."""

from kvcache.block_pool import BlockPool, NoFreeBlocksError
from kvcache.layout import KVCacheLayout
from kvcache.manager import KVCacheManager

__all__ = ["BlockPool", "KVCacheLayout", "KVCacheManager", "NoFreeBlocksError"]
