"""One whole prompt through a packed-token model, outside the serving loop.

Calibration and the perplexity gate run the model over single texts: one
request whose prompt fills the first blocks of a small private KV cache, so
the forward is exactly the one serving runs for a context step (with a
quantized KV cache too: the prompt's keys and values are written to it and
attention reads them back from it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from executor_svc.model.config import ModelConfig
from kvcache.layout import KVCacheLayout
from plugins.attention_metadata import AttentionMetadata


@dataclass(slots=True)
class PromptForward:
    model: nn.Module  # forward(input_ids, positions, kv_cache, meta) -> hidden
    kv_cache: torch.Tensor  # [layers, 2, blocks, tokens_per_block, kv_heads, D]
    tokens_per_block: int
    device: torch.device

    @classmethod
    def create(
        cls, model: nn.Module, config: ModelConfig, max_tokens: int, tokens_per_block: int, device: torch.device,
        dtype: torch.dtype, kv_dtype: torch.dtype | None = None,
    ) -> PromptForward:
        """A runner with a cache of ``kv_dtype`` (default: ``dtype``; FP8 / INT8 uses the model layers' KV scales)."""
        layout = KVCacheLayout(
            config.num_layers, config.num_kv_heads, config.head_dim, tokens_per_block, kv_dtype or dtype
        )
        num_blocks = -(-max_tokens // tokens_per_block)
        return cls(model, layout.allocate(num_blocks, device), tokens_per_block, device)

    @property
    def max_tokens(self) -> int:
        return self.kv_cache.shape[2] * self.tokens_per_block

    @torch.inference_mode()
    def hidden_states(self, token_ids: list[int]) -> torch.Tensor:
        """Final-normed hidden states [tokens, hidden] of one prompt."""
        count = len(token_ids)
        if not 0 < count <= self.max_tokens:
            raise ValueError(f"a prompt of {count} tokens does not fit {self.max_tokens} cache slots")
        device = self.device
        blocks = -(-count // self.tokens_per_block)
        meta = AttentionMetadata(
            query_start=[0, count], context_lens=[count],
            block_tables=torch.arange(blocks, device=device)[None, :],
            context_lens_t=torch.tensor([count], device=device),
            slot_mapping=torch.arange(count, device=device),  # blocks 0..n-1 in order: slot = position
            single_query_rows=torch.zeros(0, dtype=torch.int64, device=device),
            single_query_tokens=torch.zeros(0, dtype=torch.int64, device=device),
            multi_query_rows=[0] if count > 1 else [],
        )
        if count == 1:  # a one-token prompt is a single-query row
            meta.single_query_rows = torch.zeros(1, dtype=torch.int64, device=device)
            meta.single_query_tokens = torch.zeros(1, dtype=torch.int64, device=device)
        ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
        return self.model(ids, torch.arange(count, device=device), self.kv_cache, meta)
