"""Prompt lookup (n-gram) drafts: guess the continuation from the request's own tokens.

When a model summarises, rewrites or edits code, its output copies long runs
of its input. The proposer takes the last n tokens of the sequence, finds the
most recent earlier place where those n tokens occurred, and proposes the
tokens that followed there. Longer n first (a longer match is a better
guess), down to ``min_n``. No model, no device work: a few vectorised
comparisons over the request's token ids on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class NgramProposer:
    min_n: int = 2
    max_n: int = 4
    # Only the most recent tokens are searched: bounds the host time per request
    # on long sequences, where the recent past is also the best predictor.
    max_search_tokens: int = 4096

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {self.min_n}, {self.max_n}")

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` drafts that follow ``token_ids``; empty when nothing matches."""
        if num_tokens <= 0 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids[-self.max_search_tokens :], dtype=np.int64)
        count = len(tokens)
        for n in range(min(self.max_n, count - 1), self.min_n - 1, -1):
            suffix = tokens[count - n :]
            # Windows that start at 0 .. count - n - 1 (the suffix itself excluded).
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: count - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the most recent occurrence: what followed it
                return tokens[start : start + num_tokens].tolist()
        return []
