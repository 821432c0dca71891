"""Chained verification rounds of tree drafts, on the device.

The tree counterpart of ``rounds.py``'s chains (see ``draft_tree.py`` for how
one round of a tree runs through the decode attention). Each round:

1. the decode graph replays the rows (the root and the tree's nodes of every
   request), with each row's tree mask;
2. everything after it runs as tensor operations: the target's argmax, the
   verdict (``tree_verdict``; ``tree_verdict_sampled`` for requests that
   sample), the move of the accepted path's keys and
   values to chain slots (``move_accepted_kv``), each request's new length and
   last token, the heads growing the next tree from the hidden state of the
   accepted node, and the next round's rows written into the decode graph's
   inputs.

On a GPU, step 2 is itself a CUDA graph, captured the first time a (request
bucket, depth, table width) is used, so a round is two graph replays and two
copies, whatever the tree's size: as eager launches, step 2 is over a hundred
small kernels, and the host, not the GPU, would set the pace. Step 2's Triton
kernels compile at engine load (``warm_up``); a capture on first use costs
about 0.1 s on the H200 (two graphs, each run once before it is captured). A
step with a request that samples runs step 2 eagerly: each such request draws
from its own generator, which a captured graph cannot hold.

A step's first round verifies the plan's drafts (the heads' chain from the
last step) on the tree's best-guess path; its other nodes repeat the last
token and are simply rejected.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from executor_svc.cuda_graphs import DecodeGraphs
from executor_svc.packed_forward import to_device
from executor_svc.sampler import RequestSamplingState
from executor_svc.speculative.draft_tree import (
    DraftTree, TreeTensors, move_accepted_kv, tree_round_inputs, tree_verdict, tree_verdict_sampled,
)
from kvcache.layout import scratch_block
from plugins.attention_metadata import AttentionMetadata


@dataclass(slots=True)
class _TreeState:
    """The device state of a step's requests (padded to a bucket on the graphed path)."""

    lens: torch.Tensor  # [B] tokens held; the last is not in the cache yet
    last: torch.Tensor  # [B] each request's last token (the next round's root)
    tables: torch.Tensor  # [B, width] block tables
    tokens: torch.Tensor  # [B, 1 + k] the latest round's emitted tokens (its accepted path, then the target's)
    accepted: torch.Tensor  # [B] the latest round's accepted drafts
    live: torch.Tensor  # [B] 1 for a real request, 0 for padding (which stays at length 1, in its first block)


@dataclass(slots=True)
class _Sampled:
    """The requests of a step that sample rather than take the target's argmax."""

    rows: torch.Tensor  # [S] their positions in the step, on the device
    states: list[RequestSamplingState]  # [S]

    @classmethod
    def of(cls, requests: Sequence, device: torch.device) -> _Sampled | None:
        picked = [(i, r.sampling) for i, r in enumerate(requests) if not r.sampling.config.is_greedy]
        if not picked:
            return None
        return cls(to_device([i for i, _ in picked], torch.int64, device), [state for _, state in picked])


@dataclass(slots=True)
class _Captured:
    state: _TreeState
    draft: torch.cuda.CUDAGraph  # after a round: judge it and grow the next round's tree
    last: torch.cuda.CUDAGraph  # after a step's last round: judge it only


