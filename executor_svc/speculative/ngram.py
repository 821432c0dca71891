"""Prompt lookup (n-gram) drafts: guess the continuation from the request's own tokens.

When a model summarises, rewrites or edits code, its output copies long runs
of its input. The proposer takes the last n tokens of the sequence, finds the
most recent earlier place where those n tokens occurred, and proposes the
tokens that followed there. Longer n first (a longer match is a better
guess), down to ``min_n``.

Each request keeps an index from every n-gram it holds to the position after
its latest occurrence, extended by the few tokens a step adds, so a proposal
costs a handful of dictionary lookups however long the request is: at a
batch of hundreds the drafting stays well below the step it feeds.
"""

from __future__ import annotations


class NgramIndex:
    """One request's n-grams (``min_n`` to ``max_n`` tokens) -> the position after their latest occurrence."""

    __slots__ = ("min_n", "max_n", "_after", "_indexed")

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._after: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in the index

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` drafts that follow ``token_ids`` (which only ever grows); empty when nothing matches."""
        length = len(token_ids)
        # Index the n-grams that end before the last token: the suffix must match an earlier place.
        for end in range(self._indexed, length - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self._after[tuple(token_ids[end - n + 1 : end + 1])] = end + 1
        self._indexed = max(self._indexed, length - 1)
        if num_tokens <= 0:
            return []
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            start = self._after.get(tuple(token_ids[length - n :]))
            if start is not None:
                return token_ids[start : start + num_tokens]
        return []
