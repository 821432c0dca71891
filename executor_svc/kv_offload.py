"""The host-memory tier of the KV cache, executor side: a pool of host blocks and
the copies between it and the device cache.

The scheduler owns the host slot ids, as it owns device block ids, and lists
each step's copies in the plan: every swap-out (device block -> host slot, a
cached block evicted from the device) and then every swap-in (host slot ->
device block, a prefix hit on a host-resident block), all before the step's
forward writes or reads the cache.

The host pool is one tensor ``[num_host_blocks, layers, 2, tokens_per_block,
kv_heads, D]``: a slot is contiguous, so moving one block is one DMA. On CUDA
it is pinned, and the copies run on a side stream that starts after the work
already queued (the previous forward wrote the blocks being swapped out) and
that the compute stream waits for before this step's forward: the host thread
never blocks on them. On the CPU it is ordinary memory and the copies are
plain. The host pool has the device cache's dtype (1-byte for an FP8 / INT8
cache, so a host budget holds twice the blocks); an FP8 cache is copied
through a uint8 view of the same bytes, since indexing ops lack FP8 kernels.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from kvcache.layout import KVCacheLayout
from plugins.kv_cache_quant import as_bytes
from protos.plan import BlockCopy


class KVOffload:
    """Host blocks for one device KV cache, and the copies between the two."""

    def __init__(self, kv_cache: torch.Tensor, num_device_blocks: int, num_host_blocks: int, max_blocks_per_copy: int = 16) -> None:
        # kv_cache: [layers, 2, blocks, tokens_per_block, kv_heads, D]; ids >= num_device_blocks
        # (a scratch block) are never the scheduler's.
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        self.kv_cache = kv_cache
        self.num_device_blocks = num_device_blocks
        self.num_host_blocks = num_host_blocks
        # Bounds the device memory of the staging copies (a Llama-3.1-8B block is 4 MiB at 32 tokens).
        self.max_blocks_per_copy = max_blocks_per_copy
        self.device = kv_cache.device
        on_cuda = self.device.type == "cuda"
        layers, two, _, tokens_per_block, kv_heads, head_dim = kv_cache.shape
        self.block_shape = (layers, two, tokens_per_block, kv_heads, head_dim)
        # host_cache: [num_host_blocks, layers, 2, tokens_per_block, kv_heads, D]
        self.host_cache = (
            torch.empty((num_host_blocks, *self.block_shape), dtype=kv_cache.dtype, pin_memory=on_cuda) if num_host_blocks else None
        )
        self._stream = torch.cuda.Stream(self.device) if on_cuda and num_host_blocks else None
        # The tensors the copies index: the same memory, as bytes for FP8 (identity for other dtypes).
        self._device_data = as_bytes(kv_cache)
        self._host_data = as_bytes(self.host_cache) if self.host_cache is not None else None

    @staticmethod
    def blocks_for_budget(layout: KVCacheLayout, budget_bytes: int) -> int:
        """Host blocks that fit in ``budget_bytes`` of host memory."""
        return layout.num_blocks_for_budget(budget_bytes)

    def copy_blocks(self, swap_out: Sequence[BlockCopy], swap_in: Sequence[BlockCopy]) -> None:
        """One step's copies: every swap-out in order, then every swap-in, ordered before the step's forward."""
        if not swap_out and not swap_in:
            return
        self._check(swap_out, "swap_out")
        self._check(swap_in, "swap_in")
        if self._stream is None:
            self._swap_out(swap_out)
            self._swap_in(swap_in)
            return
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)  # the blocks to swap out were written by work already queued
        with torch.cuda.stream(self._stream):
            self._swap_out(swap_out)
            self._swap_in(swap_in)
        compute.wait_stream(self._stream)  # this step's forward overwrites / reads those blocks

    def _swap_out(self, copies: Sequence[BlockCopy]) -> None:
        assert self._host_data is not None
        for chunk in _chunks(copies, self.max_blocks_per_copy):
            index = torch.tensor([c.device_block for c in chunk], dtype=torch.int64, device=self.device)
            # blocks: [k, layers, 2, tokens_per_block, kv_heads, D], each block contiguous
            blocks = self._device_data.index_select(2, index).movedim(2, 0).contiguous()
            for i, copy in enumerate(chunk):  # in order: a slot written twice keeps the later block
                self._host_data[copy.host_slot].copy_(blocks[i], non_blocking=True)

    def _swap_in(self, copies: Sequence[BlockCopy]) -> None:
        assert self._host_data is not None
        for chunk in _chunks(copies, self.max_blocks_per_copy):
            # staged: [k, layers, 2, tokens_per_block, kv_heads, D]
            staged = torch.empty((len(chunk), *self.block_shape), dtype=self._device_data.dtype, device=self.device)
            for i, copy in enumerate(chunk):
                staged[i].copy_(self._host_data[copy.host_slot], non_blocking=True)
            index = torch.tensor([c.device_block for c in chunk], dtype=torch.int64, device=self.device)
            self._device_data.index_copy_(2, index, staged.movedim(0, 2))

    def _check(self, copies: Sequence[BlockCopy], name: str) -> None:
        for copy in copies:
            if not 0 <= copy.device_block < self.num_device_blocks:
                raise ValueError(f"{name}: device block {copy.device_block} outside [0, {self.num_device_blocks})")
            if not 0 <= copy.host_slot < self.num_host_blocks:
                raise ValueError(f"{name}: host slot {copy.host_slot} outside [0, {self.num_host_blocks})")


def _chunks(items: Sequence[BlockCopy], size: int) -> Iterator[Sequence[BlockCopy]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]
