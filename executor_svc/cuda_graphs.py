"""CUDA graphs for generation steps.

A generation step (every request computes one token) launches the same
kernels every time; on a fast GPU the launches, not the arithmetic, would set
the pace at small batches. So at engine load the model's forward plus the LM
head is captured once per (batch-size bucket, block-table width bucket) into
CUDA graphs that share one memory pool, and a step replays the smallest graph
that fits: its inputs are copied into static buffers, the padding rows point at
a scratch KV block that no request owns, and the logits of the real rows are
read back. Short prompt chunks ride along as one row per token
(``packed_forward.short_chunks_as_rows``), so an engine captures buckets up to
``MAX_ROWS_PER_CHUNK`` rows even when its batch size is smaller; other context steps
(and anything that does not fit a graph) run eagerly.

Every graph writes its logits into one static float32 buffer of the largest
bucket's rows. A graph's own outputs stay allocated as long as the graph does,
so per-graph logits would add up over all buckets: about 9 GB for a
128k-token vocabulary at a batch size of 1,024 and 34 GB at 2,048, against the
14 GB an H200 keeps beside the KV cache at the default ``kv_cache_fraction``.
The price is that a replay of any graph overwrites the logits of the one
before, which every caller reads (or queues its reads of) before the next
replay anyway.

Graphs are keyed by the block-table width too, because attention's work (and
the split count of the decode kernel) follows the table's width: one graph for
the longest sequence would make every short step pay for it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from plugins.attention_metadata import AttentionMetadata

log = logging.getLogger("inflight.executor")


def batch_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, then every 32 (vLLM's spacing, coarser at the top)."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(96, max_batch_size + 1, 32))
    sizes = sorted({s for s in sizes if s <= max_batch_size} | {max_batch_size})
    return sizes


def width_buckets(max_blocks_per_seq: int, smallest: int = 8) -> list[int]:
    """Block-table widths: powers of two from ``smallest`` up to (and including) the maximum."""
    widths, width = [], min(smallest, max_blocks_per_seq)
    while width < max_blocks_per_seq:
        widths.append(width)
        width *= 2
    return widths + [max_blocks_per_seq]


def _bucket(sizes: list[int], need: int) -> int | None:
    return next((s for s in sizes if s >= need), None)


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [batch_bucket, hidden], final-normed, written by each replay
    logits: torch.Tensor  # [batch_bucket, vocab] float32: a view of the buffer every graph writes


class DecodeGraphs:
    """Captured generation steps of one model; ``run`` replays the best fit."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: torch.Tensor,  # [layers, 2, num_blocks + 1, tokens_per_block, kv_heads, D]
        scratch_block: int,  # a block id no request owns: padding rows read and write only it
        max_batch_size: int,
        max_seq_len: int,
        tokens_per_block: int,
        tree_masks: bool = False,  # capture attention with per-row tree masks (draft trees verify through these graphs)
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.tokens_per_block = tokens_per_block
        self.scratch_block = scratch_block
        self.batch_sizes = batch_buckets(max_batch_size)
        self.widths = width_buckets(-(-max_seq_len // tokens_per_block))
        max_bs, device = self.batch_sizes[-1], self.device
        # Static inputs every graph reads (a graph reads the first `batch` rows).
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.context_lens = torch.ones(max_bs, dtype=torch.int64, device=device)
        # -1 (see every key) except while a step of tree drafts runs, which sets its rows and resets them after.
        self.tree_masks = torch.full((max_bs,), -1, dtype=torch.int64, device=device) if tree_masks else None
        self.block_tables = {w: torch.full((max_bs, w), scratch_block, dtype=torch.int64, device=device) for w in self.widths}
        self.rows = torch.arange(max_bs, dtype=torch.int64, device=device)
        # The logits every graph writes (see the module docstring); outside the graphs' pool.
        self.logits = torch.empty((max_bs, model.config.vocab_size), dtype=torch.float32, device=device)
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.num_replays = 0

    # -- capture ---------------------------------------------------------------

    def _metadata(self, batch: int, width: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start=list(range(batch + 1)),
            context_lens=[1] * batch,  # host copy is not read on the generation path
            block_tables=self.block_tables[width][:batch],
            context_lens_t=self.context_lens[:batch],
            slot_mapping=self.slot_mapping[:batch],
            single_query_rows=self.rows[:batch],
            single_query_tokens=self.rows[:batch],
            multi_query_rows=[],
            tree_masks=self.tree_masks[:batch] if self.tree_masks is not None else None,
        )

    def _forward(self, batch: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model(self.input_ids[:batch], self.positions[:batch], self.kv_cache, self._metadata(batch, width))
        return hidden, self.model.compute_logits(hidden, out=self.logits[:batch])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first so smaller graphs reuse the pool's memory."""
        started = time.perf_counter()
        self._reset_inputs()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for width in reversed(self.widths):
                for batch in reversed(self.batch_sizes):
                    self._forward(batch, width)  # warm-up: compiles kernels, sizes workspaces
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        hidden, logits = self._forward(batch, width)
                    self.graphs[(batch, width)] = _Graph(graph, hidden, logits)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        log.info(
            "captured %d CUDA graphs (batch %s x block-table width %s) in %.1f s",
            len(self.graphs), self.batch_sizes, self.widths, time.perf_counter() - started,
        )

    def _reset_inputs(self) -> None:
        self.input_ids.zero_()
        self.positions.zero_()
        self.slot_mapping.fill_(self.scratch_block * self.tokens_per_block)
        self.context_lens.fill_(1)
        if self.tree_masks is not None:
            self.tree_masks.fill_(-1)
        for table in self.block_tables.values():
            table.fill_(self.scratch_block)

    # -- replay ----------------------------------------------------------------

    def fits(self, num_rows: int, max_context_len: int) -> bool:
        width = -(-max_context_len // self.tokens_per_block)
        return _bucket(self.batch_sizes, num_rows) is not None and _bucket(self.widths, width) is not None

    def run(
        self,
        input_ids: list[int],  # [n] one token per row
        positions: list[int],
        slots: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],  # per row, at least ceil(context_len / tokens_per_block) ids
        patch: tuple[torch.Tensor, torch.Tensor] | None = None,  # (rows, ids on the device) overriding input_ids
    ) -> tuple[torch.Tensor, torch.Tensor]:  # logits [n, vocab] float32, hidden [n, hidden]
        """Replay the smallest graph that fits; the outputs are views into static buffers (read them before the next replay)."""
        n = len(input_ids)
        batch = _bucket(self.batch_sizes, n)
        width = _bucket(self.widths, -(-max(context_lens) // self.tokens_per_block))
        assert batch is not None and width is not None, "caller checks fits() first"
        pad = batch - n
        scratch_slot = self.scratch_block * self.tokens_per_block
        # One pinned host tensor, one copy: ids, positions, slots, lengths, then the table.
        header = torch.tensor(
            [input_ids + [0] * pad, positions + [0] * pad, slots + [scratch_slot] * pad, context_lens + [1] * pad],
            dtype=torch.int64,
        )
        table = np.full((batch, width), self.scratch_block, dtype=np.int64)
        for row, ids in enumerate(block_tables):
            used = min(len(ids), width)
            table[row, :used] = ids[:used]
        host = torch.cat([header.flatten(), torch.from_numpy(table).flatten()]).pin_memory()
        dev = host.to(self.device, non_blocking=True)
        self.input_ids[:batch].copy_(dev[0:batch])
        self.positions[:batch].copy_(dev[batch : 2 * batch])
        self.slot_mapping[:batch].copy_(dev[2 * batch : 3 * batch])
        self.context_lens[:batch].copy_(dev[3 * batch : 4 * batch])
        self.block_tables[width][:batch].copy_(dev[4 * batch :].view(batch, width))
        if patch is not None:  # tokens an earlier step sampled and the host has not seen yet
            self.input_ids.index_copy_(0, *patch)
        entry = self.graphs[(batch, width)]
        entry.graph.replay()
        self.num_replays += 1
        return entry.logits[:n], entry.hidden[:n]

    def bucket(self, num_rows: int, max_context_len: int) -> tuple[int, int]:
        """(batch, table width) of the graph that runs ``num_rows`` rows with contexts up to ``max_context_len``."""
        batch = _bucket(self.batch_sizes, num_rows)
        width = _bucket(self.widths, -(-max_context_len // self.tokens_per_block))
        assert batch is not None and width is not None, "caller checks fits() first"
        return batch, width

    def bind_tables(self, batch: int, width: int, block_tables: torch.Tensor) -> None:
        """Set the first rows' block tables ([n, >= width] int64 on the device) for replays of (batch, width),
        and point the padding rows past them at the scratch block. Replays then only need each row's token,
        position, slot and context length (``replay``)."""
        n = block_tables.shape[0]
        table = self.block_tables[width]
        used = min(block_tables.shape[1], width)
        table[:n, :used].copy_(block_tables[:, :used])
        if used < width:
            table[:n, used:].fill_(self.scratch_block)
        if batch > n:  # padding rows read and write only the scratch block
            self.input_ids[n:batch].zero_()
            self.positions[n:batch].zero_()
            self.slot_mapping[n:batch].fill_(self.scratch_block * self.tokens_per_block)
            self.context_lens[n:batch].fill_(1)
            table[n:batch].fill_(self.scratch_block)

    def replay(self, batch: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay graph (batch, width) on whatever its static inputs hold: its logits and hidden buffers."""
        entry = self.graphs[(batch, width)]
        entry.graph.replay()
        self.num_replays += 1
        return entry.logits, entry.hidden

    def run_device(
        self,
        input_ids: torch.Tensor,  # [n] int64, one token per row, on the device
        positions: torch.Tensor,  # [n] int64
        slots: torch.Tensor,  # [n] int64
        context_lens: torch.Tensor,  # [n] int64
        block_tables: torch.Tensor,  # [n, w] int64: each row's table (ids past its context are not read)
        max_context_len: int,  # a bound on context_lens, known on the host: picks the table width
    ) -> tuple[torch.Tensor, torch.Tensor]:  # logits [n, vocab] float32, hidden [n, hidden]
        """``run`` with inputs computed on the device: device-to-device copies, no host values, no wait."""
        n = input_ids.shape[0]
        batch, width = self.bucket(n, max_context_len)
        self.bind_tables(batch, width, block_tables)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(slots)
        self.context_lens[:n].copy_(context_lens)
        logits, hidden = self.replay(batch, width)
        return logits[:n], hidden[:n]

    def clear_tree_masks(self, n: int) -> None:
        """Give the first ``n`` rows plain causal attention again (after a step of tree drafts)."""
        if self.tree_masks is not None:
            self.tree_masks[:n].fill_(-1)
