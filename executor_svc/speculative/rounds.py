"""Several verification rounds in one step, drafted on the device.

A speculative step needs its result before the next one can be planned: the
next drafts follow from the tokens this one accepts. At the small batches
where speculation pays, that round trip (the sampled ids to the host, the
scheduler's next plan, the next launch) costs about as much as the step
itself, so a step that verifies k drafts takes twice the time of a plain step
that overlaps with its successor.

With prompt lookup the next drafts are a lookup in the request's own tokens,
and with draft heads a function of the hidden state of the row that chose the
newest token: the device can make either as well as the host. So a step may
run R rounds back to back: round r verifies k drafts per request (the first
round the drafts the plan brought, each later round drafts looked up by
``ngram_drafts_on_device`` or made by the heads, ``HeadsChain``); what it
accepts is appended to a device copy of each request's tokens, and the next
round's positions and KV slots follow from the accepted counts, all as tensor
operations. The host queues every round at once, then reads all rounds'
tokens with the step's one copy back. With heads, the drafts for the next
step's first round come back with that copy too (``RoundsOutput.next_drafts``).

Every request of such a step verifies the same k drafts in each round (the
plan's drafts are padded to k with the last token; a wrong guess is simply
rejected), so each round is one graph replay of B * (k + 1) rows. The
scheduler reserves KV slots for R * (1 + k) tokens per request, the most the
rounds can write, and takes back what they did not use when the result
arrives. Rounds may run past a request's length limit (the step then ends
once every request reached it, ``round_stops.py``): the slots past what the
request may hold are the scratch block's, and the tokens there are dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from executor_svc.cuda_graphs import DecodeGraphs
from executor_svc.packed_forward import Segment, pack, run_packed, to_device
from executor_svc.sampler import RequestSamplingState
from executor_svc.speculative.draft_tree import DraftTree
from executor_svc.speculative.heads_proposer import HeadsChain
from executor_svc.speculative.ngram import ngram_drafts_on_device
from executor_svc.speculative.round_stops import RoundStops
from executor_svc.speculative.tree_rounds import TreeRounds
from executor_svc.speculative.verify import NO_DRAFT, verify_drafts
from kvcache.layout import device_slots, scratch_block
from plugins.argmax_torch import row_argmax
from protos.plan import SamplingConfig


@dataclass(slots=True)
class RoundsRequest:
    """One request's part in a step of chained rounds."""

    token_ids: list[int]  # every token it holds; the last one is not in the KV cache yet
    # Covers len(token_ids) - 1 + (rounds - 1) * (1 + num_drafts) + one round's rows positions; past the
    # request's length limit with the scratch block (rows there emit nothing that is kept).
    block_table: list[int]
    drafts: list[int]  # the first round's drafts (at most num_drafts)
    sampling: RequestSamplingState
    # What finishes it (ids it stops at, the length it may reach; 0 = none): lets the rounds end early.
    stop_token_ids: Sequence[int] = ()
    max_num_tokens: int = 0


@dataclass(slots=True)
class RoundsOutput:
    """Every round's verification rows, on the device until the step's copy back."""

    tokens: torch.Tensor  # [rounds, B, 1 + k] int64: what each row emits if its chain gets that far
    accepted: torch.Tensor  # [rounds, B] int64: drafts accepted per round (the round emits accepted + 1)
    # [rounds + 1, B] int64: of each round's k drafts, how many were real guesses rather than padding
    # (row 0: the plan's; the last row is the lookup after the last round, unused).
    drafted: torch.Tensor
    next_drafts: torch.Tensor | None = None  # [B, k'] the heads' drafts after the last round, for the next step
    finished_early: bool = False  # every request finished before the planned rounds: fewer ran

    @property
    def num_rounds(self) -> int:
        """Rounds that ran."""
        return self.tokens.shape[0]

    def end_early(self, stops: RoundStops | None) -> None:
        """Keep only the rounds that ran, when ``stops`` ended them before the planned count."""
        ran = stops.rounds_run if stops is not None else None
        if ran is None or ran >= self.num_rounds:
            return
        self.tokens, self.accepted, self.drafted = self.tokens[:ran], self.accepted[:ran], self.drafted[: ran + 1]
        self.finished_early = not stops.ended_on_request

    @classmethod
    def empty(cls, num_rounds: int, requests: Sequence[RoundsRequest], k: int, device: torch.device) -> RoundsOutput:
        drafted = torch.empty((num_rounds + 1, len(requests)), dtype=torch.int64, device=device)
        drafted[0].copy_(to_device([min(len(r.drafts), k) for r in requests], torch.int64, device))
        return cls(
            tokens=torch.empty((num_rounds, len(requests), k + 1), dtype=torch.int64, device=device),
            accepted=torch.empty((num_rounds, len(requests)), dtype=torch.int64, device=device),
            drafted=drafted,
        )


