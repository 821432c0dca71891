"""Chained hashes of full KV blocks: the keys of the prefix cache.

A block's hash covers its parent block's hash, its token ids and its extra
keys, so equal hashes mean equal KV: the same tokens at the same positions
after the same prefix, under the same salt (vLLM v1's scheme). The salt
(``cache_salt``, e.g. one per tenant) goes into the first block only; the
chain carries it to every later block. ``extra_keys`` go into every block and
leave room for what else decides the KV a block holds (an adapter, say).

Only full blocks are hashed: a partial block's content still changes.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

BlockHash = NewType("BlockHash", bytes)

# The parent of every first block; versioned so a change of scheme never matches old hashes.
_ROOT = b"inflight.kvcache.block_hash.v1"


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple[str, ...] = ()) -> BlockHash:
    """The hash of one block given its parent's hash (None for the first block)."""
    h = hashlib.sha256(_ROOT if parent is None else parent)
    tokens = array("I", token_ids).tobytes()  # token ids are < 2**32
    h.update(len(tokens).to_bytes(4, "little"))
    h.update(tokens)
    for key in extra_keys:  # length-prefixed: ("ab", "c") and ("a", "bc") differ
        encoded = key.encode()
        h.update(len(encoded).to_bytes(4, "little"))
        h.update(encoded)
    return BlockHash(h.digest())


@dataclass(frozen=True, slots=True)
class BlockKeys:
    """What besides the token ids decides whether two requests may share KV blocks."""

    cache_salt: str = ""
    extra_keys: tuple[str, ...] = ()  # every block; e.g. an adapter's name

    def for_block(self, index: int, salted: bool = True) -> tuple[str, ...]:
        if index == 0 and salted and self.cache_salt:
            return ("salt", self.cache_salt, *self.extra_keys)
        return self.extra_keys

    def root_key(self) -> BlockHash:
        """Stands for "the parent" of the first block: requests with other keys never meet there."""
        return hash_block(None, (), self.for_block(0))


class BlockHashes:
    """One request's chained block hashes, extended as its tokens fill blocks.

    ``content_hashes`` is the same chain without the salt: a block missing under
    this request's salt but cached under another is found through it. Without a
    salt the two chains are one list (nothing is hashed twice).
    """

    __slots__ = ("tokens_per_block", "keys", "hashes", "content_hashes")

    def __init__(self, tokens_per_block: int, keys: BlockKeys = BlockKeys()) -> None:
        self.tokens_per_block = tokens_per_block
        self.keys = keys
        self.hashes: list[BlockHash] = []
        self.content_hashes: list[BlockHash] = self.hashes if not keys.cache_salt else []

    def extend(self, token_ids: Sequence[int]) -> None:
        """Hash every full block of ``token_ids`` not hashed yet."""
        block = self.tokens_per_block
        for i in range(len(self.hashes), len(token_ids) // block):
            tokens = token_ids[i * block : (i + 1) * block]
            self.hashes.append(hash_block(self.hashes[i - 1] if i else None, tokens, self.keys.for_block(i)))
            if self.content_hashes is not self.hashes:
                parent = self.content_hashes[i - 1] if i else None
                self.content_hashes.append(hash_block(parent, tokens, self.keys.for_block(i, salted=False)))

    def parent_key(self, index: int) -> BlockHash:
        """The hash block ``index`` is chained on (a salt-specific root for the first)."""
        return self.hashes[index - 1] if index else self.keys.root_key()

    def __len__(self) -> int:
        return len(self.hashes)
