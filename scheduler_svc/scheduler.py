"""Inflight batching: decide, every step, which requests compute which tokens.

One rule (the one vLLM v1 states at the top of its scheduler): each request
has ``num_computed_tokens`` and holds ``num_tokens`` tokens; a step gives each
scheduled request some of the ``num_tokens - num_computed_tokens`` tokens it
is missing. Context, chunked context and generation are that rule with
different counts, and so are the rest: a prefix-cache hit starts a request at
``num_computed_tokens`` = its cached prefix; a preempted request drops back to
0 and resumes (prompt + output so far) from its cached prefix again.

Order within a step follows TensorRT-LLM: requests already running go first
(by priority; within one, generation work, then context chunks still in
progress), then waiting requests by priority and arrival, until
``max_batch_size`` requests or ``max_num_tokens`` tokens are used. A context
chunk that does not finish its prompt is cut to a multiple of
``tokens_per_block``, so every chunk but the last fills whole blocks.

Capacity policies (TensorRT-LLM's names):

* GUARANTEED_NO_EVICT (default): a waiting request starts only when blocks for
  its whole lifetime (prompt + max_tokens) can be set aside, so a running
  request never runs out and is never preempted. Priorities change only the
  order of the waiting queue: preempting a running request would break the
  very promise this policy makes to it.
* MAX_UTILIZATION: a request starts as soon as its first step's blocks are
  free. When a running request needs a block and none is free, a running
  request is preempted (lowest priority, then least computed work): its blocks
  are freed, its full blocks stay in the prefix cache, and it goes back to the
  front of its priority in the waiting queue. A waiting request that does not
  fit may likewise preempt running requests of strictly lower priority.

Speculative decoding is the same rule once more: a request in generation
with drafts from the executor computes 1 + k tokens (its last token and k
drafts) and ``num_computed_tokens`` moves past them; when the result says a
of the k were accepted it moves back by k - a, and the rejected drafts' slots
are simply written again by the next step. How long k is follows the load
(``speculation.py``). Speculation needs each step's result before the next
plan, so it runs without overlapped scheduling (which comes back while the
load keeps speculation off). What overlap would hide, the round trip between
one verification and the next, chained rounds hide instead: when none waits and
every running request is in generation (``_chain_draft_limit``, which also caps
k so that a round's rows fit the executor's batch), a step may run up to
``max_speculative_rounds`` rounds of k drafts for every request, the executor
looking up the later rounds' drafts on the device (a request the host had no
drafts for starts from padding); the step computes R * (1 + k) tokens per
request, and the result moves ``num_computed_tokens`` back past what the rounds
did not emit. Rounds are not cut to a request's max_tokens: the executor ends
the step once every request reached its limit and writes the rows past it into
its scratch block, and the tokens past the limit are dropped here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter

from kvcache.block_hash import BlockHashes, BlockKeys
from kvcache.manager import KVCacheManager
from protos.plan import BlockCopy, CachedRequest, NewRequest, RequestOutput, StepPlan, StepResult
from scheduler_svc.request import FinishReason, Request, RequestStatus
from scheduler_svc.scheduler_config import CapacityPolicy, SchedulerConfig
from scheduler_svc.speculation import TRIAL_ROUNDS, Candidate, DraftLengthPolicy, DraftStats
from scheduler_svc.waiting_queue import WaitingQueue

__all__ = ["CapacityPolicy", "RequestUpdate", "Scheduler", "SchedulerConfig"]


@dataclass(slots=True)
class RequestUpdate:
    """What one request got from one step."""

    request: Request
    new_token_ids: list[int]
    finish_reason: FinishReason | None


@dataclass(slots=True)
class _Scheduled:
    request: Request
    num_tokens: int
    new_blocks: list[int]
    drafts: list[int] = field(default_factory=list)  # verified this step (num_tokens = 1 + len)
    propose: int = 0  # drafts the executor proposes for the request's next step
    rounds: int = 1  # chained verification rounds (num_tokens = rounds * (1 + the step's draft length))


@dataclass(slots=True)
class _Step:
    """What the step being planned has decided so far."""

    token_budget: int
    chosen: dict[str, _Scheduled] = field(default_factory=dict)
    # Drafts each request is asked for, for its next step (0: speculation is off and not probing).
    drafts_to_propose: int = 0
    preempted: set[str] = field(default_factory=set)


_priority_of = attrgetter("priority")


def _victim_order(request: Request) -> tuple[int, int, float]:
    """Preempted first: lowest priority, then least computed work, then latest arrival."""
    return request.priority, request.num_computed_tokens, -request.arrival_time


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv = KVCacheManager(
            config.num_kv_blocks, config.tokens_per_block, config.enable_prefix_caching, config.num_host_blocks
        )
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._dropped_ids: list[str] = []  # executor state to drop in the next plan
        self._sampling: dict[int, list[str]] = {}  # step id -> requests that step samples a token for
        self._step_id = 0
        self.num_preemptions = 0
        self.drafts = DraftStats(by_position=[0] * config.max_draft_tokens,
                                 accepted_by_position=[0] * config.max_draft_tokens)
        self.draft_policy = DraftLengthPolicy(
            config.max_draft_tokens, config.adaptive_draft_length, config.max_batch_size,
            max(config.max_speculative_rounds, 1), config.max_chained_step_seconds,
        )
        self._drafts_asked = False  # whether the last plan asked any request for drafts
        # step id -> (tokens per round, rounds, whether it verified drafts) of generation steps in flight
        self._generation_steps: dict[int, tuple[int, int, bool]] = {}

    @property
    def guaranteed(self) -> bool:
        return self.config.capacity_policy is CapacityPolicy.GUARANTEED_NO_EVICT

    # -- requests in and out -----------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        request.block_hashes = BlockHashes(self.config.tokens_per_block, BlockKeys(request.cache_salt))
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request_id: str, reason: FinishReason, error: str = "") -> Request | None:
        """End a request for any reason; its blocks go back to the pool at once."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.kv.free(request_id)
            if request.sent_to_executor:
                self._dropped_ids.append(request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.error = error
        return request

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- one step ----------------------------------------------------------

    def schedule(self) -> StepPlan:
        step = _Step(token_budget=self.config.max_num_tokens)
        self._schedule_running(step)
        self._admit_waiting(step)
        return self._build_plan(step)

    def _schedule_running(self, step: _Step) -> None:
        order = self._running_order()
        chain_limit = self._chain_draft_limit(order)
        draft_length, drafts_of = self._choose_draft_length(order, chain_limit)
        rounds = self._chained_rounds(order, draft_length, chain_limit > 0)
        max_seq_len = self.config.max_seq_len
        propose_now = self.draft_policy.drafts_to_propose() if self.config.max_draft_tokens else 0
        step.drafts_to_propose = propose_now
        asked = False
        allocate_slots = self.kv.allocate_slots
        chosen = step.chosen
        running = RequestStatus.RUNNING
        for request in order:
            if request.status is not running:
                continue  # preempted earlier in this step
            if request.num_scheduled_drafts:
                continue  # its drafts are being verified: its length is unknown until the result
            num_output = len(request.output_token_ids)
            pending = request.num_pending_outputs
            held = len(request.prompt_token_ids) + num_output + pending
            if pending and (num_output + pending >= request.stopping.max_tokens or held >= max_seq_len):
                continue  # its last token is already on its way
            request_id = request.request_id
            computed = request.num_computed_tokens
            budget = step.token_budget
            drafts = drafts_of.get(request_id, [])[:max(0, min(draft_length, budget - 1))] if drafts_of else []
            if rounds > 1:  # every request chains the same rounds (the executor pads short drafts)
                count = rounds * self.config.round_rows(draft_length)
            elif drafts:
                count = 1 + len(drafts)
            else:
                missing = held - computed
                count = missing if missing <= budget else self._chunk(missing, budget)
                if count == 0:
                    continue
            if not propose_now:
                propose = lookahead = 0
            elif rounds > 1:
                # Where chained rounds leave the request is known only from their result (and may be its end):
                # the next step cuts these drafts to its room then.
                propose, lookahead = (propose_now if request.can_speculate else 0), 0
            else:
                propose, lookahead = self._propose_for(request, computed + count, held, propose_now)
            asked = asked or propose > 0
            if rounds > 1:  # (no lookahead: chained rounds draft on the device)
                need = self._rounds_slots(request, draft_length, rounds)
            else:
                need = computed + count + lookahead
            new_blocks = allocate_slots(request_id, need)
            while new_blocks is None:  # no free block: MAX_UTILIZATION preempts (the other policy reserved them)
                assert not self.guaranteed, "a GUARANTEED_NO_EVICT request ran out of reserved blocks"
                victim = min(self.running, key=_victim_order)
                self._preempt(victim, step)
                if victim is request:
                    break
                new_blocks = allocate_slots(request_id, need)
            if new_blocks is not None:
                chosen[request_id] = _Scheduled(request, count, new_blocks, drafts, propose, rounds)
                step.token_budget -= count
        self._drafts_asked = asked

    def _running_order(self) -> list[Request]:
        """By priority; within one, generation work (one missing token) before context in progress."""
        running = self.running
        in_context = [len(r.prompt_token_ids) + len(r.output_token_ids) - r.num_computed_tokens > 1 for r in running]
        if True not in in_context and len(set(map(_priority_of, running))) <= 1:
            return list(running)  # the steady state: all in generation at one priority, sorting keeps the order
        keys = [(-r.priority, context) for r, context in zip(running, in_context)]
        return [running[i] for i in sorted(range(len(keys)), key=keys.__getitem__)]

    # -- speculative decoding ----------------------------------------------------

    def _drafts_for(self, request: Request) -> list[int]:
        """The drafts ``request`` may verify this step, cut to its limits (empty: a plain step)."""
        if not request.draft_token_ids or request.num_pending_outputs or not request.can_speculate:
            return []
        if request.num_computed_tokens != request.num_tokens - 1:
            return []
        # k drafts emit up to k + 1 tokens: stay within max_tokens and max_seq_len.
        room = min(
            request.stopping.max_tokens - len(request.output_token_ids), self.config.max_seq_len - request.num_tokens
        ) - 1
        return request.draft_token_ids[: max(0, room)]

    def _chain_draft_limit(self, order: list[Request]) -> int:
        """The most drafts per request this step may chain verification rounds with; 0: it may not chain.

        It may when the executor can, no request waits (it would wait for every round), every running
        request is in generation, its last token known, and may speculate. The rows of a round (a
        request's last token and its drafts) must stay within the executor's batch: past it a round
        leaves the CUDA graphs and waits for the host, and chaining would gain nothing. So a batch too
        large for the longest chains still chains shorter ones (64 requests in a batch of 256: up to 3).
        With tree drafts a round of k drafts has more rows (``SchedulerConfig.round_rows``).
        """
        cfg = self.config
        if cfg.max_speculative_rounds <= 1 or not cfg.max_draft_tokens or self.waiting or not order:
            return 0
        fits = cfg.max_batch_size // len(order)
        limit = max((k for k in range(1, cfg.max_draft_tokens + 1) if cfg.round_rows(k) <= fits), default=0)
        if limit < 1:
            return 0
        chainable = all(
            r.can_speculate and not r.num_pending_outputs and not r.num_scheduled_drafts
            and r.num_computed_tokens == r.num_tokens - 1
            for r in order
        )
        return limit if chainable else 0

    def _choose_draft_length(self, order: list[Request], chain_limit: int) -> tuple[int, dict[str, list[int]]]:
        """The step's draft length, and the drafts each request may verify (cut to its limits);
        ``chain_limit`` from ``_chain_draft_limit``."""
        if not self.config.max_draft_tokens:
            return 0, {}
        chainable = chain_limit > 0
        if not self._drafts_asked and not chainable:  # no plan asked for drafts since the last step: none to look for
            return self.draft_policy.choose([], 0), {}
        candidates, other, drafts_of = [], 0, {}
        for request in order:
            drafts = self._drafts_for(request)
            if drafts or chainable:
                drafts_of[request.request_id] = drafts
                # Chained rounds verify K drafts for every request: the device looks up what the host did not.
                num_drafts = chain_limit if chainable else len(drafts)
                acceptance = request.acceptance
                candidates.append(Candidate(request.request_id, num_drafts, acceptance.rate, acceptance.continuation,
                                            acceptance.position_rates(num_drafts)))
            elif not request.num_scheduled_drafts:
                other += min(request.num_tokens - request.num_computed_tokens, self.config.max_num_tokens)
        other = min(other, self.config.max_num_tokens)
        draft_length = self.draft_policy.choose(candidates, other, draining=not self.waiting, chainable=chainable,
                                                asked=self._drafts_asked)
        if chainable:  # longer chains would not fit the executor's batch (the policy prices them as no longer)
            draft_length = min(draft_length, chain_limit)
        limit = self.draft_policy.verify_limit
        if limit is not None:  # a probe with room for only some of them: the first in order verify
            drafts_of = {c.request_id: drafts_of[c.request_id] for c in candidates[:limit]}
        return draft_length, drafts_of

    def _chained_rounds(self, order: list[Request], draft_length: int, chainable: bool) -> int:
        """Verification rounds for this step: more than one only when the step may chain them
        (``_chain_draft_limit``; a request without drafts of its own starts from padding, and the device looks up
        its later rounds' drafts), drafts are verified, and their rows stay within max_seq_len (not max_tokens);
        at most ``TRIAL_ROUNDS`` when the draft length is the policy's trial (priced by a guess, or a probe),
        which then costs two rounds if wrong, not every round; and no more than the measured costs fit in
        ``max_chained_step_seconds`` (a stream gets the step's tokens when it ends)."""
        cfg = self.config
        policy = self.draft_policy
        if not chainable or draft_length <= 0 or policy.verify_limit is not None:
            return 1
        rows = cfg.round_rows(draft_length)
        rounds = min(policy.chained_rounds(rows * len(order)), cfg.max_num_tokens // (rows * len(order)))
        if policy.trial:
            rounds = min(rounds, TRIAL_ROUNDS)
        for request in order:
            # Rounds may run past max_tokens: the executor stops them once every request has reached its limit,
            # this scheduler keeps no token past it, and the rows past what a request may hold write their KV
            # into the executor's scratch block. Capping them there instead made every step near a request's end
            # a short one, each paying a step's host round trip. Positions must stay within max_seq_len.
            room = cfg.max_seq_len - request.num_tokens
            rounds = min(rounds, (room - rows) // (1 + draft_length) + 1 if room >= rows else 0)
        return self._rounds_within_free_blocks(order, draft_length, max(1, rounds))

    def _rounds_within_free_blocks(self, order: list[Request], draft_length: int, rounds: int) -> int:
        """``rounds``, halved until every request's slots for them come from its reservation or free blocks.
        The rounds reserve slots for every draft accepted (most of them are not), and taking those from
        other requests (MAX_UTILIZATION preempts for blocks) would make speculation cost the batch work."""
        kv = self.kv
        free = kv.num_free_blocks
        while rounds > 1:
            wanted = sum(kv.unreserved_blocks_for(r.request_id, self._rounds_slots(r, draft_length, rounds))
                         for r in order)
            if wanted <= free:
                break
            rounds //= 2
        return rounds

    def _rounds_slots(self, request: Request, draft_length: int, rounds: int) -> int:
        """The KV slots ``request`` needs for a step of ``rounds`` chained rounds. Chained tree rounds compute
        more tokens than they can leave in the cache (``rounds_kv_span``); slots past what the request may ever
        hold are not allocated: rows there go to the executor's scratch block."""
        span = self.config.rounds_kv_span(draft_length, rounds)
        return min(request.num_computed_tokens + span, request.max_total_tokens)

    def _propose_for(self, request: Request, computed_after: int, held: int, wanted: int) -> tuple[int, int]:
        """(drafts to ask for the request's next step, KV slots past its tokens that proposing them writes).

        ``computed_after`` is where this step leaves ``num_computed_tokens``; nothing is
        proposed unless this step samples the request's next token. ``wanted``: what the
        draft-length policy asks every request for this step.
        """
        cfg = self.config
        if not request.can_speculate or computed_after < held:
            return 0, 0
        limit = min(request.max_total_tokens, cfg.max_seq_len) - computed_after
        propose = max(0, min(wanted, limit))
        return propose, propose if cfg.draft_lookahead_slots else 0

    def _admit_waiting(self, step: _Step) -> None:
        cfg = self.config
        while self.waiting and step.token_budget > 0:
            request = self.waiting.peek()
            if request.request_id in step.preempted:
                break  # it just gave its blocks up: not back within the same step
            if len(self.running) >= cfg.max_batch_size:
                if self._preempt_lower_priority(request, step):
                    continue
                break
            hashes = request.block_hashes
            assert hashes is not None
            if len(hashes) < request.num_tokens // cfg.tokens_per_block:
                hashes.extend(request.all_token_ids)
            hit = self.kv.find_cached_prefix(hashes, request.num_tokens)
            num_cached = hit.num_blocks * cfg.tokens_per_block
            count = self._chunk(request.num_tokens - num_cached, step.token_budget)
            if count == 0:
                break
            wanted = step.drafts_to_propose
            propose, lookahead = (
                self._propose_for(request, num_cached + count, request.num_tokens, wanted) if wanted else (0, 0)
            )
            self._drafts_asked = self._drafts_asked or propose > 0
            lifetime = request.max_total_tokens if self.guaranteed else None
            if not self.kv.can_admit(hit, num_cached + count + lookahead, lifetime):
                if self._preempt_lower_priority(request, step):
                    continue
                break  # first come, first served within a priority: nobody overtakes the head of the queue
            self.waiting.popleft()
            self.kv.admit(request.request_id, hit, num_cached + count + lookahead, lifetime, request.retention)
            if request.not_reused is None:  # first admission: what the prompt reused, and why not more
                request.num_cached_tokens = num_cached
                request.not_reused = self.kv.explain_prompt(hashes, request.prompt_token_ids, hit.num_blocks)
            request.num_computed_tokens = num_cached
            request.num_registered_blocks = 0  # a new block table: what it holds is learnt at the next result
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            step.chosen[request.request_id] = _Scheduled(request, count, [], propose=propose)
            step.token_budget -= count

    def _preempt_lower_priority(self, request: Request, step: _Step) -> bool:
        """MAX_UTILIZATION: make room for ``request`` by preempting one running request of lower priority."""
        if self.guaranteed:
            return False
        lower = [r for r in self.running if r.priority < request.priority]
        if not lower:
            return False
        self._preempt(min(lower, key=_victim_order), step)
        return True

    def _preempt(self, victim: Request, step: _Step) -> None:
        """Free a running request's blocks and queue it again; it resumes by recompute."""
        self.running.remove(victim)
        scheduled = step.chosen.pop(victim.request_id, None)
        if scheduled is not None:
            step.token_budget += scheduled.num_tokens
        self.kv.free(victim.request_id)  # its computed full blocks stay cached: resuming finds them
        if victim.sent_to_executor:
            self._dropped_ids.append(victim.request_id)
        victim.sent_to_executor = False
        victim.num_computed_tokens = 0
        victim.num_pending_outputs = 0  # a token still on its way is dropped; the resumed request samples it again
        victim.draft_token_ids = []
        victim.num_scheduled_drafts = 0
        victim.num_scheduled_rounds = 1
        victim.status = RequestStatus.WAITING
        victim.num_preemptions += 1
        self.waiting.append_front(victim)
        step.preempted.add(victim.request_id)
        self.num_preemptions += 1

    def _build_plan(self, step: _Step) -> StepPlan:
        self._step_id += 1
        step_id = self._step_id
        plan = StepPlan(step_id=step_id, finished_request_ids=list(self._dropped_ids))
        cached_requests = plan.cached_requests
        sampled: list[str] = []  # requests this step samples a token for
        # With speculation, what the draft-length policy learns step costs from, gathered in the one pass over
        # the batch (at a few hundred requests, passes of their own cost a visible share of the host's step).
        speculating = self.config.max_draft_tokens > 0
        generation, rounds, verified, num_tokens = speculating, 1, False, 0
        for item in step.chosen.values():
            request = item.request
            num_drafts = len(item.drafts)
            if speculating:
                num_tokens += item.num_tokens
                if item.rounds > 1:
                    rounds, verified = max(rounds, item.rounds), True
                elif item.num_tokens != 1 + num_drafts:
                    generation = False  # context work
                elif num_drafts:
                    verified = True
            if not request.sent_to_executor:
                plan.new_requests.append(self._new_request(item))
                request.sent_to_executor = True
            else:
                cached_requests.append(
                    CachedRequest(
                        request.request_id, request.num_computed_tokens, item.num_tokens, item.new_blocks,
                        item.drafts, item.propose, item.rounds,
                    )
                )
            if item.rounds > 1:
                num_drafts = item.num_tokens - 1  # every token past the last one is a draft or a later round's
            computed = request.num_computed_tokens + item.num_tokens
            request.num_computed_tokens = computed
            request.num_scheduled_drafts = num_drafts
            request.num_scheduled_rounds = item.rounds
            if request.draft_token_ids:
                request.draft_token_ids = []  # used now, or stale after this step
            pending = request.num_pending_outputs
            if computed - num_drafts == len(request.prompt_token_ids) + len(request.output_token_ids) + pending:
                request.num_pending_outputs = pending + 1  # this step samples its next token (and judges its drafts)
                sampled.append(request.request_id)
        if sampled:
            self._sampling[step_id] = sampled
        if generation and not plan.new_requests:  # a generation step (speculation on): its cost per round
            self._generation_steps[plan.step_id] = (num_tokens // rounds, rounds, verified)
        copies = self.kv.take_copies()
        plan.swap_out = [BlockCopy(device_block=d, host_slot=h) for d, h in copies.swap_out]
        plan.swap_in = [BlockCopy(device_block=d, host_slot=h) for h, d in copies.swap_in]
        if not plan.is_empty:
            # An empty plan is not sent to the executor: its drops ride along with the next one.
            self._dropped_ids = []
        return plan

    def _new_request(self, item: _Scheduled) -> NewRequest:
        """Everything the executor needs about a request it does not hold (yet, or again)."""
        request = item.request
        return NewRequest(
            request_id=request.request_id,
            token_ids=request.all_token_ids,
            num_prompt_tokens=request.num_prompt_tokens,
            num_computed_tokens=request.num_computed_tokens,
            num_scheduled_tokens=item.num_tokens,
            block_ids=list(self.kv.block_table(request.request_id)),
            sampling=request.sampling,
            num_drafts_to_propose=item.propose,
            stop_token_ids=request.finishing_token_ids,
            max_num_tokens=min(request.max_total_tokens, self.config.max_seq_len),
        )

    def _judged(self, request: Request, output: RequestOutput) -> None:
        """A step verified ``request``'s drafts, in one round or several, as ``output`` tells."""
        scheduled, rounds = request.num_scheduled_drafts, request.num_scheduled_rounds
        # Drafts per round (a chained round of tree drafts has more rows than 1 + k).
        k = self.config.draft_length_of((scheduled + 1) // rounds) if rounds > 1 else scheduled
        # The executor may run fewer rounds than planned (it stops once every request of the step has
        # finished): the rounds it did not run emitted nothing.
        per_round = list(output.round_accepted[:rounds]) if rounds > 1 else [output.num_accepted_drafts]
        per_round = [min(max(a, 0), k) for a in per_round]
        # Of each round's k drafts, the real guesses: the rest padded rounds whose lookup found nothing.
        drafted = list(output.round_drafted[:rounds]) if rounds > 1 else [k]
        drafted = [min(max(d, 0), k) for d in drafted] + [k] * (len(per_round) - len(drafted))
        # Rows past each round's accepted prefix, and the rounds not run, emitted nothing: their slots get written again.
        request.num_computed_tokens -= scheduled + 1 - sum(a + 1 for a in per_round)
        request.num_scheduled_drafts = 0
        request.num_scheduled_rounds = 1
        stats = self.drafts
        left = request.stopping.max_tokens - len(request.output_token_ids)  # tokens it may still emit
        for accepted, guesses in zip(per_round, drafted):
            if left <= 0:
                break  # rounds past the length limit: their tokens are dropped, and their drafts count for nothing
            guesses = min(guesses, left - 1)  # nor do a round's drafts that would have run past it
            left -= accepted + 1
            # Statistics count real guesses only: a padded draft that happened to match is no acceptance.
            accepted = min(accepted, guesses)
            request.acceptance.observe(guesses, accepted, k)
            request.num_draft_tokens += guesses
            request.num_accepted_draft_tokens += accepted
            stats.num_draft_tokens += guesses
            stats.num_accepted += accepted
            for i in range(guesses):
                stats.by_position[i] += 1
                stats.accepted_by_position[i] += i < accepted

    def _chunk(self, missing: int, token_budget: int) -> int:
        """Tokens to compute this step, of ``missing``, within ``token_budget``."""
        if missing <= token_budget:
            return missing
        block = self.config.tokens_per_block
        return (token_budget // block) * block  # not the last chunk: whole blocks only

    def update(self, result: StepResult, seconds: float | None = None, overlapped: bool = False) -> list[RequestUpdate]:
        """Apply a StepResult: append tokens, cache computed blocks, decide token-level stops, free blocks.

        ``seconds``: what the step cost in wall time as its caller saw it (the executor's
        own ``step_us`` when not given), ``overlapped``: whether it was planned while
        another step ran; the draft-length policy learns from both.
        """
        updates: list[RequestUpdate] = []
        generation = self._generation_steps.pop(result.step_id, None)
        seconds = seconds if seconds is not None else result.step_us / 1e6
        if generation is not None and seconds > 0:
            tokens, rounds, verified = generation  # chained rounds: each counts as a step of its share
            if rounds > 1:  # of the rounds that ran (all requests finished may end a step early)
                rounds = min(rounds, max((len(o.round_accepted) for o in result.outputs), default=0)) or rounds
            self.draft_policy.observe(tokens, seconds / rounds, overlapped, result.step_us / 1e6 / rounds,
                                      plain=not verified, chained=rounds > 1, rounds=rounds)
        requests = self.requests
        for request_id in self._sampling.pop(result.step_id, ()):
            request = requests.get(request_id)
            if request is not None and request.num_pending_outputs > 0:
                request.num_pending_outputs -= 1
        for request_id, message in result.request_errors.items():
            request = self.finish_request(request_id, FinishReason.ERROR, message)
            if request is not None:
                # The executor already dropped its state.
                self._dropped_ids = [r for r in self._dropped_ids if r != request_id]
                updates.append(RequestUpdate(request, [], FinishReason.ERROR))
        caching = self.kv.enable_prefix_caching
        tokens_per_block = self.config.tokens_per_block
        running = RequestStatus.RUNNING
        for output in result.outputs:
            request = requests.get(output.request_id)
            if request is None or request.status is not running:
                continue  # finished (e.g. cancelled) while the step ran
            if request.num_scheduled_drafts:
                self._judged(request, output)
            next_drafts = output.next_draft_token_ids
            if len(next_drafts) or request.draft_token_ids:  # else it keeps its empty list
                request.draft_token_ids = list(next_drafts)
            # The step is done: its full blocks may serve other requests from now on.
            # Up to the tokens known here: a later step in flight may have computed more.
            known = min(request.num_computed_tokens, request.num_tokens)
            # Most steps fill no block: the KV cache would find nothing new, so it is not asked.
            if caching and known // tokens_per_block > request.num_registered_blocks:
                self._cache_computed_blocks(request, known)
            accepted, reason = self._append_tokens(request, output.token_ids)
            if reason is not None:
                self.finish_request(request.request_id, reason)
            if accepted or reason is not None:
                updates.append(RequestUpdate(request, accepted, reason))
        return updates

    def _append_tokens(self, request: Request, token_ids: Sequence[int]) -> tuple[list[int], FinishReason | None]:
        """Append a step's tokens to the request up to the first that stops it: (those appended, why it stops)."""
        accepted: list[int] = []
        reason = None
        for token in token_ids:
            request.output_token_ids.append(token)
            accepted.append(token)
            reason = request.check_token_stop(token)
            if reason is None and request.num_tokens >= self.config.max_seq_len:
                reason = FinishReason.LENGTH
            if reason is not None:
                break
        return accepted, reason

    def _cache_computed_blocks(self, request: Request, num_computed: int) -> None:
        """Offer the request's full blocks among its first ``num_computed`` tokens to the prefix cache."""
        assert request.block_hashes is not None
        request.num_registered_blocks = self.kv.cache_computed_blocks(
            request.request_id, request.block_hashes, num_computed, request.prompt_token_ids, request.output_token_ids,
        )
