"""Draft-target speculation: a small model of the same tokenizer proposes the drafts.

The draft model runs inside the executor, next to the target, with a KV cache
of its own that is addressed by the target's block tables: same block ids,
same slots, another tensor. The scheduler owns those ids for both, so the draft
needs no allocator; when it asks for k drafts it also allocates the k - 1
slots past the request's tokens that drafting writes (the lookahead).

Per request the draft remembers which tokens its cache holds. Proposing for a
request that now holds L tokens:

1. catch up: one forward over the tokens the draft has not seen (or saw as
   drafts that were then rejected), ending with the token sampled last; its
   argmax is the first draft;
2. k - 1 single-token forwards, each feeding the previous draft.

Round 1 of a request that is simply continuing is a handful of tokens, which
run as single-token rows (CUDA graphs apply); a new request's first round is
its whole prompt, a context forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from executor_svc.packed_forward import Segment, pack, run_packed, to_device
from executor_svc.speculative.proposer import DraftRequest, SpeculativeMode

# A catch-up of at most this many tokens runs as single-token rows: the graphs
# of the decode path serve it; a longer one (a whole prompt) is a context forward.
ROWS_CATCH_UP_LIMIT = 17


@dataclass(slots=True)
class _DraftState:
    fed: list[int] = field(default_factory=list)  # tokens whose KV the draft cache holds, from position 0
    verified: int = 0  # fed[:verified] are known to be the request's tokens


class DraftModelProposer:
    mode = SpeculativeMode.DRAFT_MODEL
    needs_hidden = False
    needs_lookahead_slots = True

    def __init__(self, draft, target) -> None:  # both executor_svc.engine.Engine
        if draft.model_config.vocab_size != target.model_config.vocab_size:
            raise ValueError(
                f"draft model {draft.model_config.name} has a vocabulary of {draft.model_config.vocab_size} tokens, "
                f"the target {target.model_config.name} {target.model_config.vocab_size}: they must share a tokenizer"
            )
        if draft.tokens_per_block != target.tokens_per_block or draft.num_kv_blocks != target.num_kv_blocks:
            raise ValueError("the draft engine's KV cache must mirror the target's blocks (same count and block size)")
        self.engine = draft
        self.tokens_per_block = draft.tokens_per_block
        self.states: dict[str, _DraftState] = {}

    def drop(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def reset(self) -> None:
        self.states.clear()

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        engine = self.engine
        counts: list[int] = []
        segments: list[Segment] = []
        tokens: list[int] = []
        work: list[int] = []  # indices into `requests` that get drafts
        for index, req in enumerate(requests):
            length = len(req.token_ids)
            capacity = min(len(req.block_table) * self.tokens_per_block, engine.max_seq_len)
            count = min(req.num_drafts, capacity - length + 1)  # drafting writes up to position length + count - 2
            counts.append(max(count, 0))
            if count <= 0:
                continue
            state = self.states.setdefault(req.request_id, _DraftState())
            # At least the last token is fed: its logits give the first draft.
            valid = min(_common_prefix(state.fed, req.token_ids, state.verified), length - 1)
            new = req.token_ids[valid:]
            segments.append(Segment(req.block_table, valid, len(new), as_rows=len(new) <= ROWS_CATCH_UP_LIMIT))
            tokens.extend(new)
            state.fed[valid:] = new
            work.append(index)
        drafts: list[list[int]] = [[] for _ in requests]
        if not work:
            return drafts
        packed = pack(segments, self.tokens_per_block)
        ends, total = [], 0  # each segment's last token: its logits give the first draft
        for seg in segments:
            total += seg.count
            ends.append(total - 1)
        logits, _ = run_packed(engine.model, engine.kv_cache, engine.decode_graphs, packed, tokens, ends)
        rounds = [logits.argmax(dim=-1)]  # [len(work)] on the device
        active = list(range(len(work)))  # positions in `work` still drafting
        for step in range(1, max(counts[i] for i in work)):
            active = [j for j in active if counts[work[j]] > step]
            if not active:
                break
            segs = []
            for j in active:
                req = requests[work[j]]
                segs.append(Segment(req.block_table, len(req.token_ids) + step - 1, 1, as_rows=True))
            packed = pack(segs, self.tokens_per_block)
            rows = to_device(active, torch.int64, engine.device)
            # Each row feeds the draft it made last round, straight from the device.
            patch = (torch.arange(len(active), device=engine.device), rounds[-1].index_select(0, rows))
            logits, _ = run_packed(engine.model, engine.kv_cache, engine.decode_graphs, packed, [0] * len(active),
                                   list(range(len(active))), patch)
            picks = torch.full((len(work),), -1, dtype=torch.int64, device=engine.device)
            picks.index_copy_(0, rows, logits.argmax(dim=-1))
            rounds.append(picks)
        table = torch.stack(rounds, dim=1).tolist()  # [len(work), rounds]: the proposer's one wait for the device
        for j, index in enumerate(work):
            req, count = requests[index], counts[index]
            drafts[index] = table[j][:count]
            state = self.states[req.request_id]
            state.fed = req.token_ids + drafts[index][:-1]  # every draft but the last was fed
            state.verified = len(req.token_ids)
        return drafts


def _common_prefix(fed: list[int], token_ids: list[int], start: int) -> int:
    """Length of the common prefix of ``fed`` and ``token_ids``, knowing the first ``start`` agree."""
    limit = min(len(fed), len(token_ids))
    i = min(start, limit)
    while i < limit and fed[i] == token_ids[i]:
        i += 1
    return i
