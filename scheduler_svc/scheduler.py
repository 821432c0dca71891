"""Inflight batching: decide, every step, which requests compute which tokens.

One rule (the one vLLM v1 states at the top of its scheduler): each request
has ``num_computed_tokens`` and holds ``num_tokens`` tokens; a step gives each
scheduled request some of the ``num_tokens - num_computed_tokens`` tokens it
is missing. Context, chunked context and generation are that rule with
different counts; draft tokens and prefix hits will be too.

Order within a step follows TensorRT-LLM: requests already running go first
(generation work, then context chunks still in progress), then waiting
requests in arrival order, until ``max_batch_size`` requests or
``max_num_tokens`` tokens are used. A context chunk that does not finish its
prompt is cut to a multiple of ``tokens_per_block``, so every chunk but the
last fills whole blocks. Admission is GUARANTEED_NO_EVICT: a waiting request
starts only when blocks for its prompt and max_tokens can be reserved.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvcache.manager import KVCacheManager
from protos.plan import CachedRequest, NewRequest, StepPlan, StepResult
from scheduler_svc.request import FinishReason, Request, RequestStatus


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_batch_size: int
    max_num_tokens: int
    tokens_per_block: int
    num_kv_blocks: int
    max_seq_len: int

    def __post_init__(self) -> None:
        if self.max_num_tokens < self.tokens_per_block:
            raise ValueError(
                f"max_num_tokens ({self.max_num_tokens}) must be at least tokens_per_block ({self.tokens_per_block})"
            )
        if self.max_batch_size <= 0:
            raise ValueError(f"max_batch_size must be positive, got {self.max_batch_size}")


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


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv = KVCacheManager(config.num_kv_blocks, config.tokens_per_block)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []  # executor state to drop in the next plan
        self._step_id = 0

    # -- requests in and out -----------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
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
                self._finished_ids.append(request_id)
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
        cfg = self.config
        token_budget = cfg.max_num_tokens
        chosen: list[_Scheduled] = []

        # Generation work first (one missing token), then context still in progress.
        running = sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1)
        for request in running:
            count = self._chunk(request, token_budget)
            if count == 0:
                continue
            chosen.append(_Scheduled(request, count))
            token_budget -= count

        while self.waiting and len(self.running) < cfg.max_batch_size and token_budget > 0:
            request = self.waiting[0]
            count = self._chunk(request, token_budget)
            if count == 0 or not self.kv.can_reserve(request.max_total_tokens):
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            self.kv.reserve(request.request_id, request.max_total_tokens)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            chosen.append(_Scheduled(request, count))
            token_budget -= count

        self._step_id += 1
        plan = StepPlan(step_id=self._step_id, finished_request_ids=self._finished_ids)
        self._finished_ids = []
        for item in chosen:
            request = item.request
            new_blocks = self.kv.allocate_slots(request.request_id, request.num_computed_tokens + item.num_tokens)
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
                        new_block_ids=new_blocks,
                    )
                )
            request.num_computed_tokens += item.num_tokens
        return plan

    def _chunk(self, request: Request, token_budget: int) -> int:
        """Tokens to compute for ``request`` this step within ``token_budget``."""
        missing = request.num_tokens - request.num_computed_tokens
        if missing <= token_budget:
            return missing
        block = self.config.tokens_per_block
        return (token_budget // block) * block  # not the last chunk: whole blocks only

    def update(self, result: StepResult) -> list[RequestUpdate]:
        """Apply a StepResult: append tokens, decide token-level stops, free blocks."""
        updates: list[RequestUpdate] = []
        for request_id, message in result.request_errors.items():
            request = self.finish_request(request_id, FinishReason.ERROR, message)
            if request is not None:
                # The executor already dropped its state.
                self._finished_ids = [r for r in self._finished_ids if r != request_id]
                updates.append(RequestUpdate(request, [], FinishReason.ERROR))
        for output in result.outputs:
            request = self.requests.get(output.request_id)
            if request is None:  # finished (e.g. cancelled) while the step ran
                continue
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
