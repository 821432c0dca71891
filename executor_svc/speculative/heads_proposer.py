"""Draft heads as a Proposer: Medusa-style heads read the target's last hidden state.

The runner keeps the final hidden state of the row that sampled each
request's last token; the heads turn it into k drafts (head i guesses the
token i + 1 places after that one) with one batched matmul per head. No KV
cache and no per-request state: the chain of drafts is verified like any
other.
"""

from __future__ import annotations

import torch

from executor_svc.speculative.draft_heads import load_draft_heads
from executor_svc.speculative.proposer import DraftRequest, SpeculativeMode


class HeadsProposer:
    mode = SpeculativeMode.DRAFT_HEADS
    needs_hidden = True
    needs_lookahead_slots = False

    def __init__(self, heads, model) -> None:
        self.heads = heads
        self.model = model

    @classmethod
    def load(cls, engine) -> HeadsProposer:  # engine: executor_svc.engine.Engine
        heads = load_draft_heads(engine.engine_dir, engine.model_config, engine.device, engine.dtype)
        return cls(heads, engine.model)

    @property
    def max_draft_tokens(self) -> int:
        return self.heads.num_heads

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        if not requests:
            return []
        want = min(max(r.num_drafts for r in requests), self.heads.num_heads)
        hidden = torch.stack([r.hidden for r in requests])  # [n, hidden]
        table = self.heads.propose(hidden, self.model, want).tolist()  # the proposer's one wait for the device
        return [row[: r.num_drafts] for row, r in zip(table, requests)]

    def drop(self, request_id: str) -> None:
        pass

    def reset(self) -> None:
        pass
