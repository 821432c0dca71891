"""Packing the tokens of one step and running a model over them.

A step is a list of segments: consecutive tokens of one request, written to
its KV blocks at consecutive positions. Attention sees each segment either as
one multi-token query (a context chunk: one causal flash-attention tile set)
or as one single-token query per token, each with a context ending at its own
position. The second form is what a chain of draft tokens uses: row j of a
chain attends to the request's cache up to position start + j, which is the
causal mask of the chain, so verification runs through the same decode
attention (and the same CUDA graphs) as a plain generation step.

The same form serves short context chunks: a chunk of a few tokens after a
long cached prefix (a prefix-cache hit, a short prompt, a resumed request)
costs little more as rows than as one tile set, and as rows the whole step
can replay a CUDA graph instead of launching every layer's kernels eagerly,
which on a fast GPU is what a short step's time is made of.

The target's runner and a draft model both pack their steps here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from executor_svc.cuda_graphs import DecodeGraphs
from kvcache.layout import slot_mapping
from plugins.attention_metadata import AttentionMetadata


@dataclass(slots=True)
class Segment:
    block_table: list[int]
    start: int  # position of the first token
    count: int
    as_rows: bool  # attend as `count` single-token queries (graph-friendly) rather than one multi-token query


@dataclass(slots=True)
class PackedStep:
    """The host-side layout of a step: per token, and per attention row."""

    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    # Attention rows: a multi-token segment is one row, an `as_rows` segment one row per token.
    query_start: list[int] = field(default_factory=lambda: [0])
    context_lens: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    single_rows: list[int] = field(default_factory=list)
    multi_rows: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.positions)


# Context chunks of at most this many tokens may attend as rows (engines capture graphs of at
# least this many rows, whatever their batch size) ...
MAX_ROWS_PER_CHUNK = 256
# ... while the rows' attention reads at most this many (row, context position) pairs in all: each
# row reads its whole context, so a long chunk over a long prefix reads the cache many times over.
ROW_ATTENTION_BUDGET = 1 << 17


def short_chunks_as_rows(
    segments: list[Segment],
    fits: Callable[[int, int], bool],  # (rows, longest context) -> whether a graph replay can run them
    max_rows_per_chunk: int = MAX_ROWS_PER_CHUNK,
    budget: int = ROW_ATTENTION_BUDGET,
) -> bool:
    """Turn every multi-token segment into rows when all are short and the step then fits a graph.

    All or nothing: one chunk left as a tile set keeps the whole step eager, and
    then rows would only cost attention reads. Returns whether segments changed.
    """
    chunks = [seg for seg in segments if not seg.as_rows and seg.count > 1]
    if not chunks or max_rows_per_chunk <= 0:
        return False
    if any(seg.count > max_rows_per_chunk for seg in chunks):
        return False
    if sum(seg.count * (seg.start + seg.count) for seg in chunks) > budget:
        return False
    if not fits(sum(seg.count for seg in segments), max(seg.start + seg.count for seg in segments)):
        return False
    for seg in chunks:
        seg.as_rows = True
    return True


def pack(segments: list[Segment], tokens_per_block: int) -> PackedStep:
    packed = PackedStep()
    positions, slots, query_start = packed.positions, packed.slots, packed.query_start
    context_lens, tables, single_rows = packed.context_lens, packed.tables, packed.single_rows
    block = tokens_per_block
    for seg in segments:
        start, count, table = seg.start, seg.count, seg.block_table
        end = start + count
        positions.extend(range(start, end))
        slots.extend(slot_mapping(table, start, end, block))
        if seg.as_rows or count == 1:  # one attention row per token, each seeing up to itself
            first = len(context_lens)
            single_rows.extend(range(first, first + count))
            query_start.extend(range(query_start[-1] + 1, query_start[-1] + count + 1))
            context_lens.extend(range(start + 1, end + 1))
            tables.extend([table] * count)
        else:
            packed.multi_rows.append(len(context_lens))
            query_start.append(query_start[-1] + count)
            context_lens.append(end)
            tables.append(table)
    return packed


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host list -> device tensor; pinned and non-blocking on CUDA, so the copy never waits for queued work."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


@torch.inference_mode()
def run_packed(
    model: nn.Module,
    kv_cache: torch.Tensor,
    graphs: DecodeGraphs | None,
    packed: PackedStep,
    tokens: list[int],  # [num_tokens]
    sample_tokens: list[int],  # token indices whose logits are wanted, in order
    patch: tuple[torch.Tensor, torch.Tensor] | None = None,  # (token indices, ids on the device) overriding `tokens`
    want_hidden: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # logits [len(sample_tokens), vocab] float32, hidden of those rows
    """One forward over a packed step: a CUDA-graph replay when every row is a single query and a graph fits."""
    device = kv_cache.device
    if graphs is not None and not packed.multi_rows and graphs.fits(packed.num_tokens, max(packed.context_lens)):
        logits, hidden = graphs.run(tokens, packed.positions, packed.slots, packed.context_lens, packed.tables, patch)
        if sample_tokens != list(range(packed.num_tokens)):  # a subset, or another order
            rows = to_device(sample_tokens, torch.int64, device)
            logits = logits.index_select(0, rows)
            hidden = hidden.index_select(0, rows) if want_hidden else None
        return logits, (hidden if want_hidden else None)
    max_blocks = max(len(t) for t in packed.tables)
    tables = [t + [0] * (max_blocks - len(t)) for t in packed.tables]
    meta = AttentionMetadata(
        query_start=packed.query_start,
        context_lens=packed.context_lens,
        block_tables=to_device(tables, torch.int64, device),
        context_lens_t=to_device(packed.context_lens, torch.int64, device),
        slot_mapping=to_device(packed.slots, torch.int64, device),
        single_query_rows=to_device(packed.single_rows, torch.int64, device),
        single_query_tokens=to_device([packed.query_start[r] for r in packed.single_rows], torch.int64, device),
        multi_query_rows=packed.multi_rows,
    )
    input_ids = to_device(tokens, torch.int64, device)
    if patch is not None:
        input_ids.index_copy_(0, *patch)
    hidden = model(input_ids, to_device(packed.positions, torch.int64, device), kv_cache, meta)
    hidden = hidden.index_select(0, to_device(sample_tokens, torch.int64, device))
    return model.compute_logits(hidden), (hidden if want_hidden else None)
