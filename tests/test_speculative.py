"""Speculative decoding: proposers, lossless verification, scheduler bookkeeping, end to end.

The oracle for greedy requests is the same engine without speculation: every
mode must give token-identical outputs, whether its drafts are mostly right
(the target itself as its own draft model, repetitive prompts for prompt
lookup) or mostly wrong (a random-weight draft model). For sampled requests the
verification rule is checked statistically against the distribution it claims.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from scipy import stats as scipy_stats

from executor_svc.speculative.ngram import NgramIndex, ngram_drafts_on_device
from executor_svc.speculative.proposer import SpeculativeConfig, SpeculativeMode
from executor_svc.speculative.verify import NO_DRAFT, accepted_prefix, verify_drafts
from executor_svc.sampler import RequestSamplingState
from protos.plan import CachedRequest, RequestOutput, SamplingConfig, StepPlan, StepResult
from scheduler_svc.api_types import GenerationRequest
from scheduler_svc.request import FinishReason
from scheduler_svc.speculation import TRUSTED, Candidate, DraftLengthPolicy, expected_accepted
from tests.conftest import PROMPTS, TEST_DEVICE, run_async, tiny_llama_config
from tests.test_scheduler import make_request, make_scheduler

# Prompts whose continuations copy from the prompt: where prompt lookup pays.
COPY_PROMPTS = [
    "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog. the quick",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(",
    "1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3,",
]


# -- proposers -------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_longest_match():
    def propose(tokens, k, min_n=1, max_n=3):
        return NgramIndex(min_n, max_n).propose(tokens, k)

    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 1, 5, 6, 8, 2, 5, 6]
    assert propose(tokens, 3) == [8, 2, 5]  # "5 6" last seen at 4: 8 followed (not 7, the older match)
    assert propose([1, 2, 3, 9, 2, 3], 2) == [9, 2]  # "2 3" beats "3"
    assert propose([1, 2, 3, 4], 4) == []  # nothing repeats
    assert propose(tokens, 0) == []
    assert propose([4, 4, 4, 4], 5, 2, 2) == [4]  # bounded by what followed the match


def test_ngram_index_grows_with_the_request_and_agrees_with_a_fresh_one():
    import random

    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(40)]
    grown = NgramIndex(2, 4)
    for length in range(3, len(tokens) + 1, rng.choice([1, 2, 3])):
        assert grown.propose(tokens[:length], 4) == NgramIndex(2, 4).propose(tokens[:length], 4)


def test_ngram_lookup_matches_whole_tokens_only():
    """Tokens are searched as bytes: a byte match that straddles tokens must not count."""
    import random

    def brute_force(tokens, k, min_n, max_n):  # the latest earlier occurrence of the longest suffix
        for n in range(min(max_n, len(tokens)), min_n - 1, -1):
            for end in range(len(tokens) - 2, n - 2, -1):
                if tokens[end - n + 1 : end + 1] == tokens[-n:]:
                    return tokens[end + 1 : end + 1 + k]
        return []

    # 1 and 256 share bytes with 65536 + 1 = 0x00010001 and 16777216 at shifted offsets.
    assert NgramIndex(1, 1).propose([65537, 1, 256], 2) == []
    rng = random.Random(3)
    alphabet = [0, 1, 256, 257, 65536, 65537, 16777216, 16843009]
    for _ in range(500):
        min_n, max_n = rng.choice([(1, 2), (1, 3), (2, 4)])
        index, tokens = NgramIndex(min_n, max_n), []
        for _ in range(rng.randint(1, 30)):
            tokens.append(rng.choice(alphabet))
            assert index.propose(tokens, 3) == brute_force(tokens, 3, min_n, max_n), tokens


# -- verification ----------------------------------------------------------------


def test_device_lookup_proposes_what_the_index_proposes():
    import random

    rng = random.Random(1)
    for _ in range(200):
        k, (min_n, max_n) = rng.randint(1, 16), rng.choice([(1, 3), (2, 4), (3, 3)])
        seqs = [[rng.randrange(5) for _ in range(rng.randint(1, 40))] for _ in range(4)]
        width = max(map(len, seqs)) + 6
        tokens = torch.randint(0, 5, (4, width))  # junk past each length must not matter
        for i, seq in enumerate(seqs):
            tokens[i, : len(seq)] = torch.tensor(seq)
        drafts = ngram_drafts_on_device(tokens, torch.tensor([len(q) for q in seqs]), k, min_n, max_n)
        for i, seq in enumerate(seqs):
            expected = NgramIndex(min_n, max_n).propose(seq, k)
            assert drafts[i].tolist() == expected + [seq[-1]] * (k - len(expected))  # padded with the last token


def test_round_kernels_match_their_torch_reference():
    import random

    from executor_svc.speculative.rounds import _accept, _round_inputs
    from executor_svc.speculative.rounds_triton import round_inputs, round_verdict

    rng, device = random.Random(2), torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: interpreted
    for _ in range(12):
        batch, k, block = rng.randint(1, 3), rng.randint(1, 16), 16
        min_n, max_n = rng.choice([(2, 4), (1, 3), (3, 3)])
        lens = torch.tensor([rng.randint(1, 120) for _ in range(batch)], device=device)
        history = torch.randint(0, 4, (batch, 160), device=device)  # a small vocabulary: lookups find matches
        drafts = torch.randint(0, 4, (batch, k), device=device)
        tables = torch.randint(0, 100, (batch, 12), device=device)
        rows = batch * (k + 1)
        outs = [torch.full((rows + 2,), -7, dtype=torch.int64, device=device) for _ in range(4)]  # graph buffers: more rows
        round_inputs(history, lens, drafts, tables, block, *outs)
        ids, positions, slots = _round_inputs(history, lens, drafts, tables, block)
        for out, ref in zip(outs, [ids, positions, slots, positions + 1]):
            assert torch.equal(out[:rows], ref.flatten()) and (out[rows:] == -7).all()
        target = torch.randint(0, 4, (batch, k + 1), device=device)
        for b in range(batch):  # the target agrees with a prefix of the drafts
            prefix = rng.randint(0, k)
            target[b, :prefix] = drafts[b, :prefix]
        history_k, lens_k, drafts_k = history.clone(), lens.clone(), drafts.clone()
        tokens_k = torch.zeros((3, batch, k + 1), dtype=torch.int64, device=device)  # round 1 of 3
        accepted_k = torch.zeros((3, batch), dtype=torch.int64, device=device)
        drafted_k = torch.zeros((4, batch), dtype=torch.int64, device=device)
        round_verdict(target.flatten(), history_k, lens_k, drafts_k, tokens_k, accepted_k, drafted_k, 1, min_n, max_n)
        agree = torch.cat([target[:, :k] == drafts, torch.zeros((batch, 1), dtype=torch.bool, device=device)], dim=1)
        accepted = _accept(target, agree, history, lens)
        assert torch.equal(accepted_k[1], accepted) and torch.equal(tokens_k[1], target)
        assert not accepted_k[0].any() and not accepted_k[2].any() and not tokens_k[0].any()
        assert torch.equal(history_k, history) and torch.equal(lens_k, lens)
        next_drafts, real = ngram_drafts_on_device(history, lens, k, min_n, max_n, with_counts=True)
        assert torch.equal(drafts_k, next_drafts) and torch.equal(drafted_k[2], real)  # the next round's row
        # With draft heads drafting next: the newest token, the row that chose it, k real guesses, drafts kept.
        history_h, lens_h, drafts_h = history_k.clone(), lens.clone() - accepted - 1, drafts.clone()
        last, rows_of = torch.full((batch + 1,), -1, device=device), torch.full((batch + 1,), -1, device=device)
        round_verdict(target.flatten(), history_h, lens_h, drafts_h, tokens_k, accepted_k, drafted_k, 1, 1, 1,
                      (last, rows_of))
        assert torch.equal(lens_h, lens) and torch.equal(drafts_h, drafts) and (drafted_k[2] == k).all()
        assert torch.equal(last[:batch], target.gather(1, accepted[:, None]).squeeze(1)) and last[batch] == -1
        assert torch.equal(rows_of[:batch], torch.arange(batch, device=device) * (k + 1) + accepted)
        # Heads with the lookup: both the heads' inputs and the lookup's drafts and real guesses.
        history_b, lens_b, drafts_b = history_k.clone(), lens.clone() - accepted - 1, drafts.clone()
        last.fill_(-1), rows_of.fill_(-1), drafted_k.fill_(-5)
        round_verdict(target.flatten(), history_b, lens_b, drafts_b, tokens_k, accepted_k, drafted_k, 1, min_n, max_n,
                      (last, rows_of), lookup=True)
        assert torch.equal(lens_b, lens) and torch.equal(drafts_b, next_drafts) and torch.equal(drafted_k[2], real)
        assert torch.equal(last[:batch], target.gather(1, accepted[:, None]).squeeze(1))
        assert torch.equal(rows_of[:batch], torch.arange(batch, device=device) * (k + 1) + accepted)


def test_heads_take_the_lookups_drafts_only_where_it_found_a_match():
    from executor_svc.speculative.rounds import prefer_lookup

    lookup = torch.tensor([[5, 6, 9, 9], [9, 9, 9, 9], [7, 8, 3, 3]])  # padded with each last token (9, 9, 3)
    counts = torch.tensor([2, 0, 4])
    heads, last = torch.tensor([[1, 2], [3, 4], [5, 6]]), torch.tensor([9, 9, 3])
    drafts, real = prefer_lookup(lookup, counts, heads, last, 4)
    assert drafts.tolist() == [[5, 6, 9, 9], [3, 4, 9, 9], [7, 8, 3, 3]] and real.tolist() == [2, 2, 4]
    drafts, real = prefer_lookup(lookup, counts, heads, last, 3)  # fewer than the lookup made: cut, and counted so
    assert drafts.tolist() == [[5, 6, 9], [3, 4, 9], [7, 8, 3]] and real.tolist() == [2, 2, 3]
    drafts, real = prefer_lookup(lookup[:, :2], counts.clamp(max=2), heads, last, 5)  # more: padded
    assert drafts.tolist() == [[5, 6, 9, 9, 9], [3, 4, 9, 9, 9], [7, 8, 3, 3, 3]] and real.tolist() == [2, 2, 2]


def test_heads_lookup_is_checked_where_it_is_configured():
    with pytest.raises(ValueError, match="heads_lookup needs speculative mode draft_heads, not ngram"):
        SpeculativeConfig(SpeculativeMode.NGRAM, heads_lookup=2)
    with pytest.raises(ValueError, match=r"heads_lookup must be in \[1, ngram_max = 4\], got 5"):
        SpeculativeConfig(SpeculativeMode.DRAFT_HEADS, heads_lookup=5)
    with pytest.raises(ValueError, match="does not combine with a draft tree"):
        SpeculativeConfig(SpeculativeMode.DRAFT_HEADS, heads_lookup=2, draft_tree=((0,), (0, 0)))
    assert SpeculativeConfig(SpeculativeMode.DRAFT_HEADS, 8, heads_lookup=3).num_draft_tokens == 8
    with pytest.raises(ValueError, match="a draft heads folder needs speculative mode draft_heads, not ngram"):
        SpeculativeConfig(SpeculativeMode.NGRAM, draft_heads_dir=Path("heads"))


def test_round_finished_kernel_matches_its_reference():
    import random

    from executor_svc.speculative.round_stops import round_finished_reference
    from executor_svc.speculative.rounds_triton import round_finished

    rng, device = random.Random(5), torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: interpreted
    for _ in range(10):
        rounds, batch, k, width = 3, rng.randint(1, 4), rng.randint(1, 16), rng.randint(1, 3)
        tokens = torch.randint(0, 6, (rounds, batch, k + 1), device=device)  # a small vocabulary: stops get hit
        accepted = torch.randint(0, k + 1, (rounds, batch), device=device)
        stops = torch.randint(0, 6, (batch, width), device=device)
        stops[:, rng.randrange(width)] = -1  # padding
        budget = torch.randint(1, 3 * (k + 1), (batch,), device=device)
        emitted = torch.zeros(batch, dtype=torch.int64, device=device)
        finished = torch.zeros(batch, dtype=torch.int32, device=device)
        emitted_ref, finished_ref = emitted.clone(), finished.clone()
        for rnd in range(rounds):
            round_finished(tokens, accepted, rnd, stops, budget, emitted, finished)
            round_finished_reference(tokens[rnd], accepted[rnd], stops, budget, emitted_ref, finished_ref)
            assert torch.equal(emitted, emitted_ref) and torch.equal(finished, finished_ref)
    # Only emitted tokens count: a stop id past the accepted prefix does not finish the request.
    tokens, stops, budget = torch.tensor([[[1, 9, 2]]], device=device), torch.tensor([[2]], device=device), torch.tensor([100], device=device)
    for accepted, finished_after in ((0, 0), (1, 0), (2, 1)):
        emitted = torch.zeros(1, dtype=torch.int64, device=device)
        finished = torch.zeros(1, dtype=torch.int32, device=device)
        round_finished(tokens, torch.tensor([[accepted]], device=device), 0, stops, budget, emitted, finished)
        assert finished.item() == finished_after and emitted.item() == accepted + 1


def _states(config: SamplingConfig, count: int, seed0: int = 0) -> list[RequestSamplingState]:
    return [
        RequestSamplingState(dataclasses.replace(config, seed=seed0 + i), [1], "cpu") for i in range(count)
    ]


def test_greedy_verification_accepts_the_argmax_prefix_and_adds_one():
    logits = torch.full((4, 10), -5.0)
    for row, best in enumerate([3, 4, 9, 2]):
        logits[row, best] = 5.0
    states = _states(SamplingConfig(temperature=0.0), 1) * 4
    tokens, accepted = verify_drafts(logits, torch.tensor([3, 4, 7, NO_DRAFT]), states)
    assert accepted.tolist() == [True, True, False, False]
    assert accepted_prefix(tokens.tolist(), accepted.tolist()) == [3, 4, 9]  # two drafts, then the target's 9
    tokens, accepted = verify_drafts(logits, torch.tensor([3, 4, 9, NO_DRAFT]), states)
    assert accepted_prefix(tokens.tolist(), accepted.tolist()) == [3, 4, 9, 2]  # all three and the bonus


@pytest.mark.parametrize("top_k", [0, 3])
def test_sampled_verification_emits_the_target_distribution(top_k):
    """Chains of two drafts judged many times: the first emitted token follows p0 (after
    temperature and top-k); when the first draft was accepted, the second follows p1."""
    torch.manual_seed(0)
    vocab, trials = 6, 6000
    row_logits = torch.randn(3, vocab) * 1.5
    drafts = [int(row_logits[0].argsort()[-2]), 0]  # a plausible but not top draft, then an unlikely one
    config = SamplingConfig(temperature=0.9, top_k=top_k)
    states = _states(config, trials)
    logits = row_logits.repeat(trials, 1)
    draft_ids = torch.tensor(drafts + [NO_DRAFT]).repeat(trials)
    row_states = [s for s in states for _ in range(3)]
    tokens, accepted = verify_drafts(logits, draft_ids, row_states)
    chains = [accepted_prefix(tokens[3 * t : 3 * t + 3].tolist(), accepted[3 * t : 3 * t + 3].tolist()) for t in range(trials)]

    def target(row: int) -> torch.Tensor:
        scaled = row_logits[row] / config.temperature
        if top_k:
            scaled = scaled.masked_fill(scaled < scaled.topk(top_k).values[-1], float("-inf"))
        return scaled.softmax(-1)

    def check(observed: list[int], probs: torch.Tensor) -> None:
        counts = torch.bincount(torch.tensor(observed), minlength=vocab).double()
        keep = probs > 0
        assert counts[~keep].sum() == 0, "a token outside the filtered distribution was emitted"
        expected = probs[keep].double() * len(observed)
        chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
        assert chi2 < scipy_stats.chi2.ppf(0.999, int(keep.sum()) - 1), (counts, expected)

    check([c[0] for c in chains], target(0))
    second = [c[1] for c in chains if c[0] == drafts[0]]
    assert len(second) > 500
    check(second, target(1))


# -- scheduler ---------------------------------------------------------------------


def test_scheduler_verifies_drafts_and_rolls_back_rejected_ones():
    s = make_scheduler(max_draft_tokens=3, draft_lookahead_slots=True, adaptive_draft_length=False)
    s.add_request(make_request("a", 6, max_tokens=20))
    plan = s.schedule()
    assert plan.new_requests[0].num_drafts_to_propose == 3
    # The prompt's step allocates the lookahead a draft model writes: 6 prompt + 3 slots.
    assert len(s.kv.block_table("a")) * s.config.tokens_per_block >= 9
    s.update(StepResult(plan.step_id, [RequestOutput("a", [100], [101, 102, 103])]))
    plan = s.schedule()
    cached = plan.cached_requests[0]
    assert cached.draft_token_ids == [101, 102, 103] and cached.num_scheduled_tokens == 4
    assert cached.num_computed_tokens == 6
    s.update(StepResult(plan.step_id, [RequestOutput("a", [101, 55], [7, 8], num_accepted_drafts=1)], step_us=1000))
    req = s.requests["a"]
    assert req.output_token_ids == [100, 101, 55]
    assert req.num_computed_tokens == 8  # 6 + the last token + 1 accepted draft; 2 rejected rolled back
    assert (req.num_draft_tokens, req.num_accepted_draft_tokens) == (3, 1)
    assert s.drafts.by_position == [1, 1, 1] and s.drafts.accepted_by_position == [1, 0, 0]
    plan = s.schedule()
    assert plan.cached_requests[0].num_computed_tokens == 8 and plan.cached_requests[0].draft_token_ids == [7, 8]


def test_scheduler_cuts_drafts_at_max_tokens():
    s = make_scheduler(max_draft_tokens=4)
    s.add_request(make_request("a", 4, max_tokens=3))
    plan = s.schedule()
    s.update(StepResult(plan.step_id, [RequestOutput("a", [100], [1, 2, 3, 4])]))
    plan = s.schedule()
    # One output exists and two may follow: one draft plus the target's own token.
    assert plan.cached_requests[0].draft_token_ids == [1]


def test_scheduler_chains_rounds_when_every_request_verifies_and_none_waits():
    s = make_scheduler(max_draft_tokens=3, max_speculative_rounds=4, adaptive_draft_length=False)
    s.add_request(make_request("a", 6, max_tokens=40))
    plan = s.schedule()
    s.update(StepResult(plan.step_id, [RequestOutput("a", [100], [101, 102])]))
    plan = s.schedule()
    cached = plan.cached_requests[0]
    # 4 rounds of 3 drafts: the plan's two drafts (padded by the executor) start the first.
    assert (cached.num_rounds, cached.num_scheduled_tokens, cached.draft_token_ids) == (4, 16, [101, 102])
    assert len(s.kv.block_table("a")) * s.config.tokens_per_block >= 6 + 16
    # Rounds accepted 3, 0, 1 and 2 drafts: 4 + 1 + 2 + 3 = 10 tokens emitted. The third round's lookup
    # found nothing: its drafts were padding (one matched by chance), which the statistics leave out.
    emitted = list(range(200, 210))
    output = RequestOutput("a", emitted, [7], 6, round_accepted=[3, 0, 1, 2], round_drafted=[3, 3, 0, 3])
    s.update(StepResult(plan.step_id, [output], step_us=4000))
    req = s.requests["a"]
    assert req.output_token_ids == [100, *emitted]
    assert req.num_computed_tokens == 6 + 10  # the prompt, the first token and all but the last emitted
    assert (req.num_draft_tokens, req.num_accepted_draft_tokens) == (9, 5)
    assert s.drafts.by_position == [3, 3, 3] and s.drafts.accepted_by_position == [2, 2, 1]
    # A waiting request turns chaining off: it would wait for every round.
    s.add_request(make_request("b", 6))
    plan = s.schedule()
    assert plan.cached_requests[0].num_rounds == 1 and plan.cached_requests[0].num_scheduled_tokens == 2



def test_scheduler_takes_a_result_of_fewer_rounds_than_planned():
    """The executor ends a step's rounds once every request finished: the rounds not run emitted nothing,
    count for no statistics, and the step's time is spread over the rounds that ran."""
    s = make_scheduler(max_draft_tokens=3, max_speculative_rounds=4, adaptive_draft_length=False)
    s.add_request(make_request("a", 6, max_tokens=40))
    plan = s.schedule()
    new = plan.new_requests[0]
    assert (new.stop_token_ids, new.max_num_tokens) == ([0], 6 + 40)  # EOS, and the prompt plus max_tokens
    s.update(StepResult(plan.step_id, [RequestOutput("a", [100], [101, 102])]))
    plan = s.schedule()
    assert plan.cached_requests[0].num_rounds == 4
    seen = []
    s.draft_policy.observe = lambda tokens, seconds, *args, **kwargs: seen.append((tokens, seconds))
    # Two rounds ran, accepting 3 and 1 drafts; the second emitted EOS (0) and a token past it.
    output = RequestOutput("a", [200, 201, 202, 203, 204, 0, 205], [], 4, round_accepted=[3, 1], round_drafted=[3, 3])
    updates = s.update(StepResult(plan.step_id, [output], step_us=4000), seconds=0.004)
    assert seen == [(4, 0.002)]  # 4 tokens a round (1 + 3), 2 ms each
    (update,) = updates
    assert update.new_token_ids == [200, 201, 202, 203, 204, 0] and update.finish_reason is not None
    req = update.request
    assert (req.num_draft_tokens, req.num_accepted_draft_tokens) == (6, 4)
    assert s.drafts.by_position == [2, 2, 2] and s.drafts.accepted_by_position == [2, 1, 1]
    assert s.kv.stats().num_free_blocks == s.config.num_kv_blocks  # its blocks went back


