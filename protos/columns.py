"""Per-request lists as the executor protocol's columns: counts plus one flat list.

``executor.proto`` sends a step's cached requests and outputs as parallel
columns; a variable-length field (new block ids, drafts, sampled tokens)
travels as every request's values back to back plus a count per request. Both
services' ``wire.py`` write them with ``write_lists`` and read them with ``split``.
"""

from __future__ import annotations

from collections.abc import MutableSequence, Sequence
from itertools import accumulate


def flatten(lists: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """(count per list, all values back to back)."""
    return [len(values) for values in lists], [value for values in lists for value in values]


def write_lists(counts: MutableSequence[int], flat: MutableSequence[int], lists: Sequence[Sequence[int]]) -> None:
    """Append ``lists`` to a message's count column and its flat column."""
    lengths, values = flatten(lists)
    counts.extend(lengths)
    flat.extend(values)


def split(flat: Sequence[int], counts: Sequence[int]) -> list[list[int]]:
    """The lists ``flatten`` made: ``counts[i]`` values of ``flat`` each, in order.

    Raises ValueError when the counts do not add up to ``len(flat)``: a malformed
    message must not hand one request another's tokens.
    """
    if not flat:  # the common generation step: no new blocks, no drafts
        if any(counts):
            raise ValueError(f"counts add up to {sum(counts)} values, but the column holds none")
        return [[] for _ in counts]
    ends = list(accumulate(counts))
    if (ends[-1] if ends else 0) != len(flat):
        raise ValueError(f"counts add up to {ends[-1] if ends else 0} values, but the column holds {len(flat)}")
    values = list(flat)
    starts = [0, *ends[:-1]]
    return [values[start:end] for start, end in zip(starts, ends)]