def prefer_lookup(
    lookup: torch.Tensor, counts: torch.Tensor, heads: torch.Tensor, last_tokens: torch.Tensor, width: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # [B, width] int64 drafts, [B] int64 real guesses
    """Draft heads with prompt lookup (``SpeculativeConfig.heads_lookup``): each request's lookup drafts
    (``lookup`` [B, kl], of which ``counts`` [B] are real guesses) where its lookup found a match, else the heads'
    drafts (``heads`` [B, kh]); either padded with its last token (``last_tokens`` [B]) to ``width``."""
    batch = lookup.shape[0]

    def padded(drafts: torch.Tensor) -> torch.Tensor:
        drafts = drafts[:, :width]
        if drafts.shape[1] == width:
            return drafts
        return torch.cat([drafts, last_tokens[:, None].expand(batch, width - drafts.shape[1])], dim=1)

    use = counts > 0
    drafts = torch.where(use[:, None], padded(lookup), padded(heads))
    return drafts, torch.where(use, counts.clamp(max=width), min(heads.shape[1], width))


def _round_inputs(
    history: torch.Tensor, lens: torch.Tensor, drafts: torch.Tensor, tables: torch.Tensor, tokens_per_block: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # ids, positions, slots: [B, 1 + k] each
    """A round's rows: each request's last token (at position lens - 1, not in the cache yet), then its drafts."""
    offsets = torch.arange(drafts.shape[1] + 1, device=lens.device)
    positions = (lens - 1)[:, None] + offsets
    ids = torch.cat([history.gather(1, (lens - 1)[:, None]), drafts], dim=1)
    slots = device_slots(tables, positions, tokens_per_block)
    return ids, positions, slots


def _accept(
    row_tokens: torch.Tensor, row_accepted: torch.Tensor, history: torch.Tensor, lens: torch.Tensor,
) -> torch.Tensor:  # [B] drafts accepted
    """Apply a round's verdict ([B, 1 + k] each): append what it emits to ``history``, advance ``lens`` (in place)."""
    k = row_tokens.shape[1] - 1
    accepted = row_accepted[:, :k].to(torch.int64).cumprod(dim=1).sum(dim=1)
    # Rows past the accepted prefix land past the new length: ignored, and overwritten by the next round.
    offsets = torch.arange(k + 1, device=lens.device)
    history.scatter_(1, lens[:, None] + offsets, row_tokens)
    lens.add_(accepted + 1)
    return accepted


class RoundsRunner:
    """Runs steps of chained rounds for one engine.

    Greedy steps whose rows fit a CUDA graph run each round as four launches:
    ``round_inputs`` (rounds_triton.py) writes the rows into the decode
    graph's static buffers, the graph replays, an argmax picks the target's
    tokens, and ``round_verdict`` judges the drafts, extends each request's
    history and looks up the next round's drafts. Everything else (sampled
    requests, no GPU, rows past the graphs) runs the same steps as torch
    operations, which are also the kernels' reference.
    """

    def __init__(
        self, model: nn.Module, kv_cache: torch.Tensor, graphs: DecodeGraphs | None, tokens_per_block: int,
        ngram_sizes: tuple[int, int],  # (min_n, max_n) of the lookup that drafts rounds 2..R
        chain: HeadsChain | None = None,  # draft heads draft rounds 2..R (and the next step) instead
        tree: DraftTree | None = None,  # with heads: steps verify trees of this shape
        end_early: bool = True,  # stop a step's rounds once every request has finished (round_stops.py)
        # With heads: where the lookup of ``ngram_sizes`` finds a match, its drafts replace the heads' (prefer_lookup).
        heads_lookup: bool = False,
        argmax: Callable[[torch.Tensor], torch.Tensor] = row_argmax,  # greedy verification's (the engine's choice)
    ) -> None:
        if heads_lookup and chain is None:
            raise ValueError("heads_lookup weighs the lookup against draft heads: it needs their chain")
        self.model, self.kv_cache, self.graphs, self.end_early = model, kv_cache, graphs, end_early
        self.tokens_per_block, self.ngram_sizes, self.chain = tokens_per_block, ngram_sizes, chain
        self.heads_lookup, self.argmax = heads_lookup, argmax
        # With a draft tree, steps verify trees (``tree_rounds.py``).
        self.trees = (
            TreeRounds(model, kv_cache, graphs, tokens_per_block, chain, tree)
            if chain is not None and tree is not None else None
        )

    @torch.inference_mode()
    def warm_up(self, draft_lengths: Sequence[int]) -> None:
        """Compile the round kernels for each draft length and run a step of them now (engine load) rather than
        at a first step."""
        if self.graphs is None:
            return
        from executor_svc.speculative.rounds_triton import round_finished, round_inputs, round_verdict

        device = self.kv_cache.device
        if self.chain is not None:  # with the lookup, a round may verify more drafts than the heads make
            self.chain.capture(sorted({min(k, self.chain.max_drafts) for k in draft_lengths}))
        if self.trees is not None:
            self.trees.warm_up(draft_lengths)
        for k in draft_lengths:
            history = torch.zeros((1, 2 * k + 4), dtype=torch.int64, device=device)
            lens = torch.ones(1, dtype=torch.int64, device=device)
            drafts = torch.zeros((1, k), dtype=torch.int64, device=device)
            rows = [torch.zeros(k + 1, dtype=torch.int64, device=device) for _ in range(4)]
            round_inputs(history, lens, drafts, torch.zeros((1, k + 1), dtype=torch.int64, device=device),
                         self.tokens_per_block, *rows)
            round_verdict(rows[0], history, lens, drafts, torch.zeros((1, 1, k + 1), dtype=torch.int64, device=device),
                          torch.zeros((1, 1), dtype=torch.int64, device=device),
                          torch.zeros((2, 1), dtype=torch.int64, device=device), 0, *self.ngram_sizes,
                          self._heads_inputs(), self._looks_up)
            one = torch.ones(1, dtype=torch.int64, device=device)
            round_finished(rows[0].view(1, 1, k + 1), one.view(1, 1), 0, one.view(1, 1), one, torch.zeros_like(one),
                           torch.zeros(1, dtype=torch.int32, device=device))
        # Then a whole step of two rounds per draft length, on a request that owns nothing but the scratch block:
        # the first chained step of a process otherwise paid for what only a real step touches (the torch
        # operations around the kernels, their first use on the device): 14.7 ms for two rounds instead of 1.7 on
        # an H100 (bench/results/h100_spec_heads_arrivals{_before,}_smollm2.json).
        greedy = RequestSamplingState(SamplingConfig(temperature=0.0), [], device)
        history = [(7 * i + 3) % 50 for i in range(8)] * 2  # repeats itself: the lookup finds drafts
        for k in draft_lengths:
            if self.graphs.fits(self.round_rows(k), len(history) + 2 * self.round_rows(k)):
                dummy = RoundsRequest(history, [], history[-k:], greedy, stop_token_ids=(0,))
                self.run([dummy], k, 2, next_drafts=k, end_requested=lambda: False)
        torch.cuda.synchronize(device)

    def _heads_inputs(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.chain is None else (self.chain.last_tokens, self.chain.hidden_rows)

    @property
    def _looks_up(self) -> bool:
        """Whether rounds look the next drafts up in the requests' tokens (prompt lookup, or heads with lookup)."""
        return self.chain is None or self.heads_lookup

    @torch.inference_mode()
    def run(
        self, requests: Sequence[RoundsRequest], num_drafts: int, num_rounds: int, next_drafts: int = 0,
        end_requested: Callable[[], bool] | None = None,
    ) -> RoundsOutput:
        """Queue ``num_rounds`` rounds of verifying ``num_drafts`` drafts for every request; with heads, and
        ``next_drafts`` > 0, also that many drafts per request for the next step. Fewer rounds run when every
        request finishes before the last (``round_stops.py``), and then nothing is drafted for a next step; or
        when ``end_requested``, asked between rounds, says the scheduler wants the step to end (the last round
        that runs then drafts for the next step)."""
        stops = RoundStops.of(requests, num_rounds, self.kv_cache.device, self.end_early, end_requested)
        if self.uses_tree(num_drafts):
            return self.trees.run(requests, num_drafts, num_rounds, next_drafts, stops)
        rows = len(requests) * (num_drafts + 1)
        max_context = max(len(r.token_ids) for r in requests) - 1 + num_rounds * (num_drafts + 1)
        graphs = self.graphs
        if (
            graphs is not None and graphs.fits(rows, max_context)
            and all(r.sampling.config.is_greedy for r in requests)
        ):
            out = self._run_fused(requests, num_drafts, num_rounds, next_drafts, stops, *graphs.bucket(rows, max_context))
        else:
            out = self._run_eager(requests, num_drafts, num_rounds, next_drafts, stops, max_context)
        out.end_early(stops)
        return out

    def uses_tree(self, num_drafts: int) -> bool:
        """Whether a step of ``num_drafts`` per round runs tree drafts: the heads draft a tree that deep
        (greedy and sampled requests alike: ``draft_tree.tree_verdict_sampled`` keeps sampling lossless)."""
        tree = self.trees.tree if self.trees is not None else None
        return tree is not None and 1 <= num_drafts <= tree.depth

    def round_rows(self, num_drafts: int) -> int:
        """Rows per request of one round: its last token and its drafts (a chain's k, or a tree's nodes)."""
        tree = self.trees.tree if self.trees is not None else None
        if tree is not None and 1 <= num_drafts <= tree.depth:
            return 1 + tree.nodes_within(num_drafts)
        return 1 + num_drafts

    def _initial(
        self, requests: Sequence[RoundsRequest], k: int, num_rounds: int, table_width: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # history, lens, drafts, tables
        """The rounds' state on the device: each request's tokens (with room for every round's rows past the
        longest), their lengths, the first round's drafts (padded to k) and the block tables."""
        device = self.kv_cache.device
        history_width = max(len(r.token_ids) for r in requests) + num_rounds * (k + 1) + 1
        history = torch.full((len(requests), history_width), -1, dtype=torch.int64)
        for i, r in enumerate(requests):
            history[i, : len(r.token_ids)] = torch.tensor(r.token_ids, dtype=torch.int64)
        history = history.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else history
        lens = to_device([len(r.token_ids) for r in requests], torch.int64, device)
        drafts = to_device([r.drafts[:k] + [r.token_ids[-1]] * (k - len(r.drafts[:k])) for r in requests], torch.int64, device)
        scratch = scratch_block(self.kv_cache)
        tables = to_device(
            [(r.block_table + [scratch] * table_width)[:table_width] for r in requests], torch.int64, device,
        )
        return history, lens, drafts, tables

    def _run_eager(
        self, requests: Sequence[RoundsRequest], k: int, num_rounds: int, next_k: int, stops: RoundStops | None,
        max_context: int,
    ) -> RoundsOutput:
        device = self.kv_cache.device
        batch, rows_per_request = len(requests), k + 1
        history, lens, drafts, tables = self._initial(requests, k, num_rounds, max(len(r.block_table) for r in requests))
        row_states = [r.sampling for r in requests for _ in range(rows_per_request)]
        row_tables = tables.repeat_interleave(rows_per_request, dim=0)
        no_draft = torch.full((batch, 1), NO_DRAFT, dtype=torch.int64, device=device)
        graphs = self.graphs
        use_graph = graphs is not None and graphs.fits(batch * rows_per_request, max_context)
        out = RoundsOutput.empty(num_rounds, requests, k, device)
        for rnd in range(num_rounds):
            ids, positions, slots = _round_inputs(history, lens, drafts, tables, self.tokens_per_block)
            if use_graph:
                logits, hidden = graphs.run_device(
                    ids.flatten(), positions.flatten(), slots.flatten(), (positions + 1).flatten(), row_tables, max_context,
                )
            else:
                logits, hidden = _eager_round(self.model, self.kv_cache, graphs, self.tokens_per_block, requests,
                                              positions, ids, want_hidden=self.chain is not None)
            row_tokens, row_accepted = verify_drafts(logits, torch.cat([drafts, no_draft], dim=1).flatten(), row_states,
                                                     self.argmax)
            row_tokens = row_tokens.view(batch, rows_per_request)
            out.tokens[rnd] = row_tokens
            accepted = _accept(row_tokens, row_accepted.view(batch, rows_per_request), history, lens)
            out.accepted[rnd] = accepted
            if stops is not None and stops.after_round(rnd, out.tokens, out.accepted):
                break
            last = rnd + 1 == num_rounds or (stops is not None and stops.asked_to_end(rnd))
            if self.chain is not None:  # what round_verdict writes for the heads, then their drafts
                self.chain.hidden_rows[:batch] = torch.arange(batch, device=device) * rows_per_request + accepted
                self.chain.last_tokens[:batch] = row_tokens.gather(1, accepted[:, None]).squeeze(1)
                lookup = None
                if self.heads_lookup and (not last or next_k):  # drafts are wanted after this round
                    lookup = ngram_drafts_on_device(history, lens, k, *self.ngram_sizes, with_counts=True)
                drafts = self._heads_draft(out, hidden, rnd, rnd + 1 if last else num_rounds, k, next_k, batch, lookup)
                if lookup is None and not last:
                    out.drafted[rnd + 1] = k  # what the verdict kernel writes for the heads
            elif not last:
                drafts, out.drafted[rnd + 1] = ngram_drafts_on_device(history, lens, k, *self.ngram_sizes, with_counts=True)
            if last:
                break
        return out

    def _run_fused(
        self, requests: Sequence[RoundsRequest], k: int, num_rounds: int, next_k: int, stops: RoundStops | None,
        batch: int, width: int,
    ) -> RoundsOutput:
        from executor_svc.speculative.rounds_triton import round_inputs, round_verdict

        graphs, device = self.graphs, self.kv_cache.device
        num_requests, rows = len(requests), len(requests) * (k + 1)
        history, lens, drafts, tables = self._initial(requests, k, num_rounds, width)
        graphs.bind_tables(batch, width, tables.repeat_interleave(k + 1, dim=0))
        target = torch.empty(rows, dtype=torch.int64, device=device)
        out = RoundsOutput.empty(num_rounds, requests, k, device)
        for rnd in range(num_rounds):
            round_inputs(history, lens, drafts, tables, self.tokens_per_block,
                         graphs.input_ids, graphs.positions, graphs.slot_mapping, graphs.context_lens)
            logits, hidden = graphs.replay(batch, width)
            torch.argmax(logits[:rows], dim=-1, out=target)  # greedy: the target's own tokens
            round_verdict(target, history, lens, drafts, out.tokens, out.accepted, out.drafted, rnd, *self.ngram_sizes,
                          self._heads_inputs(), self._looks_up)
            if stops is not None and stops.after_round(rnd, out.tokens, out.accepted):
                break
            last = rnd + 1 == num_rounds or (stops is not None and stops.asked_to_end(rnd))
            if self.chain is not None:  # with the lookup, the verdict left its drafts in ``drafts``
                lookup = (drafts, out.drafted[rnd + 1]) if self.heads_lookup else None
                drafts = self._heads_draft(out, hidden, rnd, rnd + 1 if last else num_rounds, k, next_k,
                                           num_requests, lookup)
            if last:
                break
        return out

    def _heads_draft(
        self, out: RoundsOutput, hidden: torch.Tensor, rnd: int, num_rounds: int, k: int, next_k: int,
        num_requests: int, lookup: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | None:
        """After round ``rnd`` (the chain's inputs written): the heads' drafts for the next round, returned;
        after the last round (``num_rounds``: the rounds that run), ``next_k`` drafts for the next step into
        ``out.next_drafts`` (None returned).
        With ``lookup`` (its drafts [B, k] and real guesses [B] after this round) a request whose lookup found
        a match takes its drafts instead (``prefer_lookup``), which also sets the next round's real guesses."""
        width = k if rnd + 1 < num_rounds else next_k
        if not width:
            return None
        # The chain's buffers are reused by its next call: cloned.
        drafts = self.chain.draft(hidden, num_requests, min(width, self.chain.max_drafts)).clone()
        if lookup is not None:
            drafts, drafted = prefer_lookup(*lookup, drafts, self.chain.last_tokens[:num_requests], width)
            if rnd + 1 < num_rounds:
                out.drafted[rnd + 1] = drafted
        if rnd + 1 < num_rounds:
            return drafts
        out.next_drafts = drafts
        return None


def _eager_round(
    model: nn.Module, kv_cache: torch.Tensor, graphs: DecodeGraphs | None, tokens_per_block: int,
    requests: Sequence[RoundsRequest], positions: torch.Tensor, ids: torch.Tensor, want_hidden: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One round through the host-packed path (no graph fits, or no GPU): reads the round's positions back.
    (logits, and with ``want_hidden`` the rows' hidden states)."""
    starts = positions[:, 0].tolist()
    segments = [Segment(r.block_table, start, positions.shape[1], as_rows=True) for r, start in zip(requests, starts)]
    packed = pack(segments, tokens_per_block)
    return run_packed(model, kv_cache, graphs, packed, ids.flatten().tolist(), list(range(packed.num_tokens)),
                      want_hidden=want_hidden)


def emitted_tokens(tokens: list[list[list[int]]], accepted: list[list[int]], request: int) -> tuple[list[int], list[int]]:
    """(tokens a request emitted over all rounds, drafts each round accepted), from the host copies of a RoundsOutput."""
    emitted, per_round = [], []
    for round_tokens, round_accepted in zip(tokens, accepted):
        a = round_accepted[request]
        emitted.extend(round_tokens[request][: a + 1])
        per_round.append(a)
    return emitted, per_round