def test_the_policy_learns_from_generation_steps_only():
    """The draft-length policy prices steps by what generation steps cost: a step with context work (a
    prompt) teaches it nothing, a plain generation step is priced as plain, one verifying host drafts as a
    verification of its whole batch's tokens."""
    s = make_scheduler(max_draft_tokens=3, adaptive_draft_length=False)
    seen = []
    s.draft_policy.observe = lambda tokens, seconds, *args, **kwargs: seen.append((tokens, kwargs["plain"]))
    for rid in "ab":
        s.add_request(make_request(rid, 6, max_tokens=40))
    plan = s.schedule()  # the prompts
    s.update(StepResult(plan.step_id, [RequestOutput(rid, [100], [101, 102]) for rid in "ab"], step_us=3000),
             seconds=0.003)
    assert seen == []
    plan = s.schedule()  # both verify their two drafts: 2 x 3 tokens
    assert [c.num_scheduled_tokens for c in plan.cached_requests] == [3, 3]
    s.update(StepResult(plan.step_id, [RequestOutput(rid, [101, 103], [], 1) for rid in "ab"], step_us=2000),
             seconds=0.002)
    plan = s.schedule()  # no drafts came back: a plain step of one token each
    assert [c.num_scheduled_tokens for c in plan.cached_requests] == [1, 1]
    s.update(StepResult(plan.step_id, [RequestOutput(rid, [104]) for rid in "ab"], step_us=1000), seconds=0.001)
    assert seen == [(6, False), (2, True)]


