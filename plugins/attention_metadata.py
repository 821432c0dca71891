"""What attention needs to know about one packed step, shared by all layers."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

TREE_MASK_BITS = 64  # a tree mask covers the query's own key and the 63 before it


@dataclass(slots=True)
class AttentionMetadata:
    """Layout of a packed batch of ``num_tokens`` query tokens.

    Requests are packed back to back with no padding. Request ``i`` owns query
    tokens ``query_start[i]:query_start[i + 1]``, which sit at sequence
    positions ``context_lens[i] - query_len .. context_lens[i] - 1``; its keys
    and values (this step's included, already written to the cache) are the
    first ``context_lens[i]`` slots of its block table.
    """

    # Per request (host lists, for loops and slicing without device syncs).
    query_start: list[int]  # [num_requests + 1], cumulative query lengths
    context_lens: list[int]  # [num_requests], tokens in the cache after this step
    # Device tensors.
    block_tables: torch.Tensor  # [num_requests, max_blocks] int32, padded with 0
    context_lens_t: torch.Tensor  # [num_requests] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64: flat cache slot of each new token
    # Requests whose query is a single token (generation steps), batched together.
    single_query_rows: torch.Tensor  # [num_single] int64, request indices
    single_query_tokens: torch.Tensor  # [num_single] int64, their token indices
    multi_query_rows: list[int]  # request indices with more than one query token
    # Tree drafts (speculative decoding): per request, which of the 64 keys before and at its query it
    # sees. Bit d of tree_masks[i] covers the key at position context_lens[i] - 1 - d; keys further back
    # are always seen. -1 (every bit set) is the plain causal row. None: no request has a tree mask.
    # Only single-token queries read it (``TREE_MASK_BITS``).
    tree_masks: torch.Tensor | None = None  # [num_requests] int64
    # Tensors derived from the above that every layer needs (masks, gathered
    # tables), computed by the first layer that asks: the same for the whole step.
    derived: dict = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return len(self.context_lens)
