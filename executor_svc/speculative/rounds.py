"""Several verification rounds in one step, drafted on the device.

A speculative step needs its result before the next one can be planned: the
next drafts follow from the tokens this one accepts. At the small batches
where speculation pays, that round trip (the sampled ids to the host, the
scheduler's next plan, the next launch) costs about as much as the step
itself, so a step that verifies k drafts takes twice the time of a plain step
that overlaps with its successor.

With prompt lookup the next drafts are a lookup in the request's own tokens,
which the device can do as well as the host. So a step may run R rounds back
to back: round r verifies k drafts per request (the first round the drafts
the plan brought, each later round drafts looked up by
``ngram_drafts_on_device``); what it accepts is appended to a device copy of
each request's tokens, and the next round's positions and KV slots follow
from the accepted counts, all as tensor operations. The host queues every
round at once, then reads all rounds' tokens with the step's one copy back.

Every request of such a step verifies the same k drafts in each round (the
plan's drafts are padded to k with the last token; a wrong guess is simply
rejected), so each round is one graph replay of B * (k + 1) rows. The
scheduler reserves KV slots for R * (1 + k) tokens per request, the most the
rounds can write, and takes back what they did not use when the result
arrives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from executor_svc.cuda_graphs import DecodeGraphs
from executor_svc.packed_forward import Segment, pack, run_packed, to_device
from executor_svc.sampler import RequestSamplingState
from executor_svc.speculative.ngram import ngram_drafts_on_device
from executor_svc.speculative.verify import NO_DRAFT, verify_drafts


@dataclass(slots=True)
class RoundsRequest:
    """One request's part in a step of chained rounds."""

    token_ids: list[int]  # every token it holds; the last one is not in the KV cache yet
    block_table: list[int]  # covers len(token_ids) - 1 + rounds * (1 + num_drafts) positions
    drafts: list[int]  # the first round's drafts (at most num_drafts)
    sampling: RequestSamplingState


@dataclass(slots=True)
class RoundsOutput:
    """Every round's verification rows, on the device until the step's copy back."""

    tokens: torch.Tensor  # [rounds, B, 1 + k] int64: what each row emits if its chain gets that far
    accepted: torch.Tensor  # [rounds, B] int64: drafts accepted per round (the round emits accepted + 1)


@torch.inference_mode()
def run_rounds(
    model: nn.Module,
    kv_cache: torch.Tensor,
    graphs: DecodeGraphs | None,
    tokens_per_block: int,
    requests: Sequence[RoundsRequest],
    num_drafts: int,
    num_rounds: int,
    ngram_sizes: tuple[int, int],  # (min_n, max_n) of the lookup that drafts rounds 2..R
) -> RoundsOutput:
    """Queue ``num_rounds`` rounds of verifying ``num_drafts`` drafts for every request; nothing waits for the device
    when the rounds replay a CUDA graph (otherwise each round reads its positions back to pack them)."""
    device = kv_cache.device
    batch, k, rows_per_request = len(requests), num_drafts, num_drafts + 1
    lengths = [len(r.token_ids) for r in requests]
    width = max(lengths) + num_rounds * rows_per_request + 1  # room for every round's rows past the longest
    history = torch.full((batch, width), -1, dtype=torch.int64)
    for i, r in enumerate(requests):
        history[i, : lengths[i]] = torch.tensor(r.token_ids, dtype=torch.int64)
    table_width = max(len(r.block_table) for r in requests)
    tables = to_device([r.block_table + [0] * (table_width - len(r.block_table)) for r in requests], torch.int64, device)
    first = [r.drafts[:k] + [r.token_ids[-1]] * (k - len(r.drafts[:k])) for r in requests]
    history = history.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else history
    lens = to_device(lengths, torch.int64, device)
    drafts = to_device(first, torch.int64, device)
    offsets = torch.arange(rows_per_request, device=device)
    no_draft = torch.full((batch, 1), NO_DRAFT, dtype=torch.int64, device=device)
    row_states = [r.sampling for r in requests for _ in range(rows_per_request)]
    row_tables = tables.repeat_interleave(rows_per_request, dim=0)
    max_context = max(lengths) - 1 + num_rounds * rows_per_request
    use_graph = graphs is not None and graphs.fits(batch * rows_per_request, max_context)
    out = RoundsOutput(
        tokens=torch.empty((num_rounds, batch, rows_per_request), dtype=torch.int64, device=device),
        accepted=torch.empty((num_rounds, batch), dtype=torch.int64, device=device),
    )
    for rnd in range(num_rounds):
        positions = (lens - 1)[:, None] + offsets  # the last token, then the drafts
        ids = torch.cat([history.gather(1, (lens - 1)[:, None]), drafts], dim=1)
        if use_graph:
            slots = tables.gather(1, positions // tokens_per_block) * tokens_per_block + positions % tokens_per_block
            logits, _ = graphs.run_device(
                ids.flatten(), positions.flatten(), slots.flatten(), (positions + 1).flatten(), row_tables, max_context,
            )
        else:
            logits = _eager_round(model, kv_cache, graphs, tokens_per_block, requests, positions, ids)
        row_tokens, row_accepted = verify_drafts(logits, torch.cat([drafts, no_draft], dim=1).flatten(), row_states)
        row_tokens = row_tokens.view(batch, rows_per_request)
        accepted = row_accepted.view(batch, rows_per_request)[:, :k].to(torch.int64).cumprod(dim=1).sum(dim=1)
        # Rows past the accepted prefix land past the new length: ignored, and overwritten by the next round.
        history.scatter_(1, lens[:, None] + offsets, row_tokens)
        lens = lens + accepted + 1
        out.tokens[rnd] = row_tokens
        out.accepted[rnd] = accepted
        if rnd + 1 < num_rounds:
            drafts = ngram_drafts_on_device(history, lens, k, *ngram_sizes)
    return out


def _eager_round(
    model: nn.Module, kv_cache: torch.Tensor, graphs: DecodeGraphs | None, tokens_per_block: int,
    requests: Sequence[RoundsRequest], positions: torch.Tensor, ids: torch.Tensor,
) -> torch.Tensor:
    """One round through the host-packed path (no graph fits, or no GPU): reads the round's positions back."""
    starts = positions[:, 0].tolist()
    segments = [Segment(r.block_table, start, positions.shape[1], as_rows=True) for r, start in zip(requests, starts)]
    packed = pack(segments, tokens_per_block)
    logits, _ = run_packed(model, kv_cache, graphs, packed, ids.flatten().tolist(), list(range(packed.num_tokens)))
    return logits


def emitted_tokens(tokens: list[list[list[int]]], accepted: list[list[int]], request: int) -> tuple[list[int], list[int]]:
    """(tokens a request emitted over all rounds, drafts each round accepted), from the host copies of a RoundsOutput."""
    emitted, per_round = [], []
    for round_tokens, round_accepted in zip(tokens, accepted):
        a = round_accepted[request]
        emitted.extend(round_tokens[request][: a + 1])
        per_round.append(a)
    return emitted, per_round