def plan_after_first_step(s, request_ids: str, drafts: list[int], max_tokens: int = 40):
    """Admit ``request_ids`` (6-token prompts) to ``s``, answer their first step with one token and
    ``drafts`` each, and return the next plan."""
    for rid in request_ids:
        s.add_request(make_request(rid, 6, max_tokens=max_tokens))
    plan = s.schedule()
    s.update(StepResult(plan.step_id, [RequestOutput(rid, [100], list(drafts)) for rid in request_ids]))
    return s.schedule()


def test_a_batch_too_large_for_the_longest_chains_chains_shorter_ones():
    # Three requests with 4 drafts each would be 15 rows a round, past a batch of 8: chains of 1 fit (6 rows).
    s = make_scheduler(max_draft_tokens=4, max_speculative_rounds=3, adaptive_draft_length=False, max_batch_size=8)
    plan = plan_after_first_step(s, "abc", [101, 102, 103, 104])
    assert [(c.num_rounds, c.num_scheduled_tokens, c.draft_token_ids) for c in plan.cached_requests] == [
        (3, 6, [101])] * 3
    # Five requests leave no room for even one draft a row: single verification steps of the host's drafts.
    s = make_scheduler(max_draft_tokens=4, max_speculative_rounds=3, adaptive_draft_length=False, max_batch_size=8)
    plan = plan_after_first_step(s, "abcde", [101, 102])
    assert {(c.num_rounds, c.num_scheduled_tokens) for c in plan.cached_requests} == {(1, 3)}


def test_speculation_turns_off_when_the_drafts_asked_for_never_come():
    """A batch too large to chain, whose proposer finds nothing: after DRY_STEPS steps that asked for drafts
    and got none, speculation is off (steps overlap again, no drafts are asked for) until a probe."""
    from scheduler_svc.speculation import DRY_STEPS

    s = make_scheduler(max_draft_tokens=4, max_speculative_rounds=8, max_batch_size=8, max_num_tokens=256)
    for rid in "abcdefgh":
        s.add_request(make_request(rid, 20, max_tokens=100))
    policy = s.draft_policy
    for _ in range(DRY_STEPS + 1):  # the first step computes the prompts (it asks for drafts too)
        assert not policy.allows_overlap() and policy.drafts_to_propose() == 4
        plan = s.schedule()
        assert all(not c.draft_token_ids for c in plan.cached_requests)
        outputs = [RequestOutput(c.request_id, [100], []) for c in plan.new_requests + plan.cached_requests]
        s.update(StepResult(plan.step_id, outputs, step_us=3000))
    assert policy.last_k == 0 and policy.allows_overlap() and policy.drafts_to_propose() == 0


def test_chained_rounds_need_no_drafts_from_the_host():
    s = make_scheduler(max_draft_tokens=2, max_speculative_rounds=3, adaptive_draft_length=False)
    s.add_request(make_request("a", 6, max_tokens=40))
    plan = s.schedule()
    s.update(StepResult(plan.step_id, [RequestOutput("a", [100], [])]))  # the host's lookup found nothing
    cached = s.schedule().cached_requests[0]
    # The device looks up every round's drafts (the first starts from padding).
    assert (cached.num_rounds, cached.num_scheduled_tokens, cached.draft_token_ids) == (3, 9, [])


def test_trial_draft_lengths_chain_few_rounds_and_chained_costs_price_chains():
    """The adaptive policy's guesses (no chained round measured yet, a probe) chain only TRIAL_ROUNDS rounds;
    chained steps are priced by their own per-round cost, not by single verification steps."""
    from scheduler_svc.speculation import TRIAL_ROUNDS

    s = make_scheduler(max_draft_tokens=3, max_speculative_rounds=8)
    s.add_request(make_request("a", 6, max_tokens=200))
    plan = s.schedule()
    s.update(StepResult(plan.step_id, [RequestOutput("a", [100], [1, 2, 3])]))
    cached = s.schedule().cached_requests[0]
    assert s.draft_policy.trial and (cached.num_rounds, cached.num_scheduled_tokens) == (TRIAL_ROUNDS, 8)
    policy = DraftLengthPolicy(max_draft_tokens=3)
    for _ in range(4):  # plain steps overlap at 1 ms; a single verification step, serial, costs 3 ms
        policy.observe(1, 0.001, overlapped=True, executor_seconds=0.0)
        policy.observe(4, 0.003, overlapped=False, executor_seconds=0.0, plain=False)
    policy._steps = 1  # not in a probe window
    good = [Candidate("a", 3, 0.6)]  # 1 + 0.6 + 0.36 + 0.216 = 2.2 tokens a verification
    assert policy.choose(good, 0, chainable=False) == 0  # 2.2 tokens / 3 ms lose to 1 / 1 ms
    assert policy.choose(good, 0, chainable=True) == 3 and policy.trial  # no chained round measured: try
    for _ in range(4):  # a chained round costs 1.3 ms: no host round trip between rounds
        policy.observe(4, 0.0013, overlapped=False, executor_seconds=0.0, plain=False, chained=True)
    assert policy.choose(good, 0, chainable=True) == 3 and not policy.trial
    assert policy.choose(good, 0, chainable=False) == 0  # single verification steps still do not pay
    # Forty requests chaining rounds of 160 rows: priced off the 4-row rounds, so a trial again.
    many = [Candidate(str(i), 3, 0.6) for i in range(40)]
    assert policy.choose(many, 0, chainable=True) == 0  # first a plain step of 40, never measured
    assert policy.choose(many, 0, chainable=True) == 3 and policy.trial


