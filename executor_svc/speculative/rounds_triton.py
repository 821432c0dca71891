"""The small work between chained verification rounds, as two Triton kernels.

Between two replays of the decode graph a round needs its rows' inputs (each
request's last token and drafts, their positions, KV slots and context
lengths) and, after the argmax, its verdict: the accepted prefix, the emitted
tokens appended to the request's device history, its new length, and the next
round's prompt-lookup drafts. As torch operations that is some sixty small
kernels per round, which on a fast GPU cost a third of the decode graph and
more host time than the round itself. Here it is one program per request in
each of two kernels:

* ``round_inputs`` writes the rows straight into the decode graph's static
  input buffers;
* ``round_verdict`` judges the drafts against the target's tokens, appends
  the round's rows to the history, advances the length, and looks the next
  drafts up: for every earlier position e, how many of the last n tokens end
  there (up to ``max_n``), the best being the longest run of at least
  ``min_n`` and, among equal runs, the latest, which is exactly what
  ``NgramIndex.propose`` picks (``ngram_drafts_on_device`` is the torch
  reference). When draft heads draft instead, it writes each request's
  newest token and the row whose hidden state chose it, which the heads read
  next (``heads_proposer.HeadsChain``); with heads and lookup together
  (``SpeculativeConfig.heads_lookup``) it does both.

A third, ``round_finished``, counts what each request emitted and flags the
ones that finished, so the host can stop queueing rounds (``round_stops.py``).

Each is checked against its torch reference (executor_svc/speculative/
rounds.py, round_stops.py) on the CPU through Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_POSITIONS = 1024  # history positions one loop iteration of the lookup compares
MIN_STOP_BLOCK = 8  # stop ids one program compares at least (a request rarely has more: one compilation)


# Strides change with every step's lengths: not specialised on, so each draft length compiles once.
@triton.jit(do_not_specialize=["stride_history", "stride_drafts", "stride_tables"])
def _round_inputs_kernel(
    history_ptr, lens_ptr, drafts_ptr, tables_ptr, ids_ptr, positions_ptr, slots_ptr, context_ptr,
    stride_history, stride_drafts, stride_tables,
    K: tl.constexpr, BLOCK: tl.constexpr, TOKENS_PER_BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    j = tl.arange(0, BLOCK)  # row j: the last token (j = 0), then draft j - 1
    rows = j < K + 1
    length = tl.load(lens_ptr + b)
    last_token = tl.load(history_ptr + b * stride_history + length - 1)
    draft = tl.load(drafts_ptr + b * stride_drafts + j - 1, mask=rows & (j >= 1), other=0)
    ids = tl.where(j == 0, last_token, draft)
    position = length - 1 + j
    block = tl.load(tables_ptr + b * stride_tables + position // TOKENS_PER_BLOCK, mask=rows, other=0)
    row = b * (K + 1) + j
    tl.store(ids_ptr + row, ids, mask=rows)
    tl.store(positions_ptr + row, position, mask=rows)
    tl.store(slots_ptr + row, block * TOKENS_PER_BLOCK + position % TOKENS_PER_BLOCK, mask=rows)
    tl.store(context_ptr + row, position + 1, mask=rows)


@triton.jit(do_not_specialize=["stride_history", "stride_drafts", "round_index"])
def _round_verdict_kernel(
    target_ptr, history_ptr, lens_ptr, drafts_ptr, out_tokens_ptr, out_accepted_ptr, out_drafted_ptr,
    last_token_ptr, hidden_row_ptr,
    stride_history, stride_drafts, round_index,
    K: tl.constexpr, BLOCK: tl.constexpr, MIN_N: tl.constexpr, MAX_N: tl.constexpr, BLOCK_E: tl.constexpr,
    LOOKUP: tl.constexpr, HEADS: tl.constexpr,
):
    b = tl.program_id(0)
    row = history_ptr + b * stride_history
    # This round's slice of the outputs ([rounds, B, K + 1] and [rounds, B]), offset here rather than
    # by the caller: a slice's address would change the kernel's specialisation every other round.
    out_tokens_ptr += round_index * tl.num_programs(0) * (K + 1)
    out_accepted_ptr += round_index * tl.num_programs(0)
    out_drafted_ptr += (round_index + 1) * tl.num_programs(0)  # the next round's real drafts
    j = tl.arange(0, BLOCK)
    rows = j < K + 1
    target = tl.load(target_ptr + b * (K + 1) + j, mask=rows, other=0)
    draft = tl.load(drafts_ptr + b * stride_drafts + j, mask=j < K, other=-1)
    # The accepted prefix ends at the first row whose draft the target disagrees with; row K has none.
    rejected = (j >= K) | (target != draft)
    accepted = tl.min(tl.where(rejected, j, BLOCK), axis=0).to(tl.int64)
    length = tl.load(lens_ptr + b)
    tl.store(row + length + j, target, mask=rows)  # rows past the accepted prefix lie past the new length
    tl.store(out_tokens_ptr + b * (K + 1) + j, target, mask=rows)
    tl.store(out_accepted_ptr + b, accepted)
    length = length + accepted + 1
    tl.store(lens_ptr + b, length)
    if LOOKUP:
        tl.debug_barrier()  # the appended tokens and the old drafts' loads, before the lookup reads and writes

        # The next drafts: the longest suffix (MIN_N..MAX_N tokens) seen ending at an earlier position e.
        last = length - 1
        best = tl.full((), -1, tl.int64)  # run * stride_history + e of the best match so far
        for start in range(0, last, BLOCK_E):
            e = start + tl.arange(0, BLOCK_E)
            matching = e < last
            run = tl.zeros((BLOCK_E,), dtype=tl.int64)
            for i in tl.static_range(MAX_N):
                suffix = tl.where(last - i >= 0, tl.load(row + tl.maximum(last - i, 0)), -2)  # -2: no token
                token = tl.load(row + e - i, mask=matching & (e - i >= 0), other=-3)
                matching = matching & (token == suffix)
                run += matching.to(tl.int64)
            score = tl.where(run >= MIN_N, run * stride_history + e, -1)
            best = tl.maximum(best, tl.max(score, axis=0))
        first = tl.where(best >= 0, best % stride_history + 1, -1)
        d = tl.arange(0, BLOCK)
        source = first + d
        found = (source >= d) & (source < length) & (d < K)  # source >= d: a match was found (first >= 0)
        copied = tl.load(row + source, mask=found, other=0)
        tl.store(drafts_ptr + b * stride_drafts + d, tl.where(found, copied, tl.load(row + last)), mask=d < K)
        tl.store(out_drafted_ptr + b, tl.sum(found.to(tl.int64), axis=0))
    if HEADS:  # draft heads draft next: from the row that chose the last token, and that token
        tl.store(last_token_ptr + b, tl.sum(tl.where(j == accepted, target, 0), axis=0))
        tl.store(hidden_row_ptr + b, b * (K + 1) + accepted)
        if not LOOKUP:
            tl.store(out_drafted_ptr + b, K)


# The row width and the stop-id count are plain arguments: one compilation per power-of-two block, which
# the engine's warm-up makes, rather than one per draft length and stop-id count in the middle of serving.
@triton.jit(do_not_specialize=["round_index", "K1", "S"])
def _round_finished_kernel(
    tokens_ptr, accepted_ptr, stops_ptr, budget_ptr, emitted_ptr, finished_ptr, round_index, K1, S,
    BLOCK: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    batch = tl.num_programs(0)
    n = tl.load(accepted_ptr + round_index * batch + b) + 1  # the round emitted its accepted drafts and one more
    j = tl.arange(0, BLOCK)
    tokens = tl.load(tokens_ptr + (round_index * batch + b) * K1 + j, mask=j < n, other=-2)
    s = tl.arange(0, BLOCK_S)
    stops = tl.load(stops_ptr + b * S + s, mask=s < S, other=-1)  # -1 pads, and never equals a token (-2 pads)
    hits = tl.sum(tl.sum(((tokens[:, None] == stops[None, :]) & (stops[None, :] >= 0)).to(tl.int32), axis=1), axis=0)
    emitted = tl.load(emitted_ptr + b) + n
    tl.store(emitted_ptr + b, emitted)
    done = (tl.load(finished_ptr + b) != 0) | (hits > 0) | (emitted >= tl.load(budget_ptr + b))
    tl.store(finished_ptr + b, done.to(tl.int32))


def round_finished(
    tokens: torch.Tensor, accepted: torch.Tensor, round_index: int, stops: torch.Tensor, budget: torch.Tensor,
    emitted: torch.Tensor, finished: torch.Tensor,
) -> None:
    """``round_stops.round_finished_reference`` for round ``round_index`` of ``tokens`` [R, B, 1 + k] and
    ``accepted`` [R, B] (contiguous, passed whole: see the verdict), in one program per request."""
    batch, k1, num_stops = tokens.shape[1], tokens.shape[2], stops.shape[1]
    _round_finished_kernel[(batch,)](
        tokens, accepted, stops, budget, emitted, finished, round_index, k1, num_stops,
        BLOCK=triton.next_power_of_2(k1), BLOCK_S=max(MIN_STOP_BLOCK, triton.next_power_of_2(num_stops)),
    )


def round_inputs(
    history: torch.Tensor, lens: torch.Tensor, drafts: torch.Tensor, tables: torch.Tensor, tokens_per_block: int,
    ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, context_lens: torch.Tensor,
) -> None:
    """Rows b * (1 + k) + j of the 1-D int64 outputs: request b's last token (j = 0) and drafts, their positions
    (from lens - 1 on), KV slots and context lengths. history [B, H], lens [B], drafts [B, k], tables [B, W]."""
    batch, k = drafts.shape
    _round_inputs_kernel[(batch,)](
        history, lens, drafts, tables, ids, positions, slots, context_lens,
        history.stride(0), drafts.stride(0), tables.stride(0),
        K=k, BLOCK=triton.next_power_of_2(k + 1), TOKENS_PER_BLOCK=tokens_per_block,
    )


def round_verdict(
    target: torch.Tensor, history: torch.Tensor, lens: torch.Tensor, drafts: torch.Tensor,
    out_tokens: torch.Tensor, out_accepted: torch.Tensor, out_drafted: torch.Tensor, round_index: int,
    min_n: int, max_n: int, heads_inputs: tuple[torch.Tensor, torch.Tensor] | None = None, lookup: bool | None = None,
) -> None:
    """Greedy verdict of a round from the target's tokens ([B * (1 + k)], the argmax of each row): writes the
    rows' tokens and accepted counts into round ``round_index`` of ``out_tokens`` [R, B, 1 + k] and
    ``out_accepted`` [R, B] (contiguous), appends to ``history`` and advances ``lens``, and replaces ``drafts``
    [B, k] with the next round's lookup (padded with the last token, as ``ngram_drafts_on_device``), whose
    real guesses it counts in row ``round_index + 1`` of ``out_drafted`` [R + 1, B].

    With ``heads_inputs`` = (last_tokens [B], hidden_rows [B]) draft heads draft instead of the lookup: it
    writes each request's newest token and the row (b * (1 + k) + accepted) whose hidden state chose it,
    leaves ``drafts`` alone, and counts k real guesses. With both (``lookup`` True), it does both: the heads'
    inputs, and the lookup's drafts and counts, which ``rounds.prefer_lookup`` then weighs against the heads'.
    ``lookup`` defaults to True without heads and False with them."""
    batch, k = drafts.shape
    lookup = heads_inputs is None if lookup is None else lookup
    if not lookup and heads_inputs is None:
        raise ValueError("a round's verdict drafts by lookup, for heads, or both")
    last_tokens, hidden_rows = heads_inputs if heads_inputs is not None else (out_accepted, out_accepted)
    _round_verdict_kernel[(batch,)](
        target, history, lens, drafts, out_tokens, out_accepted, out_drafted, last_tokens, hidden_rows,
        history.stride(0), drafts.stride(0), round_index,
        K=k, BLOCK=triton.next_power_of_2(k + 1), MIN_N=min_n, MAX_N=max_n, BLOCK_E=BLOCK_POSITIONS,
        LOOKUP=lookup, HEADS=heads_inputs is not None,
    )