class TreeRounds:
    """Runs steps of chained tree rounds for one engine (``RoundsRunner`` hands them over)."""

    def __init__(
        self, model: nn.Module, kv_cache: torch.Tensor, graphs: DecodeGraphs | None, tokens_per_block: int, chain,
        tree: DraftTree,
    ) -> None:  # chain: heads_proposer.HeadsChain, whose heads grow the trees from its buffers
        self.model, self.kv_cache, self.graphs = model, kv_cache, graphs
        self.tokens_per_block, self.chain, self.tree = tokens_per_block, chain, tree
        self._tensors: dict[int, TreeTensors] = {}
        self.buckets = chain.buckets
        self._captured: dict[tuple[int, int, int], _Captured] = {}
        self._pool = None
        self._last_hidden: torch.Tensor | None = None  # the last round's hidden rows, for the next step's chain

    def tree_tensors(self, k: int) -> TreeTensors:
        """The tree's index tensors for draft length ``k`` (built once)."""
        if k not in self._tensors:
            self._tensors[k] = TreeTensors(self.tree, k, self.kv_cache.device)
        return self._tensors[k]

    # -- one round's work after the forward ---------------------------------------------------

    def _judge(
        self, s: _TreeState, t: TreeTensors, ids: torch.Tensor, logits: torch.Tensor, sampled: _Sampled | None = None,
    ) -> None:
        """Verdict of a round whose rows ``ids`` [B, 1 + n] gave ``logits``: moves the accepted KV, advances
        ``s`` and points the heads at each accepted node's row. ``sampled``: the requests that sample."""
        batch, rows_per = ids.shape
        logits = logits[: batch * rows_per]
        target = logits.argmax(dim=-1).view(batch, rows_per)
        tokens, accepted, best = tree_verdict(ids, target, t)
        if sampled is not None:  # their verdict replaces the greedy one
            rows = sampled.rows
            rows_logits = logits.view(batch, rows_per, -1).index_select(0, rows)
            verdict = tree_verdict_sampled(ids.index_select(0, rows), rows_logits, t, sampled.states)
            for whole, part in zip((tokens, accepted, best), verdict):
                whole.index_copy_(0, rows, part)
        move_accepted_kv(self.kv_cache, s.lens, best, accepted, s.tables, t, self.tokens_per_block)
        s.tokens.copy_(tokens)
        s.accepted.copy_(accepted)
        s.lens.add_((accepted + 1) * s.live)
        s.last.copy_(tokens.gather(1, accepted[:, None]).squeeze(1))
        self.chain.hidden_rows[:batch].copy_(torch.arange(batch, device=ids.device) * rows_per + best)
        self.chain.last_tokens[:batch].copy_(s.last)

    def _grow(self, hidden: torch.Tensor, batch: int, t: TreeTensors) -> torch.Tensor:
        """The next round's tree [batch, n] from the hidden rows ``_judge`` chose (no graph of its own)."""
        chain = self.chain
        torch.index_select(hidden, 0, chain.hidden_rows[:batch], out=chain.hidden[:batch])
        return chain.heads.propose_tree(chain.hidden[:batch], chain.model, t, chain.last_tokens[:batch])

    def _write_rows(self, s: _TreeState, t: TreeTensors, nodes: torch.Tensor) -> None:
        """The round's rows into the decode graph's static inputs."""
        g = self.graphs
        ids, positions, slots, context, masks = tree_round_inputs(s.last, s.lens, nodes, s.tables, t, self.tokens_per_block)
        n = ids.numel()
        g.input_ids[:n].copy_(ids.flatten())
        g.positions[:n].copy_(positions.flatten())
        g.slot_mapping[:n].copy_(slots.flatten())
        g.context_lens[:n].copy_(context.flatten())
        g.tree_masks[:n].copy_(masks.flatten())

    @torch.inference_mode()
    def warm_up(self, draft_lengths: Sequence[int]) -> None:
        """Run a round's work after the forward once per tree depth over padding state (one request on the
        scratch block): Triton compiles its kernels at engine load, not in a first step (GPU only)."""
        graphs = self.graphs
        if graphs is None or graphs.tree_masks is None:
            return
        width = graphs.widths[0]
        for k in draft_lengths:
            if not 1 <= k <= self.tree.depth:
                continue
            t = self.tree_tensors(k)
            rows = 1 + t.num_nodes
            if not graphs.fits(rows, 1):
                continue
            state = self._state([], width, 1, k)
            forward = graphs.graphs[graphs.bucket(rows, 1)]
            self._write_rows(state, t, state.last[:, None].expand(1, t.num_nodes))
            self._judge(state, t, graphs.input_ids[:rows].view(1, rows), forward.logits)
            self._grow(forward.hidden, 1, t)
            graphs.clear_tree_masks(rows)

    # -- steps --------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, requests: Sequence, k: int, num_rounds: int, next_k: int, stops=None):  # -> rounds.RoundsOutput
        """``num_rounds`` rounds of trees of depth ``k`` (fewer when ``stops``, a ``round_stops.RoundStops``, ends
        them), then ``next_k`` chained drafts per request for the next step unless they ended early."""
        from executor_svc.speculative.rounds import RoundsOutput

        t = self.tree_tensors(k)
        rows_per = 1 + t.num_nodes
        device = self.kv_cache.device
        batch = len(requests)
        # The furthest slot the rounds write: each round but the last moves on by at most 1 + k.
        max_context = max(len(r.token_ids) for r in requests) - 1 + (num_rounds - 1) * (k + 1) + rows_per
        graphs = self.graphs
        bucket = None
        if graphs is not None and graphs.tree_masks is not None and graphs.fits(batch * rows_per, max_context):
            # The smallest request bucket whose rows fit a decode graph; else exactly this many requests.
            fitting = (b for b in self.buckets if b >= batch and graphs.fits(b * rows_per, max_context))
            bucket = next(fitting, batch)
        graphed = bucket is not None
        out = RoundsOutput.empty(num_rounds, requests, k, device)
        sampled = _Sampled.of(requests, device)
        if graphed:
            self._run_graphed(requests, t, num_rounds, bucket, graphs.bucket(bucket * rows_per, max_context), out,
                              sampled, stops)
        else:
            self._run_eager(requests, t, num_rounds, out, sampled, stops)
        out.end_early(stops)
        if next_k and not out.finished_early:  # the chain the plan brings back for the next step's first round
            hidden = self._last_hidden
            out.next_drafts = self.chain.draft(hidden, batch, next_k).clone()
        self._last_hidden = None
        return out

    def _first_nodes(self, requests: Sequence, t: TreeTensors, last: torch.Tensor, padded: int) -> torch.Tensor:
        """The first round's tree: the plan's drafts on the best-guess path, the last token elsewhere."""
        k = t.k
        drafts = [r.drafts[:k] + [r.token_ids[-1]] * (k - len(r.drafts[:k])) for r in requests]
        drafts += [[0] * k] * (padded - len(requests))
        nodes = last[:, None].expand(padded, t.num_nodes).clone()
        best_path = t.paths[t.levels[-1][:1]].squeeze(0)  # node per depth of (0, 0, ..., 0); no host read
        nodes.index_copy_(1, best_path - 1, to_device(drafts, torch.int64, last.device))
        return nodes

    def _state(self, requests: Sequence, width: int, padded: int, k: int) -> _TreeState:
        """The step's requests as device tensors, padded with requests that read and write only the scratch
        block."""
        device = self.kv_cache.device
        scratch = scratch_block(self.kv_cache)
        extra = padded - len(requests)
        tables = [(r.block_table + [scratch] * width)[:width] for r in requests] + [[scratch] * width] * extra
        return _TreeState(
            lens=to_device([len(r.token_ids) for r in requests] + [1] * extra, torch.int64, device),
            last=to_device([r.token_ids[-1] for r in requests] + [0] * extra, torch.int64, device),
            tables=to_device(tables, torch.int64, device),
            tokens=torch.zeros((padded, k + 1), dtype=torch.int64, device=device),
            accepted=torch.zeros(padded, dtype=torch.int64, device=device),
            live=to_device([1] * len(requests) + [0] * extra, torch.int64, device),
        )

    def _run_eager(
        self, requests: Sequence, t: TreeTensors, num_rounds: int, out, sampled: _Sampled | None, stops=None,
    ) -> None:
        """Every round through the eager forward (no GPU, or rows past the CUDA graphs)."""
        batch, rows_per = len(requests), 1 + t.num_nodes
        width = max(len(r.block_table) for r in requests)
        s = self._state(requests, width, batch, t.k)
        row_tables = s.tables.repeat_interleave(rows_per, dim=0)
        nodes = self._first_nodes(requests, t, s.last, batch)
        for rnd in range(num_rounds):
            ids, positions, slots, context, masks = tree_round_inputs(s.last, s.lens, nodes, s.tables, t,
                                                                      self.tokens_per_block)
            logits, hidden = _tree_forward(self.model, self.kv_cache, ids, positions, slots, context, masks, row_tables)
            self._judge(s, t, ids, logits, sampled)
            out.tokens[rnd], out.accepted[rnd] = s.tokens, s.accepted
            if stops is not None and stops.after_round(rnd, out.tokens, out.accepted):
                break
            if rnd + 1 == num_rounds or (stops is not None and stops.asked_to_end(rnd)):
                break
            nodes = self._grow(hidden, batch, t)
            out.drafted[rnd + 1] = t.k
        self._last_hidden = hidden

    def _run_graphed(
        self, requests: Sequence, t: TreeTensors, num_rounds: int, bucket: int, forward: tuple[int, int], out,
        sampled: _Sampled | None, stops=None,
    ) -> None:
        graphs, batch, rows_per = self.graphs, len(requests), 1 + t.num_nodes
        rows_bucket, width = forward
        fresh = self._state(requests, width, bucket, t.k)
        captured = None
        if sampled is None:  # the work after each forward replays from graphs (see the module docstring)
            captured = self._capture(bucket, t, rows_bucket, width)
            s = captured.state
            s.lens.copy_(fresh.lens)
            s.last.copy_(fresh.last)
            s.tables.copy_(fresh.tables)
            s.live.copy_(fresh.live)
        else:
            s = fresh
        graphs.bind_tables(rows_bucket, width, s.tables.repeat_interleave(rows_per, dim=0))
        self._write_rows(s, t, self._first_nodes(requests, t, s.last, bucket))
        entry = graphs.graphs[(rows_bucket, width)]
        ids = graphs.input_ids[: bucket * rows_per].view(bucket, rows_per)
        # The round that ends the step: after a round's forward its judge and the next round's tree are one
        # graph, so a request to end the rounds (``stops.asked_to_end``) takes effect a round later.
        final = num_rounds - 1
        for rnd in range(num_rounds):
            graphs.replay(rows_bucket, width)
            if captured is not None:
                (captured.draft if rnd < final else captured.last).replay()
            else:  # the same work as the captured graphs, run eagerly
                self._judge(s, t, ids, entry.logits, sampled)
                if rnd < final:
                    self._write_rows(s, t, self._grow(entry.hidden, bucket, t))
            out.tokens[rnd].copy_(s.tokens[:batch])
            out.accepted[rnd].copy_(s.accepted[:batch])
            if rnd == final:
                break
            out.drafted[rnd + 1] = t.k
            if stops is not None:
                if stops.after_round(rnd, out.tokens, out.accepted):
                    break
                if stops.asked_to_end(rnd + 1):
                    final = rnd + 1
        graphs.clear_tree_masks(rows_bucket)
        self._last_hidden = graphs.graphs[(rows_bucket, width)].hidden

    def _capture(self, bucket: int, t: TreeTensors, rows_bucket: int, width: int) -> _Captured:
        """The graphs of the work after a round's forward for (bucket, depth, width), captured on first use
        over padding state (every request on the scratch block), which the step then overwrites."""
        key = (bucket, t.k, width)
        if key in self._captured:
            return self._captured[key]
        graphs, device = self.graphs, self.kv_cache.device
        state = self._state([], width, bucket, t.k)  # all padding
        forward = graphs.graphs[(rows_bucket, width)]
        rows = bucket * (1 + t.num_nodes)
        ids = graphs.input_ids[:rows].view(bucket, 1 + t.num_nodes)

        def after(draft: bool) -> None:
            self._judge(state, t, ids, forward.logits)
            if draft:
                self._write_rows(state, t, self._grow(forward.hidden, bucket, t))

        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        saved = (state.lens.clone(), state.last.clone())
        made = []
        with torch.cuda.stream(stream):
            for draft in (True, False):
                after(draft)  # warm-up on padding state: compiles kernels, touches only the scratch block
                state.lens.copy_(saved[0])
                state.last.copy_(saved[1])
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool, stream=stream):
                    after(draft)
                made.append(graph)
        torch.cuda.current_stream(device).wait_stream(stream)
        graphs.clear_tree_masks(rows)
        self._captured[key] = _Captured(state, *made)
        return self._captured[key]


def _tree_forward(
    model: nn.Module, kv_cache: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
    context: torch.Tensor, masks: torch.Tensor, row_tables: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # logits [rows, vocab] float32, hidden [rows, hidden]
    """One round of tree rows run eagerly (no graph fits, or no GPU); every row is a single-token query."""
    rows = ids.numel()
    index = torch.arange(rows, dtype=torch.int64, device=ids.device)
    meta = AttentionMetadata(
        query_start=list(range(rows + 1)),
        context_lens=[1] * rows,  # the host copy is not read for single-token queries
        block_tables=row_tables,
        context_lens_t=context.flatten(),
        slot_mapping=slots.flatten(),
        single_query_rows=index,
        single_query_tokens=index,
        multi_query_rows=[],
        tree_masks=masks.flatten(),
    )
    hidden = model(ids.flatten(), positions.flatten(), kv_cache, meta)
    return model.compute_logits(hidden), hidden