def test_chained_rounds_run_past_max_tokens_without_blocks_for_it():
    """Near a request's end its step still chains every round: the executor stops them at the length limit,
    the rows past it write the scratch block (no block of the pool), and the tokens past it are dropped."""
    s = make_scheduler(max_draft_tokens=3, max_speculative_rounds=8, adaptive_draft_length=False)
    s.add_request(make_request("a", 6, max_tokens=10))
    plan = s.schedule()
    s.update(StepResult(plan.step_id, [RequestOutput("a", [100], [1, 2, 3])]))
    plan = s.schedule()
    # 9 more tokens may follow, and 8 rounds of 1 + 3 run; blocks cover the 16 tokens "a" may hold, no more.
    assert (plan.cached_requests[0].num_rounds, plan.cached_requests[0].num_scheduled_tokens) == (8, 32)
    block = s.config.tokens_per_block
    assert len(s.kv.block_table("a")) == -(-16 // block)
    # Three rounds emitted 4 + 4 + 3 tokens, two past the limit: the request ends at max_tokens.
    emitted = list(range(200, 211))
    output = RequestOutput("a", emitted, [], 8, round_accepted=[3, 3, 2], round_drafted=[3, 3, 3])
    (update,) = s.update(StepResult(plan.step_id, [output], step_us=3000))
    assert update.new_token_ids == emitted[:9] and update.finish_reason is FinishReason.LENGTH
    assert s.kv.stats().num_free_blocks == s.config.num_kv_blocks
    # Positions stay within max_seq_len: a request near it chains only the rounds that fit.
    s = make_scheduler(max_draft_tokens=3, max_speculative_rounds=8, adaptive_draft_length=False, max_seq_len=24)
    s.add_request(make_request("b", 6, max_tokens=18))
    plan = s.schedule()
    s.update(StepResult(plan.step_id, [RequestOutput("b", [100], [1, 2, 3])]))
    # 7 tokens held, 17 positions left: four rounds of 1 + 3 write up to position 6 + 3 * 4 + 3.
    assert s.schedule().cached_requests[0].num_rounds == 4


def test_chained_rounds_take_only_free_blocks_and_never_preempt_for_them():
    """Under MAX_UTILIZATION a step asks blocks for every slot its rounds may write; rounds that would need more
    than the free blocks are halved until they fit, rather than preempting a request for slots most drafts will
    not fill."""
    from scheduler_svc.scheduler import CapacityPolicy

    s = make_scheduler(max_draft_tokens=3, max_speculative_rounds=16, adaptive_draft_length=False,
                       capacity_policy=CapacityPolicy.MAX_UTILIZATION, num_kv_blocks=6, max_num_tokens=256)
    for name in ("a", "b"):
        s.add_request(make_request(name, 6, max_tokens=200))
    plan = s.schedule()
    s.update(StepResult(plan.step_id, [RequestOutput(n, [100], [101, 102, 103]) for n in ("a", "b")]))
    assert s.kv.num_free_blocks == 4  # one block each so far
    plan = s.schedule()
    # 16 rounds of 1 + 3 would take each request to 7 + 64 tokens (5 blocks): 8 more blocks than the 4 free.
    # 8 rounds reach 7 + 32 (3 blocks each): 4 more, which fit.
    assert {c.request_id: c.num_rounds for c in plan.cached_requests} == {"a": 8, "b": 8}
    assert s.num_preemptions == 0 and s.kv.num_free_blocks == 0


def test_draft_length_follows_the_measured_step_cost():
    policy = DraftLengthPolicy(max_draft_tokens=4)
    candidates = [Candidate(str(i), 4, 0.7) for i in range(8)]
    assert policy.choose(candidates, 0) == 4  # nothing measured: try the most
    # Memory-bound: a step costs the same whatever its size.
    for tokens in (8, 16, 32, 64):
        policy.observe(tokens, 0.010, overlapped=False, executor_seconds=0.0)
    assert policy.choose(candidates, 0) == 4
    # Compute-bound: time grows with tokens; a 0.7 acceptance does not pay for longer steps.
    policy = DraftLengthPolicy(max_draft_tokens=4)
    for tokens in (8, 16, 32, 64):
        policy.observe(tokens, 0.010 * tokens / 8, overlapped=False, executor_seconds=0.0)
    policy._steps = 10  # not a probe step
    assert policy.choose(candidates, 0) == 0
    # Memory-bound again, but one step at a time costs twice an overlapped step: K = 0 keeps the overlap.
    policy = DraftLengthPolicy(max_draft_tokens=4)
    policy._steps = 10
    for tokens in (8, 16, 32, 40):
        policy.observe(tokens, 0.020, overlapped=False, executor_seconds=0.009)
    policy.observe(8, 0.010, overlapped=True, executor_seconds=0.009)
    assert policy.choose([Candidate(str(i), 4, 0.3) for i in range(8)], 0) == 0  # 1.4 tokens per 20 ms < 1 per 10
    assert policy.choose([Candidate(str(i), 4, 0.9) for i in range(8)], 0) == 4  # 4.1 tokens per 20 ms > 1 per 10
    # One slow measurement (a compilation) does not stick: the median of the recent ones counts.
    policy.costs.observe(16, 0.5)
    policy.costs.observe(16, 0.020)
    assert policy.costs.step_seconds(16) == pytest.approx(0.020)
    assert expected_accepted(0.5, 3) == pytest.approx(0.875)


def test_a_plain_step_is_measured_before_speculation_is_judged_free():
    """Only drafted steps measured (a batch too small for its drafts to stay in the CUDA graphs, say): a
    plain step's cost must not be read off them. The policy runs one plain step, then compares."""
    policy = DraftLengthPolicy(max_draft_tokens=8)
    one = [Candidate("a", 8, 0.2)]
    assert policy.choose(one, 0) == 8  # nothing measured: try the most
    policy.observe(9, 0.008, overlapped=False, executor_seconds=0.007, plain=False)  # an eager 9-row step
    assert policy.choose(one, 0) == 0  # a plain step of 1 token was never measured: run one
    assert policy.drafts_to_propose() == 8 and not policy.allows_overlap()  # ... and keep drafts coming
    policy.observe(1, 0.0015, overlapped=False, executor_seconds=0.0012)
    for _ in range(5):
        assert policy.choose(one, 0) == 0  # 1.25 tokens per 8 ms against 1 per 1.2 ms (the executor's time)
    mixed = DraftLengthPolicy(max_draft_tokens=8)  # the plain step carried a prompt chunk: not measured
    mixed.observe(9, 0.0014, overlapped=False, executor_seconds=0.0013, plain=False)
    assert mixed.choose([Candidate("a", 8, 0.8)], 0) == 0  # tried once ...
    assert mixed.choose([Candidate("a", 8, 0.8)], 0) == 8  # ... then judged on what was measured
    fast = DraftLengthPolicy(max_draft_tokens=8)  # verification that costs little more than a plain step pays
    fast.observe(9, 0.0014, overlapped=False, executor_seconds=0.0013, plain=False)
    assert fast.choose([Candidate("a", 8, 0.8)], 0) == 0  # the plain step, measured once
    fast.observe(1, 0.0013, overlapped=False, executor_seconds=0.0012)
    assert fast.choose([Candidate("a", 8, 0.8)], 0) == 8
    # Every step chained rounds: the plain step is measured all the same, then rounds stop being trials once
    # their size has been measured often enough to count.
    chained = DraftLengthPolicy(max_draft_tokens=8)
    assert chained.choose(one, 0, draining=True, chainable=True) == 8 and chained.trial
    chained.observe(9, 0.0009, overlapped=False, executor_seconds=0.0008, plain=False, chained=True, rounds=2)
    assert chained.choose(one, 0, draining=True, chainable=True) == 0
    chained.observe(1, 0.0013, overlapped=False, executor_seconds=0.0012)
    for _ in range(TRUSTED - 1):
        assert chained.choose([Candidate("a", 8, 0.8)], 0, draining=True, chainable=True) == 8 and chained.trial
        chained.observe(9, 0.0009, overlapped=False, executor_seconds=0.0008, plain=False, chained=True, rounds=2)
    assert chained.choose([Candidate("a", 8, 0.8)], 0, draining=True, chainable=True) == 8 and not chained.trial


def test_a_longer_draft_length_priced_near_the_best_is_measured_again():
    """A size priced from short, slow steps is never chosen, so never measured again, unless the policy runs it
    now and then: every REFRESH_EVERY steps at most, the longest K within REFRESH_MARGIN of the best runs once
    over every round; measured as cheap as the shorter rounds, it is chosen from then on."""
    from scheduler_svc.speculation import REFRESH_EVERY

    def measured() -> DraftLengthPolicy:
        policy = DraftLengthPolicy(max_draft_tokens=8, max_rounds=32)
        policy.observe(1, 0.002, overlapped=False, executor_seconds=0.0019)  # a plain step
        # Rounds of 5 tokens cost 0.9 ms in steps of 32 rounds or 2, each with 1 ms of host work; rounds of 9
        # were seen only in trials and one step cut short, at 1.1 and 0.99 ms.
        for tokens, rounds, seconds in [(5, 32, 0.0009)] * 4 + [(5, 2, 0.0009)] * 2 + [(9, 2, 0.0011)] * 3 + [
                (9, 14, 0.00099)]:
            policy.observe(tokens, (0.001 + rounds * seconds) / rounds, overlapped=False, executor_seconds=0.0,
                           plain=False, chained=True, rounds=rounds)
        return policy

    request = [Candidate("a", 8, 0.5, position_rates=[0.5] * 4 + [0.6] * 4)]
    frozen = measured()
    frozen.refresh = False
    assert {frozen.choose(request, 0, draining=True, chainable=True) for _ in range(3 * REFRESH_EVERY)} == {4}
    policy = measured()
    chosen = [policy.choose(request, 0, draining=True, chainable=True) for _ in range(3 * REFRESH_EVERY)]
    refreshed = [step for step, k in enumerate(chosen) if k == 8]
    assert set(chosen) == {4, 8} and refreshed[0] == REFRESH_EVERY - 1 and policy.refreshes == len(refreshed)
    assert all(b - a > REFRESH_EVERY for a, b in zip(refreshed, refreshed[1:])) and not policy.trial
    # The refresh measures rounds of 9 tokens in a whole step, as cheap as the rest: the chain grows.
    policy = measured()
    chosen = []
    for _ in range(2 * REFRESH_EVERY):
        chosen.append(policy.choose(request, 0, draining=True, chainable=True))
        policy.observe(1 + chosen[-1], (0.001 + 32 * 0.0009) / 32, overlapped=False, executor_seconds=0.0,
                       plain=False, chained=True, rounds=32)
    assert set(chosen[:REFRESH_EVERY - 1]) == {4} and min(chosen[REFRESH_EVERY - 1:]) >= 6


def test_a_slow_first_step_does_not_rule_its_size_out():
    """A size counts once it has a few measurements; until then the measured sizes around it say what it costs."""
    from scheduler_svc.speculation import StepCosts

    costs = StepCosts()
    costs.observe(9, 0.030)  # alone, the first step of its size counts
    assert costs.step_seconds(9) == pytest.approx(0.030)
    for _ in range(3):
        costs.observe(4, 0.002)
    costs.observe(9, 0.030)  # a one-off cost (a kernel loading), twice
    assert costs.step_seconds(9) == pytest.approx(0.002)  # not trusted yet: the measured size next to it counts
    costs.observe(9, 0.0021)
    assert costs.step_seconds(9) == pytest.approx(0.030)  # three measurements: their median
    costs.observe(9, 0.0021)
    costs.observe(9, 0.0021)
    assert costs.step_seconds(9) == pytest.approx(0.0021)


def test_a_draining_batch_speculates_only_when_no_request_gets_slower():
    """With requests waiting, K maximises the batch's tokens per second; with none, the slowest request's."""
    policy = DraftLengthPolicy(max_draft_tokens=4)
    policy._steps = 10  # not a probe step
    for tokens in (8, 16, 32, 64):
        policy.observe(tokens, 0.020, overlapped=False, executor_seconds=0.009)
    policy.observe(8, 0.010, overlapped=True, executor_seconds=0.009)  # overlapped steps cost half
    mixed = [Candidate(str(i), 4, 0.9) for i in range(7)] + [Candidate("poor", 4, 0.1)]
    assert policy.choose(mixed, 0) == 4  # the batch gains: 7 requests get about 4 tokens a step
    assert policy.choose(mixed, 0, draining=True) == 0  # but "poor" would get 1.1 tokens per 20 ms, not 1 per 10
    good = [Candidate(str(i), 4, 0.9) for i in range(8)]
    assert policy.choose(good, 0, draining=True) == 4
    assert policy.choose(good, 8, draining=True) == 0  # other requests in the step have no drafts


def test_probes_back_off_while_speculation_does_not_pay():
    """Each probe that leaves speculation off doubles the wait to the next; speculation paying resets it."""
    from scheduler_svc.speculation import MAX_PROBE_EVERY, PROBE_EVERY, PROBE_STEPS

    policy = DraftLengthPolicy(max_draft_tokens=4)
    for tokens in (8, 16, 32, 64):  # compute-bound: K = 0 wins outside probes
        policy.observe(tokens, 0.010 * tokens / 8, overlapped=False, executor_seconds=0.0)
    low = [Candidate(str(i), 4, 0.3) for i in range(8)]
    probe_starts, was_probing = [], False
    for step in range(2500):
        k = policy.choose(low, 0)
        assert k == (1 if policy._probing() else 0)  # a probe verifies one draft; otherwise off
        if k and not was_probing:
            probe_starts.append(step)
        was_probing = bool(k)
    gaps = [b - a for a, b in zip(probe_starts, probe_starts[1:])]
    assert gaps[0] >= 2 * PROBE_EVERY and gaps == sorted(gaps) and max(gaps) <= MAX_PROBE_EVERY + PROBE_STEPS
    assert len(probe_starts) < 2500 // PROBE_EVERY // 3  # far fewer serial probe steps than a fixed period
    assert policy.refreshes == 0  # no longer K is re-measured while speculation is off
    # Speculation paying again (memory-bound costs, high acceptance): probes come back to the short period.
    for tokens in (8, 16, 32, 64):
        for _ in range(8):
            policy.observe(tokens, 0.010, overlapped=False, executor_seconds=0.0)
    assert policy.choose([Candidate(str(i), 4, 0.9) for i in range(8)], 0) == 4
    assert policy._probe_every == PROBE_EVERY


def test_probes_stay_within_the_executors_batch():
    """A probe verifies one draft for only as many requests as fit under max_step_tokens (past it a step
    leaves the CUDA graphs); a full batch is not probed, and its probe window counts as one that failed."""
    from scheduler_svc.speculation import PROBE_EVERY, PROBE_STEPS

    def policy_after(step_tokens: int) -> DraftLengthPolicy:
        policy = DraftLengthPolicy(max_draft_tokens=4, max_step_tokens=64)
        for tokens in (8, 16, 32, 64, 128):  # compute-bound: K = 0 wins outside probes
            policy.observe(tokens, 0.010 * tokens / 8, overlapped=False, executor_seconds=0.0)
        policy.observe(step_tokens, 0.010 * step_tokens / 8, overlapped=True, executor_seconds=0.0)
        return policy

    policy = policy_after(48)
    candidates = [Candidate(str(i), 4, 0.3) for i in range(48)]
    chosen = [(policy.choose(candidates, 0), policy.verify_limit) for _ in range(PROBE_EVERY + PROBE_STEPS + 1)]
    probes = [c for c in chosen if c[0]]
    assert probes and all(c == (1, 16) for c in probes)  # 48 + 16 drafts = 64 tokens
    assert policy.drafts_to_propose() == 0  # the probe is over
    # As the scheduler drives it: requests have drafts only when the step before asked for them.
    policy = policy_after(64)
    full = [Candidate(str(i), 4, 0.3) for i in range(64)]
    asked, probed_at = 0, []
    for step in range(6 * PROBE_EVERY):
        tokens = 64 if step < 3 * PROBE_EVERY else 48  # a full batch, then some requests finish
        candidates = full[:tokens] if asked else []
        k = policy.choose(candidates, 0) if candidates else (policy.choose([], 0) and 0)  # no drafts: nothing verified
        if k:
            probed_at.append(step)
            assert tokens == 48 and policy.verify_limit == 16
        policy.observe(tokens + (k and 16), 0.010, overlapped=not k, executor_seconds=0.0)
        asked = policy.drafts_to_propose()
    assert probed_at, "probes came back once the batch had room"
    assert policy._probe_every > PROBE_EVERY  # the windows that passed at the full batch counted as probes


# -- end to end ------------------------------------------------------------------


def _generate(engine, tokenizer, prompts, limits=None, sampling=None, max_tokens=20):
    """Outputs and usage for ``prompts`` through a real AsyncEngine over ``engine``; checks for leaks."""
    from inflight.inprocess import InProcessExecutor
    from scheduler_svc.engine_loop import AsyncEngine, EngineLimits

    async def run():
        async_engine = AsyncEngine(InProcessExecutor(engine), tokenizer, EngineLimits(**(limits or {})))
        await async_engine.start()
        try:
            async def one(i, prompt):
                ids, usage = [], None
                request = GenerationRequest(text=prompt, max_tokens=max_tokens, ignore_eos=True, **(sampling or {"temperature": 0.0}))
                async for chunk in async_engine.generate(request):
                    ids.extend(chunk.token_ids)
                    usage = chunk.usage or usage
                return ids, usage

            results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
            sched = async_engine.scheduler
            assert sched.kv.num_free_blocks == sched.config.num_kv_blocks, "KV blocks leaked"
            return [r[0] for r in results], [r[1] for r in results], async_engine.stats()
        finally:
            await async_engine.stop()

    return run_async(run())


def _with_speculation(engine, mode, num_draft_tokens=4, draft=None):
    return dataclasses.replace(engine, speculative=SpeculativeConfig(mode, num_draft_tokens), draft=draft)


@pytest.fixture(scope="module")
def plain_outputs(engine, tokenizer):
    return _generate(engine, tokenizer, COPY_PROMPTS + PROMPTS[:3])[0]


def test_ngram_speculation_gives_the_same_greedy_tokens(engine, tokenizer, plain_outputs):
    spec = _with_speculation(engine, SpeculativeMode.NGRAM)
    outputs, usages, stats = _generate(spec, tokenizer, COPY_PROMPTS + PROMPTS[:3], {"adaptive_draft_length": False})
    assert outputs == plain_outputs
    assert sum(u.num_accepted_draft_tokens for u in usages) > 10  # the copy prompts did accept drafts
    assert stats.drafts.num_draft_tokens == sum(u.num_draft_tokens for u in usages)
    assert stats.drafts.num_accepted == sum(u.num_accepted_draft_tokens for u in usages)


def _mirror(engine, draft):
    """``draft`` with a KV cache of its own, block for block the shape of ``engine``'s."""
    return dataclasses.replace(
        draft, kv_cache=draft.layout.allocate(engine.num_kv_blocks + 1, engine.device),
        num_kv_blocks=engine.num_kv_blocks, decode_graphs=None,
    )


def test_draft_model_speculation_gives_the_same_greedy_tokens(engine, tokenizer, plain_outputs):
    # The target as its own draft: every draft right (until max_tokens cuts the chain).
    spec = _with_speculation(engine, SpeculativeMode.DRAFT_MODEL, 3, draft=_mirror(engine, engine))
    outputs, usages, _ = _generate(spec, tokenizer, COPY_PROMPTS + PROMPTS[:3], {"adaptive_draft_length": False})
    assert outputs == plain_outputs
    drafted = sum(u.num_draft_tokens for u in usages)
    assert drafted > 0 and sum(u.num_accepted_draft_tokens for u in usages) == drafted


@pytest.fixture(scope="module")
def random_draft_engine(engine, tmp_path_factory):
    """A two-layer random-weight model with the default model's vocabulary: its drafts are mostly wrong."""
    from executor_svc.build_config import BuildConfig
    from executor_svc.builder import build_engine
    from executor_svc.engine import RuntimeConfig, load_engine

    folder = tmp_path_factory.mktemp("tiny-draft")
    (folder / "config.json").write_text(json.dumps(tiny_llama_config(engine.model_config.vocab_size)))
    build = BuildConfig(max_batch_size=64, max_num_tokens=4096, max_seq_len=2048, tokens_per_block=16, dtype="float32")
    build_engine(folder, folder / "engine", build, device=TEST_DEVICE, load_format="dummy", progress=False)
    return load_engine(folder / "engine", RuntimeConfig(device=TEST_DEVICE, num_kv_blocks=engine.num_kv_blocks))


def test_wrong_drafts_change_nothing_but_acceptance(engine, tokenizer, plain_outputs, random_draft_engine):
    spec = _with_speculation(engine, SpeculativeMode.DRAFT_MODEL, 3, draft=random_draft_engine)
    outputs, usages, stats = _generate(spec, tokenizer, COPY_PROMPTS + PROMPTS[:3], {"adaptive_draft_length": False})
    assert outputs == plain_outputs
    assert stats.drafts.num_draft_tokens > 0
    assert stats.drafts.num_accepted < stats.drafts.num_draft_tokens / 2


def test_draft_heads_speculation_gives_the_same_greedy_tokens(engine, tokenizer, plain_outputs, tmp_path):
    from executor_svc.speculative.draft_heads import DraftHeads, save_draft_heads

    torch.manual_seed(0)
    heads = DraftHeads(3, engine.model_config.hidden_size, engine.model_config.vocab_size)
    with torch.no_grad():
        heads.weight.normal_(std=0.02)  # some drafts right (a head near zero repeats the next token), most wrong
    save_draft_heads(heads, tmp_path, {"test": True})
    spec = dataclasses.replace(engine, engine_dir=tmp_path, speculative=SpeculativeConfig(SpeculativeMode.DRAFT_HEADS, 4))
    outputs, usages, stats = _generate(spec, tokenizer, COPY_PROMPTS + PROMPTS[:3], {"adaptive_draft_length": False})
    assert outputs == plain_outputs
    assert stats.drafts.num_draft_tokens > 0
    assert len(stats.drafts.by_position) == 3  # the executor offers no more drafts than it has heads


def test_recurrent_head_chained_rounds_give_the_same_greedy_tokens(engine, tokenizer, plain_outputs, tmp_path,
                                                                   monkeypatch):
    """A recurrent head drafting between chained rounds (and for the next step) changes nothing but speed."""
    from executor_svc.speculative.draft_heads import RecurrentDraftHead, save_draft_heads

    calls = _counting_rounds(monkeypatch)
    torch.manual_seed(0)
    head = RecurrentDraftHead(3, engine.model_config.hidden_size, engine.model_config.vocab_size)
    with torch.no_grad():
        head.w_out.normal_(std=0.002)  # a state that drifts a little: early drafts often right, later ones less
    save_draft_heads(head, tmp_path, {"test": True})
    speculative = SpeculativeConfig(SpeculativeMode.DRAFT_HEADS, 3, max_rounds=3)
    spec = dataclasses.replace(engine, engine_dir=tmp_path, speculative=speculative)
    outputs, usages, stats = _generate(spec, tokenizer, COPY_PROMPTS + PROMPTS[:3], {"adaptive_draft_length": False})
    assert outputs == plain_outputs
    assert calls and max(call[2] for call in calls) == 3
    assert stats.drafts.num_accepted == sum(u.num_accepted_draft_tokens for u in usages) > 0
    calls.clear()
    alone, _, _ = _generate(spec, tokenizer, PROMPTS[:1])  # one request, the adaptive policy
    assert alone == plain_outputs[len(COPY_PROMPTS) : len(COPY_PROMPTS) + 1] and calls


def test_loading_a_draft_model_splits_the_kv_budget(engine_dir, random_draft_engine):
    """``RuntimeConfig.speculative`` with a draft engine: both caches get the same block count, paid from one budget."""
    from executor_svc.engine import RuntimeConfig, load_engine

    budget = 128 << 20
    plain = load_engine(engine_dir, RuntimeConfig(device=TEST_DEVICE, kv_cache_bytes=budget))
    spec = SpeculativeConfig(SpeculativeMode.DRAFT_MODEL, 3, draft_engine_dir=random_draft_engine.engine_dir)
    paired = load_engine(engine_dir, RuntimeConfig(device=TEST_DEVICE, kv_cache_bytes=budget, speculative=spec))
    assert paired.draft is not None and paired.draft.num_kv_blocks == paired.num_kv_blocks
    assert paired.draft.kv_cache.shape[2] == paired.num_kv_blocks + 1  # + its scratch block
    per_block = paired.layout.bytes_per_block + paired.draft.layout.bytes_per_block
    assert paired.num_kv_blocks == budget // per_block - 1 < plain.num_kv_blocks
    with pytest.raises(ValueError, match="draft engine folder"):
        load_engine(engine_dir, RuntimeConfig(device=TEST_DEVICE, kv_cache_bytes=budget,
                                              speculative=SpeculativeConfig(SpeculativeMode.DRAFT_MODEL, 3)))


def _counting_rounds(monkeypatch) -> list[tuple[int, int, int, int, bool]]:
    """Record (requests, drafts, rounds planned, rounds run, whether every request finished before the planned
    rounds) of every step of chained rounds the runner launches."""
    from executor_svc.speculative.rounds import RoundsRunner

    calls, real = [], RoundsRunner.run

    def counting(self, requests, num_drafts, num_rounds, next_drafts=0, end_requested=None):
        out = real(self, requests, num_drafts, num_rounds, next_drafts, end_requested)
        calls.append((len(requests), num_drafts, num_rounds, out.num_rounds, out.finished_early))
        return out

    monkeypatch.setattr(RoundsRunner, "run", counting)
    return calls


def test_chained_rounds_give_the_same_greedy_tokens(engine, tokenizer, plain_outputs, monkeypatch):
    calls = _counting_rounds(monkeypatch)
    spec = dataclasses.replace(engine, speculative=SpeculativeConfig(SpeculativeMode.NGRAM, 4, max_rounds=3))
    prompts = COPY_PROMPTS + PROMPTS[:3]
    outputs, usages, stats = _generate(spec, tokenizer, prompts, {"adaptive_draft_length": False})
    assert outputs == plain_outputs
    assert calls and max(call[2] for call in calls) == 3
    assert stats.drafts.num_draft_tokens == sum(u.num_draft_tokens for u in usages)
    assert stats.drafts.num_accepted == sum(u.num_accepted_draft_tokens for u in usages) > 10
    # One request alone (the batch where chaining pays most), with the adaptive policy.
    calls.clear()
    alone, _, _ = _generate(spec, tokenizer, COPY_PROMPTS[:1])
    assert alone == plain_outputs[:1] and calls and all(call[0] == 1 for call in calls)


def test_chained_rounds_with_sampling_stay_valid(engine, tokenizer, monkeypatch):
    calls = _counting_rounds(monkeypatch)
    spec = dataclasses.replace(engine, speculative=SpeculativeConfig(SpeculativeMode.NGRAM, 4, max_rounds=4))
    outputs, _, _ = _generate(spec, tokenizer, COPY_PROMPTS, {"adaptive_draft_length": False},
                                   sampling={"temperature": 0.7, "top_p": 0.9, "seed": 3})
    assert calls and all(len(ids) == 20 for ids in outputs)
    assert all(0 <= t < engine.model_config.vocab_size for ids in outputs for t in ids)


def test_executor_rejects_malformed_rounds(engine):
    from executor_svc.runner import ModelRunner
    from protos.plan import NewRequest

    spec = dataclasses.replace(engine, speculative=SpeculativeConfig(SpeculativeMode.NGRAM, 4, max_rounds=64))
    runner = ModelRunner(spec)
    greedy, block = SamplingConfig(temperature=0.0), engine.tokens_per_block
    runner.execute(StepPlan(1, new_requests=[
        NewRequest("a", [1, 2, 3, 4], 4, 0, 4, list(range(2)), greedy), NewRequest("b", [1, 2, 3, 4], 4, 0, 4, [2, 3], greedy),
    ]))
    cases = [
        (CachedRequest("a", 4, 9, [], [5], num_rounds=2), "rounds * (1 + k)"),  # 9 is not 2 * (1 + k)
        (CachedRequest("a", 4, 130, [], [5], num_rounds=65), "at most"),  # more rounds than the executor chains
        (CachedRequest("a", 4, 4 * block, [], [5], num_rounds=block), "KV slots"),  # past its one block
    ]
    for step, (cached, message) in enumerate(cases, start=2):
        runner.execute(StepPlan(step, finished_request_ids=["a"]))
        runner.execute(StepPlan(step, new_requests=[NewRequest("a", [1, 2, 3, 4], 4, 0, 4, [0], greedy)]))
        assert message in runner.execute(StepPlan(step, cached_requests=[cached])).request_errors["a"]
    # Rounds must make up the whole step: "b" takes one plain step beside them.
    runner.execute(StepPlan(9, new_requests=[NewRequest("a", [1, 2, 3, 4], 4, 0, 4, [0], greedy)]))
    mixed = StepPlan(10, cached_requests=[CachedRequest("a", 4, 8, [], [5], num_rounds=2), CachedRequest("b", 4, 1)])
    result = runner.execute(mixed)
    assert "whole step" in result.request_errors["a"] and "b" not in result.request_errors
    # Past its length limit a request needs no blocks: those rows write the scratch block. Up to the limit it does.
    for step, (limit, table, error) in enumerate([(4 + 10, [0], False), (4 + 2 * block, [0], True)], start=11):
        runner.execute(StepPlan(step, finished_request_ids=["a", "b"]))
        runner.execute(StepPlan(step, new_requests=[NewRequest("a", [1, 2, 3, 4], 4, 0, 4, table, greedy,
                                                               max_num_tokens=limit)]))
        rounds = CachedRequest("a", 4, 4 * block, [], [5], num_rounds=block)
        result = runner.execute(StepPlan(step, cached_requests=[rounds]))
        assert ("KV slots" in result.request_errors.get("a", "")) == error
        if not error:  # the rounds stop once the limit is reached
            (output,) = result.outputs
            assert len(output.token_ids) >= 10 - 1 and len(output.round_accepted) < block


def test_chained_rounds_end_once_every_request_has_finished(engine, tokenizer):
    """A step of chained rounds stops after the round in which its last request emitted a stop id or reached its
    length; it reports the rounds that ran, whose tokens are the ones the full step emits first."""
    from executor_svc.runner import ModelRunner
    from executor_svc.speculative.round_stops import LOOKBEHIND
    from protos.plan import NewRequest

    spec = dataclasses.replace(engine, speculative=SpeculativeConfig(SpeculativeMode.NGRAM, 4, max_rounds=6))
    greedy, prompt = SamplingConfig(temperature=0.0), tokenizer.encode(COPY_PROMPTS[0])

    def rounds_step(stop_token_ids=(), max_num_tokens=0, others=()):
        """One request "a" (and ``others``, without stops) through its first token, then six chained rounds."""
        runner, names = ModelRunner(spec), ["a", *others]
        runner.execute(StepPlan(1, new_requests=[
            NewRequest(name, prompt, len(prompt), 0, len(prompt), list(range(8 * i, 8 * i + 8)), greedy,
                       stop_token_ids=list(stop_token_ids) if name == "a" else [],
                       max_num_tokens=max_num_tokens if name == "a" else 0)
            for i, name in enumerate(names)
        ]))
        cached = [CachedRequest(name, len(prompt), 6 * 5, [], [], num_rounds=6) for name in names]
        result = runner.execute(StepPlan(2, cached_requests=cached))
        assert not result.request_errors
        return result.outputs[0]

    full = rounds_step()
    assert len(full.round_accepted) == 6
    ends = [sum(a + 1 for a in full.round_accepted[: r + 1]) for r in range(6)]  # tokens emitted by each round's end
    # A stop id emitted by the second round: no round runs after the one that first emits it, but on a GPU
    # the one the device was running while the host read that round's flags.
    lag = LOOKBEHIND if torch.device(TEST_DEVICE).type == "cuda" else 0
    stop = full.token_ids[ends[1] - 1]
    ran = min(next(r + 1 for r in range(6) if ends[r] > full.token_ids.index(stop)) + lag, 6)
    stopped = rounds_step(stop_token_ids=[stop, 12345])
    assert len(stopped.round_accepted) == ran < 6 and stopped.round_accepted == full.round_accepted[:ran]
    assert stopped.token_ids == full.token_ids[: ends[ran - 1]]
    assert stopped.next_draft_token_ids == []  # no next step to draft for
    # The length limit: 3 tokens more than the first step's.
    limited = rounds_step(max_num_tokens=len(prompt) + 1 + 3)
    ran = next(r + 1 for r in range(6) if ends[r] >= 3) + lag
    assert len(limited.round_accepted) == ran < 6 and limited.token_ids == full.token_ids[: ends[ran - 1]]
    # A request of the step without stops keeps every round running.
    assert len(rounds_step(stop_token_ids=[stop], others=["b"]).round_accepted) == 6


def test_chained_rounds_end_when_the_scheduler_asks(engine, tokenizer, monkeypatch):
    """``end_rounds``: a step asked to end its chained rounds stops after the round in flight, with the tokens the
    full step emits first and drafts for the next step; asked before it starts, it runs one round; an ask for
    another step changes nothing."""
    from executor_svc.runner import ModelRunner
    from executor_svc.speculative.round_stops import RoundStops
    from protos.plan import NewRequest

    spec = dataclasses.replace(engine, speculative=SpeculativeConfig(SpeculativeMode.NGRAM, 4, max_rounds=6))
    greedy, prompt = SamplingConfig(temperature=0.0), tokenizer.encode(COPY_PROMPTS[2])  # counts on: drafts all along
    ask_after_round = {}  # runner -> the round after which it asks step 2 to end

    real_after_round = RoundStops.after_round

    def after_round(self, rnd, tokens, accepted):
        finished = real_after_round(self, rnd, tokens, accepted)
        for runner, at in ask_after_round.items():
            if rnd == at:
                runner.end_rounds(2)
        return finished

    monkeypatch.setattr(RoundStops, "after_round", after_round)

    def rounds_step(ask_before=None, ask_after=None):
        runner = ModelRunner(spec)
        runner.execute(StepPlan(1, new_requests=[
            NewRequest("a", prompt, len(prompt), 0, len(prompt), list(range(8)), greedy, num_drafts_to_propose=4),
        ]))
        if ask_before is not None:
            runner.end_rounds(ask_before)
        if ask_after is not None:
            ask_after_round[runner] = ask_after
        result = runner.execute(StepPlan(2, cached_requests=[
            CachedRequest("a", len(prompt), 6 * 5, [], [], num_drafts_to_propose=4, num_rounds=6),
        ]))
        ask_after_round.clear()
        assert not result.request_errors
        return result.outputs[0]

    full = rounds_step()
    assert len(full.round_accepted) == 6 and full.next_draft_token_ids
    ends = [sum(a + 1 for a in full.round_accepted[: r + 1]) for r in range(6)]
    for asked, ran in ((rounds_step(ask_after=1), 2), (rounds_step(ask_before=2), 1)):
        assert asked.round_accepted == full.round_accepted[:ran]
        assert asked.token_ids == full.token_ids[: ends[ran - 1]]
        assert asked.next_draft_token_ids  # not finished: the next step gets its drafts
    assert rounds_step(ask_before=3).round_accepted == full.round_accepted  # another step's ask


@pytest.mark.parametrize("transport", ["in_process", "grpc"])
def test_an_arriving_request_ends_a_steps_chained_rounds(engine, tokenizer, monkeypatch, transport):
    """A request that arrives while a step chains many rounds cuts that step short (the scheduler asks the
    executor to end it, in process or over the executor's gRPC service), and both requests still get exactly
    the tokens plain decoding gives them."""
    import threading

    from executor_svc.service import serve_executor
    from inflight.inprocess import InProcessExecutor
    from scheduler_svc.engine_loop import AsyncEngine, EngineLimits
    from scheduler_svc.executor_client import GrpcExecutorConnection

    calls = _counting_rounds(monkeypatch)
    prompts, max_tokens = [COPY_PROMPTS[1], COPY_PROMPTS[2]], 48

    def run(connect, staggered):
        async def go():  # the connection is made here: a gRPC channel needs the running event loop
            async_engine = AsyncEngine(connect(), tokenizer, EngineLimits(adaptive_draft_length=False))
            await async_engine.start()
            try:
                outputs = [[], []]
                second_arrived = asyncio.Event()

                async def one(i):
                    request = GenerationRequest(text=prompts[i], max_tokens=max_tokens, ignore_eos=True,
                                                temperature=0.0)
                    async for chunk in async_engine.generate(request):
                        outputs[i].extend(chunk.token_ids)
                        if i == 0 and staggered and not second_arrived.is_set():
                            second_arrived.set()  # the first chunk is here: its next step is in flight

                async def second():
                    if staggered:
                        await second_arrived.wait()
                    await one(1)

                await asyncio.gather(one(0), second())
                sched = async_engine.scheduler
                assert sched.kv.num_free_blocks == sched.config.num_kv_blocks, "KV blocks leaked"
                return outputs, async_engine.num_rounds_ended
            finally:
                await async_engine.stop()

        return run_async(go())

    plain, _ = run(lambda: InProcessExecutor(engine), staggered=False)
    spec = dataclasses.replace(engine, speculative=SpeculativeConfig(SpeculativeMode.NGRAM, 4, max_rounds=16))
    if transport == "in_process":
        outputs, ended = run(lambda: InProcessExecutor(spec), staggered=True)
    else:
        from tests.servers import free_port

        address = f"127.0.0.1:{free_port()}"
        server, pipeline = serve_executor(spec, address)
        model_thread = threading.Thread(target=pipeline.run_forever, daemon=True)
        model_thread.start()
        try:
            outputs, ended = run(lambda: GrpcExecutorConnection(address), staggered=True)
        finally:
            server.stop(0)
            pipeline.stop()
            model_thread.join(30)
    assert outputs == plain
    assert ended == 1
    # The step the arrival cut short ran fewer rounds than planned, with requests that had not finished.
    assert any(ran < planned and not finished for _, _, planned, ran, finished in calls)


def test_an_executor_without_end_rounds_is_asked_once():
    """An executor of an earlier protocol answers EndRounds with UNIMPLEMENTED: the scheduler's connection takes
    that as no, stops asking, and raises nothing (the step runs its rounds out)."""
    from concurrent import futures

    import grpc

    from protos import executor_pb2_grpc as ex_grpc
    from scheduler_svc.executor_client import GrpcExecutorConnection

    calls = []

    class Earlier(ex_grpc.ExecutorServicer):  # every RPC unimplemented, as before EndRounds existed
        def EndRounds(self, request, context):
            calls.append(request.step_id)
            return super().EndRounds(request, context)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    ex_grpc.add_ExecutorServicer_to_server(Earlier(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        async def ask() -> bool:
            connection = GrpcExecutorConnection(f"127.0.0.1:{port}")
            try:
                for step_id in (3, 4):
                    await connection.end_rounds(step_id)
                return connection._end_rounds_unsupported
            finally:
                await connection.close()

        assert run_async(ask()) and calls == [3]
    finally:
        server.stop(0)


@pytest.mark.parametrize("mode", ["ngram", "draft_heads"])
def test_the_verification_warm_up_runs_overlapping_verifications_and_leaves_nothing_behind(
    mode, engine, tokenizer, tmp_path, monkeypatch
):
    """At load on a GPU, the executor runs a prompt beside a verification and two verifications at once (one
    sampled): those steps verify drafts, leave no request or host-time count behind, and a request served after
    them, on the blocks they wrote, gets the tokens it gets without the warm-up. A failing warm-up step is
    logged and cleaned up, not raised."""
    from executor_svc.runner import ModelRunner
    from executor_svc.speculative.draft_heads import DraftHeads, save_draft_heads
    from protos.plan import NewRequest

    spec = _with_speculation(engine, SpeculativeMode.NGRAM)
    if mode == "draft_heads":
        torch.manual_seed(0)
        heads = DraftHeads(3, engine.model_config.hidden_size, engine.model_config.vocab_size)
        with torch.no_grad():
            heads.weight.normal_(std=0.02)
        save_draft_heads(heads, tmp_path, {"test": True})
        spec = dataclasses.replace(engine, engine_dir=tmp_path,
                                   speculative=SpeculativeConfig(SpeculativeMode.DRAFT_HEADS, 3))

    def serve(runner) -> list[int]:
        """One greedy request, on blocks the warm-up wrote, through its prompt and four verification steps."""
        prompt = tokenizer.encode(COPY_PROMPTS[0])
        greedy, table = SamplingConfig(temperature=0.0), list(range(8))
        result = runner.execute(StepPlan(1, new_requests=[NewRequest("a", prompt, len(prompt), 0, len(prompt),
                                                                     table, greedy, num_drafts_to_propose=3)]))
        tokens = list(result.outputs[0].token_ids)
        for step in range(2, 6):
            drafts = result.outputs[0].next_draft_token_ids
            computed = runner.requests["a"].num_computed_tokens
            result = runner.execute(StepPlan(step, cached_requests=[
                CachedRequest("a", computed, 1 + len(drafts), [], drafts, num_drafts_to_propose=3)]))
            assert not result.request_errors
            tokens += result.outputs[0].token_ids
        return tokens

    plain = serve(ModelRunner(spec))
    warmed = ModelRunner(spec)
    assert warmed.warm_up_verification() > 0
    assert not warmed.requests and not any(warmed.host_seconds.values())
    assert serve(warmed) == plain

    import executor_svc.runner as runner_module

    def broken(*args, **kwargs):
        raise RuntimeError("broken verification")

    monkeypatch.setattr(runner_module, "verify_drafts", broken)
    failing = ModelRunner(spec)
    assert failing.warm_up_verification() == 0 and not failing.requests


def test_sampled_requests_speculate_and_stay_valid(engine, tokenizer):
    spec = _with_speculation(engine, SpeculativeMode.NGRAM)
    outputs, usages, _ = _generate(spec, tokenizer, COPY_PROMPTS, sampling={"temperature": 0.7, "top_p": 0.9})
    assert all(len(ids) == 20 for ids in outputs)
    assert sum(u.num_draft_tokens for u in usages) > 0


def test_executor_rejects_malformed_drafts(engine):
    from executor_svc.runner import ModelRunner
    from protos.plan import NewRequest

    runner = ModelRunner(_with_speculation(engine, SpeculativeMode.NGRAM))
    table = list(range(4))
    first = StepPlan(1, new_requests=[NewRequest("a", [1, 2, 3, 4], 4, 0, 4, table, SamplingConfig(temperature=0.0), 2)])
    runner.execute(first)
    bad = StepPlan(2, cached_requests=[CachedRequest("a", 4, 2, [], draft_token_ids=[5, 6])])  # 2 drafts need 3 tokens
    result = runner.execute(bad)
    assert "drafts" in result.request_errors["a"] and "a" not in runner.requests


def test_a_failing_proposer_costs_drafts_not_the_step(engine):
    from executor_svc.runner import ModelRunner
    from protos.plan import NewRequest

    runner = ModelRunner(_with_speculation(engine, SpeculativeMode.NGRAM))

    def broken(requests):
        raise RuntimeError("proposer fault")

    runner.proposer.propose = broken
    plan = StepPlan(1, new_requests=[NewRequest("a", [1, 2, 3, 4], 4, 0, 4, list(range(4)), SamplingConfig(temperature=0.0), 2)])
    result = runner.execute(plan)
    assert not result.request_errors and len(result.outputs[0].token_ids) == 1
    assert result.outputs[0].next_draft_token_ids == []


def test_a_fault_applying_a_steps_results_fails_that_steps_requests_only(engine):
    """A fault in the executor's bookkeeping after a step (here: recording a request's tokens) fails the requests of
    that step with a message naming it; the executor keeps the others and serves the next step."""
    from executor_svc.runner import ModelRunner
    from protos.plan import NewRequest

    runner = ModelRunner(_with_speculation(engine, SpeculativeMode.NGRAM))
    greedy = SamplingConfig(temperature=0.0)
    runner.execute(StepPlan(1, new_requests=[
        NewRequest("a", [1, 2, 3, 4], 4, 0, 4, list(range(4)), greedy, 2),
        NewRequest("b", [5, 6, 7, 8], 4, 0, 4, list(range(4, 8)), greedy, 2),
    ]))
    emit = runner._emit

    def faulty(request_id, *args):
        if request_id == "a":
            raise RuntimeError("bookkeeping fault")
        return emit(request_id, *args)

    runner._emit = faulty
    result = runner.execute(StepPlan(2, cached_requests=[CachedRequest("a", 4, 1, [])]))
    assert set(result.request_errors) == {"a"} and "bookkeeping fault" in result.request_errors["a"]
    assert not result.outputs and "a" not in runner.requests and "b" in runner.requests
    runner._emit = emit
    result = runner.execute(StepPlan(3, cached_requests=[CachedRequest("b", 4, 1, [])]))
    assert not result.request_errors and len(result.outputs[0].token_ids) == 1


def test_acceptance_learns_that_drafts_are_accepted_in_runs():
    from scheduler_svc.speculation import Acceptance

    runs = Acceptance()
    for _ in range(30):  # a copy found and followed to the end, then a guess rejected at once
        runs.observe(8, 8)
        runs.observe(8, 0)
    assert runs.rate == pytest.approx(0.5, abs=0.05) and runs.continuation > 0.95
    # Half the verifications accept nothing, the others all eight: about four a verification.
    assert expected_accepted(runs.rate, 8, runs.continuation) == pytest.approx(4.0, abs=0.5)
    one_by_one = Acceptance()
    for _ in range(60):
        one_by_one.observe(4, 1)  # the first draft stands, the second never does
    assert one_by_one.rate > 0.95 and one_by_one.continuation < 0.05
    assert expected_accepted(0.5, 3, 0.5) == expected_accepted(0.5, 3) == pytest.approx(0.875)


def test_where_a_longer_draft_costs_no_more_runs_of_acceptance_choose_it():
    policy = DraftLengthPolicy(max_draft_tokens=15)
    policy.overlap_available = False
    for _ in range(4):  # a round of 2 to 16 rows costs the same: one tile
        policy.observe(1, 0.010, overlapped=False, executor_seconds=0.0)
        policy.observe(16, 0.012, overlapped=False, executor_seconds=0.0, plain=False, chained=True)
        policy.observe(2, 0.012, overlapped=False, executor_seconds=0.0, plain=False, chained=True)
    bursty = policy.choose([Candidate("a", 15, 0.5, 0.95)], 0, chainable=True)
    alike = policy.choose([Candidate("a", 15, 0.5)], 0, chainable=True)
    assert bursty == 15 and alike < 8


def test_acceptance_by_position_sees_drafts_of_two_kinds():
    """Draft heads' four guesses, then a lookup's copied run past them where a copy is found: the record of each
    position tells them apart, where one continuation fitted to all drafts rates the copy too low."""
    from scheduler_svc.speculation import Acceptance

    mixed = Acceptance()
    for i in range(200):  # eight slots a round; the heads' guesses stand to the fourth one round in four
        if i % 4 == 0:
            mixed.observe(8, 8, 8)  # ... and then a copy found, all eight stand
        elif i % 4 == 1:
            mixed.observe(4, 4, 8)  # ... no copy: the slots past four are padding, and the fifth is rejected
        else:
            mixed.observe(4, 0, 8)
    rates = mixed.position_rates(8)  # decayed counts: the latest verifications weigh most
    assert rates[0] == pytest.approx(0.5, abs=0.1)
    assert min(rates[1:4]) > 0.95  # once the first stands, so do the heads' others
    assert rates[4] == pytest.approx(0.5, abs=0.1)  # half the rounds that reach the fifth find a copy
    assert min(rates[5:]) > 0.95
    # The truth: each round accepts 8, 4, 0 or 0, so 3 a round at K = 8 and 2 at K = 4.
    by_position = expected_accepted(0, 8, position_rates=rates) - expected_accepted(0, 4, position_rates=rates)
    assert expected_accepted(0, 4, position_rates=rates) == pytest.approx(2.0, abs=0.25)
    assert by_position == pytest.approx(1.0, abs=0.2)
    pooled = expected_accepted(mixed.rate, 8, mixed.continuation) - expected_accepted(mixed.rate, 4, mixed.continuation)
    assert pooled > 1.5  # one continuation of about 1 (every later draft stood) counts eight for every copy
    fresh = Acceptance()  # nothing observed: every position is the prior
    assert fresh.position_rates(3) == pytest.approx([0.6, 0.6, 0.6])
    padded = Acceptance()  # the heads' four, never anything past them: the chain ends at the fourth
    for i in range(100):
        padded.observe(4, 4 if i % 2 else 0, 8)
    assert padded.position_rates(8)[4] < 0.1 and max(padded.position_rates(8)[5:]) < 0.1


def test_accepted_curve_is_expected_accepted_at_every_length():
    """The policy prices every draft length from one curve per candidate: the same numbers as expected_accepted
    at each length, held at the candidate's own most drafts past them."""
    import random

    from scheduler_svc.speculation import accepted_curve

    rng = random.Random(1)
    for _ in range(300):
        k, top = rng.randint(0, 8), 8
        rate, continuation = rng.random(), rng.choice([None, rng.random()])
        rates = rng.choice([None, [rng.random() for _ in range(rng.randint(1, 12))]])
        curve = accepted_curve(rate, k, continuation, rates, top)
        assert len(curve) == top + 1
        assert curve == pytest.approx([expected_accepted(rate, min(d, k), continuation, rates) for d in range(top + 1)])


def test_acceptance_by_position_chooses_the_chain_length_that_pays():
    """Rounds of 9 rows cost 5% more than rounds of 5. Where copies follow the heads' four guesses, eight drafts
    pay; where nothing does (the slots past four are padding), four do. The pooled continuation never sees a padded
    slot rejected (only real guesses count), so it takes eight in both."""
    from scheduler_svc.speculation import Acceptance

    policy = DraftLengthPolicy(max_draft_tokens=8)
    policy.overlap_available = False
    for _ in range(4):
        policy.observe(1, 0.0010, overlapped=False, executor_seconds=0.0)
        policy.observe(5, 0.00100, overlapped=False, executor_seconds=0.0, plain=False, chained=True, rounds=16)
        policy.observe(9, 0.00105, overlapped=False, executor_seconds=0.0, plain=False, chained=True, rounds=16)
    policy._steps = 1
    chosen = {}
    for name, pattern in {"copies": ((8, 8, 8), (4, 4, 8), (4, 0, 8), (4, 0, 8)),
                          "heads alone": ((4, 4, 8), (4, 4, 8), (4, 0, 8), (4, 0, 8))}.items():
        record = Acceptance()
        for i in range(100):
            record.observe(*pattern[i % 4])
        by_position = Candidate("a", 8, record.rate, record.continuation, record.position_rates(8))
        pooled = Candidate("a", 8, record.rate, record.continuation)
        chosen[name] = (policy.choose([by_position], 0, chainable=True), policy.choose([pooled], 0, chainable=True))
    assert chosen == {"copies": (8, 8), "heads alone": (4, 8)}


def test_chained_costs_tell_a_steps_host_work_from_its_rounds():
    """A chained step of R rounds costs host + R * round: a trial's two rounds or a request's last step cut short
    price a round above what a full chain of the same size costs, once host and rounds are fitted together."""
    from scheduler_svc.speculation import ChainedCosts

    costs = ChainedCosts()
    for _ in range(3):  # 2 ms of host work a step; a round of 5 tokens costs 1.0 ms, one of 9 tokens 1.05
        costs.observe(5, (2.0 + 16 * 1.0) / 16 * 1e-3, 16)
        costs.observe(9, (2.0 + 2 * 1.05) / 2 * 1e-3, 2)
    assert costs.round_seconds(9, 2) == pytest.approx(2.05e-3)  # one size, one length: its share, as measured
    costs.observe(9, (2.0 + 16 * 1.05) / 16 * 1e-3, 16)
    host, points = costs.fit()
    assert host == pytest.approx(2.0e-3) and points == [(5, pytest.approx(1.0e-3)), (9, pytest.approx(1.05e-3))]
    assert costs.round_seconds(9, 16) == pytest.approx(1.05e-3 + 2.0e-3 / 16)
    assert costs.round_seconds(7, 16) == pytest.approx(1.025e-3 + 2.0e-3 / 16)  # between the two sizes
    costs.observe(5, 0.050, 16)  # a step that paused: over three times its size's cheapest round, left out
    assert costs.fit()[0] == pytest.approx(2.0e-3)
    alone = ChainedCosts()  # every step the same length: the host's share stays in the rounds
    alone.observe(5, 1.125e-3, 16)
    assert alone.fit() == (0.0, [(5, pytest.approx(1.125e-3))])
    assert alone.round_seconds(5, 16) == pytest.approx(1.125e-3) and not alone.covers(9)
    assert not alone.covers(4)  # measured once: a guess until it has been measured TRUSTED times
    for _ in range(TRUSTED - 1):
        alone.observe(5, 1.125e-3, 16)
    assert alone.covers(4) and not alone.covers(9)


def test_a_chained_step_runs_only_the_rounds_that_fit_its_time_limit():
    """With ``max_chained_step_seconds`` a step chains no more rounds than the measured host share and round cost
    fit in it (its requests' tokens stream when it ends), at least one; the policy prices draft lengths by the
    rounds it will run; without a measurement, or with no limit, it chains every round it may."""
    from scheduler_svc.speculation import ChainedCosts

    costs = ChainedCosts()
    assert costs.rounds_within(4, 32, 0.02) == 32  # nothing measured yet
    for rounds in (2, 16, 16):  # 2 ms of host work a step, 3 ms a round of 4 tokens
        costs.observe(4, (2.0 + rounds * 3.0) / rounds * 1e-3, rounds)
    assert costs.rounds_within(4, 32, 0.02) == 6  # 2 + 6 * 3 = 20 ms
    assert costs.rounds_within(4, 4, 0.02) == 4 and costs.rounds_within(4, 32, 0.0) == 32
    assert costs.rounds_within(4, 32, 0.003) == 1  # one round takes longer than the limit: one round a step

    def rounds_planned(limit: float) -> int:
        s = make_scheduler(max_draft_tokens=3, max_speculative_rounds=32, adaptive_draft_length=False,
                           max_num_tokens=256, max_chained_step_seconds=limit)
        s.draft_policy.chained_costs = costs
        s.add_request(make_request("a", 6, max_tokens=400))
        plan = s.schedule()
        s.update(StepResult(plan.step_id, [RequestOutput("a", [100], [1, 2, 3])]))
        return s.schedule().cached_requests[0].num_rounds

    assert rounds_planned(0.02) == 6 and rounds_planned(0.0) == 32
    policy = DraftLengthPolicy(max_draft_tokens=3, max_rounds=32, max_chained_step_seconds=0.02)
    policy.chained_costs, policy._chainable = costs, True  # as choose() sets it for a step that may chain
    assert policy.chained_rounds(4) == 6
    assert policy._cost(3, 4) == pytest.approx(3e-3 + 2e-3 / 6)  # the host's share over the rounds that run


def test_a_slow_first_chained_step_does_not_rule_its_size_out():
    """A fresh process's first chained step of a size may pay for what warms up. Priced off it alone, the size
    would never be chosen, so never measured again: it counts once measured TRUSTED times, and until then the
    sizes that count price it, so the policy comes back to it and measures it."""
    policy = DraftLengthPolicy(max_draft_tokens=8)
    heads = [Candidate("a", 8, 0.45, position_rates=[0.45, 0.7, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8])]
    assert policy.choose(heads, 0, chainable=True) == 8 and policy.trial  # nothing measured: try the most
    # Its two rounds took 4 ms each (a first step of its size) ...
    policy.observe(9, 0.004, overlapped=False, executor_seconds=0.0, plain=False, chained=True, rounds=2)
    assert policy.choose(heads, 0, chainable=True) == 0  # the plain step, measured once
    policy.observe(1, 0.00075, overlapped=True, executor_seconds=0.0007)
    for _ in range(TRUSTED):  # rounds of one draft (probes, then steps of one draft) measured warm
        policy.observe(2, 0.0008, overlapped=False, executor_seconds=0.0, plain=False, chained=True, rounds=16)
    # ... while a warm round of 9 tokens costs 0.85 ms: the one slow step no longer prices the size.
    assert policy.choose(heads, 0, chainable=True) == 8 and policy.trial
    for _ in range(TRUSTED - 1):
        policy.observe(9, 0.00085, overlapped=False, executor_seconds=0.0, plain=False, chained=True, rounds=2)
        assert policy.choose(heads, 0, chainable=True) == 8
    policy.observe(9, 0.00085, overlapped=False, executor_seconds=0.0, plain=False, chained=True, rounds=16)
    assert policy.choose(heads, 0, chainable=True) == 8 and not policy.trial  # counted: the 4 ms step left out
