"""What the prefix cache found for a request."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcache.block_hash import BlockHash


@dataclass(slots=True)
class PrefixHit:
    """The longest cached prefix of a request, in whole blocks."""

    hashes: list[BlockHash] = field(default_factory=list)
    device_blocks: list[int | None] = field(default_factory=list)  # None: in the host tier
    num_free_device: int = 0  # device hits no request uses now (taking them shrinks the free pool)

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)

    @property
    def num_on_device(self) -> int:
        return sum(b is not None for b in self.device_blocks)
