"""Prompt lookup (n-gram) drafts: guess the continuation from the request's own tokens.

When a model summarises, rewrites or edits code, its output copies long runs
of its input. The proposer takes the last n tokens of the sequence, finds the
most recent earlier place where those n tokens occurred, and proposes the
tokens that followed there. Longer n first (a longer match is a better
guess), down to ``min_n``.

Each request keeps its tokens as a byte string (four bytes a token) that the
few tokens of a step extend, and a proposal is one ``rfind`` of the suffix per
n, which scans in C: a request's first proposal costs no indexing of its
prompt (at a batch of hundreds, a Python loop over every prompt's n-grams
costs tens of milliseconds), and later ones a few microseconds.

``ngram_drafts_on_device`` makes the same proposals from tensors on the
device, for the verification rounds a step chains without the host
(executor_svc/speculative/rounds.py).
"""

from __future__ import annotations

from array import array

import torch


class NgramIndex:
    """One request's tokens, searched for the latest earlier occurrence of their last ``min_n`` to ``max_n``."""

    __slots__ = ("min_n", "max_n", "_bytes", "_length")

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._bytes = bytearray()  # token i in bytes 4i..4i+3 (native int32)
        self._length = 0  # tokens in _bytes

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` drafts that follow ``token_ids`` (which only ever grows); empty when nothing matches."""
        length = len(token_ids)
        if length > self._length:
            self._bytes += array("i", token_ids[self._length :]).tobytes()
            self._length = length
        if num_tokens <= 0:
            return []
        data = self._bytes
        limit = 4 * (length - 1)  # an earlier occurrence ends before the last token
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            suffix = data[4 * (length - n) : 4 * length]
            end = limit
            while (at := data.rfind(suffix, 0, end)) >= 0:
                if at % 4 == 0:  # token-aligned: a real occurrence
                    start = at // 4 + n
                    return token_ids[start : start + num_tokens]
                end = at + len(suffix) - 1  # a match across token boundaries: look further back
        return []


def ngram_drafts_on_device(
    tokens: torch.Tensor,  # [B, L] int64: each request's tokens, valid up to lengths[b]
    lengths: torch.Tensor,  # [B] int64
    num_drafts: int,
    min_n: int = 2,
    max_n: int = 4,
    with_counts: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # [B, num_drafts] int64 (and [B] real drafts)
    """``NgramIndex.propose`` for a batch, as tensor operations: nothing waits for the host.

    For each request, the longest suffix of ``min_n`` to ``max_n`` tokens that
    occurred earlier (ending before the last token) picks its latest occurrence,
    and the drafts are the tokens that followed it, exactly as the index
    proposes them. Where the index would propose fewer than ``num_drafts``
    (or nothing), the rest repeat the last token: the rounds that use these
    verify a fixed number of drafts, and a wrong guess costs nothing more
    (verification is lossless). ``with_counts`` also returns how many of each
    request's drafts are real guesses rather than padding.
    """
    batch, width = tokens.shape
    device = tokens.device
    last = lengths - 1
    ends = torch.arange(width, device=device)[None, :]  # where an earlier occurrence of the suffix ends
    before_last = ends < last[:, None]
    match = torch.ones((batch, width), dtype=torch.bool, device=device)
    latest: list[torch.Tensor] = []  # per n from min_n up: the latest end of an earlier match, -1 for none
    for i in range(max_n):
        # Token i from the end of the suffix must equal the token i before each candidate end.
        suffix_token = tokens.gather(1, (last - i).clamp_min(0)[:, None])
        shifted = torch.nn.functional.pad(tokens[:, : width - i], (i, 0), value=-1) if i else tokens
        match &= shifted == suffix_token
        n = i + 1
        if n >= min_n:
            found = match & before_last & (lengths[:, None] >= n)
            latest.append(torch.where(found, ends, -1).amax(dim=1))
    start = torch.full((batch,), -1, dtype=torch.int64, device=device)
    for end in reversed(latest):  # the longest n that matched
        start = torch.where((start < 0) & (end >= 0), end + 1, start)
    positions = start[:, None] + torch.arange(num_drafts, device=device)[None, :]
    valid = (start[:, None] >= 0) & (positions < lengths[:, None])
    copied = tokens.gather(1, positions.clamp(0, width - 1))
    drafts = torch.where(valid, copied, tokens.gather(1, last[:, None]))
    return (drafts, valid.sum(dim=1)) if with_counts else drafts
