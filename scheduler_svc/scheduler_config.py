"""The scheduler's settings, and the capacity policies it can admit requests under
(see ``scheduler.py`` for what each policy does)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class CapacityPolicy(enum.Enum):
    GUARANTEED_NO_EVICT = "GUARANTEED_NO_EVICT"
    MAX_UTILIZATION = "MAX_UTILIZATION"


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_batch_size: int
    max_num_tokens: int
    tokens_per_block: int
    num_kv_blocks: int
    max_seq_len: int
    capacity_policy: CapacityPolicy = CapacityPolicy.GUARANTEED_NO_EVICT
    enable_prefix_caching: bool = True
    num_host_blocks: int = 0  # host tier of the prefix cache; 0 = none
    # Speculative decoding (what the executor offers): most drafts per request per step, whether
    # proposing k drafts writes k - 1 KV slots ahead (a draft model), and whether the draft
    # length follows the measured acceptance and step costs (off: always the most).
    max_draft_tokens: int = 0
    draft_lookahead_slots: bool = False
    adaptive_draft_length: bool = True
    # Verification rounds one step may chain when every running request verifies drafts and
    # none waits (the executor drafts the later rounds on the device); 1 = one round a step.
    max_speculative_rounds: int = 1
    # A chained step runs no more rounds than the measured costs fit in this many seconds (0 = no limit):
    # its requests' tokens stream when it ends, so this bounds the time between a stream's chunks.
    max_chained_step_seconds: float = 0.0
    # Tree drafts: the rows per request of a chained round of k drafts (index k - 1: its last token and
    # the tree's nodes of depth <= k). Empty: drafts form a chain, 1 + k rows.
    draft_tree_rows: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_num_tokens < self.tokens_per_block:
            raise ValueError(
                f"max_num_tokens ({self.max_num_tokens}) must be at least tokens_per_block ({self.tokens_per_block})"
            )
        if self.max_batch_size <= 0:
            raise ValueError(f"max_batch_size must be positive, got {self.max_batch_size}")

    def round_rows(self, draft_length: int) -> int:
        """Tokens per request of one chained verification round of ``draft_length`` drafts."""
        if 0 < draft_length <= len(self.draft_tree_rows):
            return self.draft_tree_rows[draft_length - 1]
        return 1 + draft_length

    def rounds_kv_span(self, draft_length: int, rounds: int) -> int:
        """KV slots past a request's computed tokens that ``rounds`` chained rounds may write: each round but
        the last moves on by at most 1 + k tokens, and the last writes its whole round (a tree's every node)."""
        return (rounds - 1) * (1 + draft_length) + self.round_rows(draft_length)

    def draft_length_of(self, rows: int) -> int:
        """The draft length whose round has ``rows`` tokens per request (``round_rows`` inverted)."""
        if rows in self.draft_tree_rows:
            return self.draft_tree_rows.index(rows) + 1
        return rows - 1
