"""The executor-side shape of the paged KV cache.

One tensor holds every layer's keys and values:
``[num_layers, 2 (k, v), num_blocks, tokens_per_block, num_kv_heads, head_dim]``.
Block ``b`` of layer ``l`` lives at ``cache[l, :, b]``, and token slot
``s = block_id * tokens_per_block + offset`` indexes the flattened
``[num_blocks * tokens_per_block]`` view, which is what the slot mapping of a
step refers to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tokens_per_block: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.tokens_per_block * self.num_kv_heads * self.head_dim * element

    def num_blocks_for_budget(self, budget_bytes: int) -> int:
        """How many blocks fit in ``budget_bytes`` of memory."""
        return max(0, budget_bytes // self.bytes_per_block)

    def allocate(self, num_blocks: int, device: torch.device) -> torch.Tensor:
        shape = (self.num_layers, 2, num_blocks, self.tokens_per_block, self.num_kv_heads, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=device)


def scratch_block(kv_cache: torch.Tensor) -> int:
    """The block no request owns: an engine allocates one block past the scheduler's (executor_svc/engine.py),
    which rows whose keys and values nobody reads write (CUDA graph padding, chained rounds past a request's
    length limit)."""
    return kv_cache.shape[2] - 1


def slot_mapping(block_table: list[int], start: int, end: int, tokens_per_block: int) -> list[int]:
    """Flat cache slots of token positions ``[start, end)`` of one request."""
    return [block_table[pos // tokens_per_block] * tokens_per_block + pos % tokens_per_block for pos in range(start, end)]


def device_slots(tables: torch.Tensor, positions: torch.Tensor, tokens_per_block: int) -> torch.Tensor:
    """``slot_mapping`` on the device, for a batch: tables [B, blocks], positions [B, n] -> slots [B, n]."""
    return tables.gather(1, positions // tokens_per_block) * tokens_per_block + positions % tokens_per_block
