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
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcache.block_hash import BlockHashes, BlockKeys
from kvcache.manager import KVCacheManager
from protos.plan import BlockCopy, CachedRequest, NewRequest, StepPlan, StepResult
from scheduler_svc.request import FinishReason, Request, RequestStatus
from scheduler_svc.scheduler_config import CapacityPolicy, SchedulerConfig
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


@dataclass(slots=True)
class _Step:
    """What the step being planned has decided so far."""

    token_budget: int
    chosen: dict[str, _Scheduled] = field(default_factory=dict)
    preempted: set[str] = field(default_factory=set)


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
        # By priority; within one, generation work (one missing token) before context in progress.
        order = sorted(self.running, key=lambda r: (-r.priority, r.num_tokens - r.num_computed_tokens > 1))
        for request in order:
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            held = request.num_tokens + request.num_pending_outputs
            if request.num_pending_outputs and (
                len(request.output_token_ids) + request.num_pending_outputs >= request.stopping.max_tokens
                or held >= self.config.max_seq_len
            ):
                continue  # its last token is already on its way
            count = self._chunk(held - request.num_computed_tokens, step.token_budget)
            if count == 0:
                continue
            new_blocks = self.kv.allocate_slots(request.request_id, request.num_computed_tokens + count)
            while new_blocks is None:  # no free block: MAX_UTILIZATION preempts (the other policy reserved them)
                assert not self.guaranteed, "a GUARANTEED_NO_EVICT request ran out of reserved blocks"
                victim = min(self.running, key=_victim_order)
                self._preempt(victim, step)
                if victim is request:
                    break
                new_blocks = self.kv.allocate_slots(request.request_id, request.num_computed_tokens + count)
            if new_blocks is not None:
                step.chosen[request.request_id] = _Scheduled(request, count, new_blocks)
                step.token_budget -= count

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
            lifetime = request.max_total_tokens if self.guaranteed else None
            if not self.kv.can_admit(hit, num_cached + count, lifetime):
                if self._preempt_lower_priority(request, step):
                    continue
                break  # first come, first served within a priority: nobody overtakes the head of the queue
            self.waiting.popleft()
            self.kv.admit(request.request_id, hit, num_cached + count, lifetime, request.retention)
            if request.not_reused is None:  # first admission: what the prompt reused, and why not more
                request.num_cached_tokens = num_cached
                request.not_reused = self.kv.explain_prompt(hashes, request.prompt_token_ids, hit.num_blocks)
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            step.chosen[request.request_id] = _Scheduled(request, count, [])
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
        victim.status = RequestStatus.WAITING
        victim.num_preemptions += 1
        self.waiting.append_front(victim)
        step.preempted.add(victim.request_id)
        self.num_preemptions += 1

    def _build_plan(self, step: _Step) -> StepPlan:
        self._step_id += 1
        plan = StepPlan(step_id=self._step_id, finished_request_ids=list(self._dropped_ids))
        for item in step.chosen.values():
            request = item.request
            if not request.sent_to_executor:
                plan.new_requests.append(
                    NewRequest(
                        request_id=request.request_id,
                        token_ids=request.all_token_ids,
                        num_prompt_tokens=request.num_prompt_tokens,
                        num_computed_tokens=request.num_computed_tokens,
                        num_scheduled_tokens=item.num_tokens,
                        block_ids=list(self.kv.block_table(request.request_id)),
                        sampling=request.sampling,
                    )
                )
                request.sent_to_executor = True
            else:
                plan.cached_requests.append(
                    CachedRequest(
                        request_id=request.request_id,
                        num_computed_tokens=request.num_computed_tokens,
                        num_scheduled_tokens=item.num_tokens,
                        new_block_ids=item.new_blocks,
                    )
                )
            request.num_computed_tokens += item.num_tokens
            if request.num_computed_tokens == request.num_tokens + request.num_pending_outputs:
                request.num_pending_outputs += 1  # this step samples its next token
                self._sampling.setdefault(plan.step_id, []).append(request.request_id)
        copies = self.kv.take_copies()
        plan.swap_out = [BlockCopy(device_block=d, host_slot=h) for d, h in copies.swap_out]
        plan.swap_in = [BlockCopy(device_block=d, host_slot=h) for h, d in copies.swap_in]
        if not plan.is_empty:
            # An empty plan is not sent to the executor: its drops ride along with the next one.
            self._dropped_ids = []
        return plan

    def _chunk(self, missing: int, token_budget: int) -> int:
        """Tokens to compute this step, of ``missing``, within ``token_budget``."""
        if missing <= token_budget:
            return missing
        block = self.config.tokens_per_block
        return (token_budget // block) * block  # not the last chunk: whole blocks only

    def update(self, result: StepResult) -> list[RequestUpdate]:
        """Apply a StepResult: append tokens, cache computed blocks, decide token-level stops, free blocks."""
        updates: list[RequestUpdate] = []
        for request_id in self._sampling.pop(result.step_id, []):
            request = self.requests.get(request_id)
            if request is not None and request.num_pending_outputs > 0:
                request.num_pending_outputs -= 1
        for request_id, message in result.request_errors.items():
            request = self.finish_request(request_id, FinishReason.ERROR, message)
            if request is not None:
                # The executor already dropped its state.
                self._dropped_ids = [r for r in self._dropped_ids if r != request_id]
                updates.append(RequestUpdate(request, [], FinishReason.ERROR))
        for output in result.outputs:
            request = self.requests.get(output.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # finished (e.g. cancelled) while the step ran
            # The step is done: its full blocks may serve other requests from now on.
            assert request.block_hashes is not None
            # Up to the tokens known here: a later step in flight may have computed more.
            self.kv.cache_computed_blocks(
                request.request_id, request.block_hashes, min(request.num_computed_tokens, request.num_tokens),
                request.prompt_token_ids, request.output_token_ids,
            )
            accepted: list[int] = []
            reason = None
            for token in output.token_ids:
                request.output_token_ids.append(token)
                accepted.append(token)
                reason = request.check_token_stop(token)
                if reason is None and request.num_tokens >= self.config.max_seq_len:
                    reason = FinishReason.LENGTH
                if reason is not None:
                    break
            if reason is not None:
                self.finish_request(request.request_id, reason)
            if accepted or reason is not None:
                updates.append(RequestUpdate(request, accepted, reason))
        return updates
