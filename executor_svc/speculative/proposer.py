"""What the runner asks of a draft proposer, and how one is chosen.

After a step, the runner hands the proposer every request the plan asked
drafts for, with the tokens it now holds; the proposer answers with up to the
asked number of draft tokens each (fewer, or none, when it has no good
guess). The scheduler sends them back in the next plan, where the target
verifies them (``verify.py``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from executor_svc.speculative.ngram import NgramIndex


class SpeculativeMode(enum.Enum):
    NONE = ""
    NGRAM = "ngram"
    DRAFT_MODEL = "draft_model"
    DRAFT_HEADS = "draft_heads"


# Most drafts per request per step when none is given. Prompt lookup's guesses cost nothing to make, and
# at small batches a round verifies 16 rows for about what it verifies 9 (one 16-row tile per GEMM), so
# longer drafts are nearly free there: on SmolLM2 on an H200, 15 drafts from suffixes of one token or more
# ran grounded prompts 6% faster than 8 from two or more (bench/results/h200_spec_ngram_variants_smollm2.json).
# Under load the draft-length policy shortens them or turns speculation off either way.
DEFAULT_DRAFT_TOKENS = {SpeculativeMode.NGRAM: 15}
DEFAULT_DRAFT_TOKENS_OTHERWISE = 4
MAX_DRAFT_TOKENS = 16  # most drafts a request verifies at once


@dataclass(slots=True)
class SpeculativeConfig:
    """How an executor drafts (set at serve time; the engine itself does not change)."""

    mode: SpeculativeMode = SpeculativeMode.NONE
    num_draft_tokens: int | None = None  # most drafts per request per step (None: the mode's default)
    ngram_min: int = 1  # prompt lookup: shortest suffix looked up (a one-token match is a free guess)
    ngram_max: int = 4
    draft_engine_dir: Path | None = None  # DRAFT_MODEL: an engine of the same tokenizer
    # NGRAM and DRAFT_HEADS: most verification rounds one step chains on the device (speculative/rounds.py).
    # Many rounds spread a step's host work thinly; a request that arrives ends the step's rounds early
    # (``ModelRunner.end_rounds``), so it waits for about a round, not for all of them.
    max_rounds: int = 32
    # DRAFT_HEADS: verify tree drafts of this shape (paths of guess ranks, ``draft_tree.py``); None: chains.
    draft_tree: tuple[tuple[int, ...], ...] | None = None
    # Chained rounds stop once every request of the step has finished (``round_stops.py``); off only to
    # measure what that gives.
    end_rounds_early: bool = True
    # DRAFT_HEADS: where the request's last ``heads_lookup`` or more tokens occurred earlier in its own tokens,
    # draft what followed there instead of the heads' guesses (prompt lookup as in NGRAM, up to ngram_max
    # tokens of suffix); 0 = the heads alone. A repeated run is a better guess than a small head's.
    heads_lookup: int = 0
    # DRAFT_HEADS: the folder whose heads draft (``inflight train-draft --output``); None: the engine's own.
    draft_heads_dir: Path | None = None
    # DRAFT_HEADS: draft among this many of the training answers' most used tokens (``DraftVocabulary``);
    # 0: every token; None: what the heads were saved with.
    draft_vocab: int | None = None

    def __post_init__(self) -> None:
        if self.num_draft_tokens is None:
            self.num_draft_tokens = DEFAULT_DRAFT_TOKENS.get(self.mode, DEFAULT_DRAFT_TOKENS_OTHERWISE)
        if self.draft_tree is not None and self.mode is not SpeculativeMode.DRAFT_HEADS:
            raise ValueError(f"tree drafts need speculative mode draft_heads, not {self.mode.value or 'none'}")
        if self.mode is not SpeculativeMode.NONE and not 1 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"num_draft_tokens must be in [1, {MAX_DRAFT_TOKENS}], got {self.num_draft_tokens}")
        if not 1 <= self.max_rounds <= 64:
            raise ValueError(f"max_rounds must be in [1, 64], got {self.max_rounds}")
        if self.draft_heads_dir is not None and self.mode is not SpeculativeMode.DRAFT_HEADS:
            raise ValueError("a draft heads folder needs speculative mode draft_heads, "
                             f"not {self.mode.value or 'none'}")
        if self.draft_vocab is not None:
            if self.mode is not SpeculativeMode.DRAFT_HEADS:
                raise ValueError(f"draft_vocab needs speculative mode draft_heads, not {self.mode.value or 'none'}")
            if self.draft_vocab < 0:
                raise ValueError(f"draft_vocab must be at least 0 (0 = every token), got {self.draft_vocab}")
        if self.heads_lookup:
            if self.mode is not SpeculativeMode.DRAFT_HEADS:
                raise ValueError(f"heads_lookup needs speculative mode draft_heads, not {self.mode.value or 'none'}")
            if not 1 <= self.heads_lookup <= self.ngram_max:
                raise ValueError(f"heads_lookup must be in [1, ngram_max = {self.ngram_max}], got {self.heads_lookup}")
            if self.draft_tree is not None:
                raise ValueError("heads_lookup drafts chains: it does not combine with a draft tree")

    @property
    def device_rounds(self) -> int:
        """Verification rounds one step may chain: prompt lookup and draft heads draft on the device."""
        return self.max_rounds if self.mode in (SpeculativeMode.NGRAM, SpeculativeMode.DRAFT_HEADS) else 1


@dataclass(slots=True)
class DraftRequest:
    """One request to draft for."""

    request_id: str
    token_ids: list[int]  # every token it holds, the one sampled last included
    block_table: list[int]  # its KV blocks (a draft model writes its own cache at the same slots)
    num_drafts: int
    hidden: torch.Tensor | None = None  # [hidden] the target's state that sampled the last token (draft heads)


class Proposer(Protocol):
    mode: SpeculativeMode
    needs_hidden: bool  # wants DraftRequest.hidden
    needs_lookahead_slots: bool  # proposing k drafts writes the KV cache up to k - 1 positions past the tokens

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]: ...

    def drop(self, request_id: str) -> None: ...

    def reset(self) -> None: ...


class NgramLookup:
    """Prompt lookup as a Proposer: host only, one n-gram index per request."""

    mode = SpeculativeMode.NGRAM
    needs_hidden = False
    needs_lookahead_slots = False

    def __init__(self, config: SpeculativeConfig) -> None:
        NgramIndex(config.ngram_min, config.ngram_max)  # checks the sizes now, not at the first request
        self.min_n, self.max_n = config.ngram_min, config.ngram_max
        self.indexes: dict[str, NgramIndex] = {}

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        drafts = []
        for r in requests:
            index = self.indexes.get(r.request_id)
            if index is None:
                index = self.indexes[r.request_id] = NgramIndex(self.min_n, self.max_n)
            drafts.append(index.propose(r.token_ids, r.num_drafts))
        return drafts

    def drop(self, request_id: str) -> None:
        self.indexes.pop(request_id, None)

    def reset(self) -> None:
        self.indexes.clear()


def build_proposer(config: SpeculativeConfig, engine) -> Proposer | None:  # engine: executor_svc.engine.Engine
    """The proposer ``config`` asks for, bound to the target ``engine``; None when speculation is off."""
    if config.mode is SpeculativeMode.NONE:
        return None
    if config.mode is SpeculativeMode.NGRAM:
        return NgramLookup(config)
    if config.mode is SpeculativeMode.DRAFT_MODEL:
        from executor_svc.speculative.draft_model import DraftModelProposer

        if engine.draft is None:
            raise ValueError("speculative mode draft_model: the engine was loaded without its draft model")
        return DraftModelProposer(engine.draft, engine)
    from executor_svc.speculative.heads_proposer import HeadsProposer

    return HeadsProposer.load(engine)
