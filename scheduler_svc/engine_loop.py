"""The scheduler's step loop and the per-request output streams.

``AsyncEngine`` runs one asyncio task that repeats: schedule a step, send the
plan to the executor, apply the result, detokenize, and push chunks to each
request's queue. Request handlers (gRPC or the LLM API) call ``generate`` and
iterate the chunks; leaving the iteration early (client cancel, deadline)
aborts the request and frees its blocks at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from protos.plan import ExecutorInfo, StepResult
from scheduler_svc.api_types import EngineStats, GenerationChunk, GenerationRequest, ModelDescription, Usage
from scheduler_svc.detokenizer import IncrementalDetokenizer, detokenize_batch
from scheduler_svc.executor_client import ExecutorConnection, ExecutorUnavailable
from scheduler_svc.metrics import RequestMetrics, render
from scheduler_svc.request import FinishReason, Request
from scheduler_svc.scheduler import CapacityPolicy, RequestUpdate, Scheduler, SchedulerConfig
from scheduler_svc.tokenizer import Tokenizer
from scheduler_svc.validation import InvalidRequest, Limits, build_request

log = logging.getLogger("inflight.scheduler")


class QueueFull(RuntimeError):
    """More requests are waiting than max_queue_size allows."""


class EngineUnavailable(RuntimeError):
    """No executor can serve requests right now."""


@dataclass(slots=True)
class EngineLimits:
    """Scheduler-side limits; zero means "take the executor's value"."""

    max_batch_size: int = 0
    max_num_tokens: int = 0
    max_seq_len: int = 0
    max_queue_size: int = 1024
    overlap_scheduling: bool = True  # plan step N+1 while the executor runs step N
    num_kv_blocks: int = 0  # use fewer KV blocks than the executor has (tests, benchmarks)
    max_host_blocks: int = 0  # use fewer host-tier blocks than the executor has
    capacity_policy: CapacityPolicy = CapacityPolicy.GUARANTEED_NO_EVICT
    enable_prefix_caching: bool = True
    max_draft_tokens: int = -1  # speculative decoding: -1 = the executor's most, 0 = off
    adaptive_draft_length: bool = True  # draft length follows acceptance and load (off: always the most)
    # A step chains no more verification rounds than the measured costs fit in this (0 = as many as the
    # executor offers): a stream gets a chained step's tokens when it ends.
    max_chained_step_ms: float = 50.0

    def __post_init__(self) -> None:
        if not self.max_chained_step_ms >= 0:  # also NaN
            raise ValueError(f"max_chained_step_ms must be 0 (no limit) or positive, got {self.max_chained_step_ms}")


class _Stream:
    """One request's chunks on their way to its reader, and its detokenizer.

    A list and, while the reader waits, one future to wake it: lighter than an
    asyncio.Queue (no getter bookkeeping per chunk), and a reader that fell
    behind takes everything that piled up at once.

    A ``final_only`` stream wakes its reader once, with the finished request: a
    caller that does not stream (the offline API, a unary-style client) costs
    no task switch per step, and without stop strings no detokenization either.
    """

    __slots__ = ("chunks", "detokenizer", "final_only", "_waiter")

    def __init__(self, detokenizer: IncrementalDetokenizer, final_only: bool = False) -> None:
        self.chunks: list[GenerationChunk] = []
        self.detokenizer = detokenizer
        self.final_only = final_only
        self._waiter: asyncio.Future[None] | None = None

    @property
    def decodes_each_step(self) -> bool:
        """Whether a step's tokens are detokenized as they come (to stream them, or to find stop strings)."""
        return not self.final_only or bool(self.detokenizer.stop)

    def put(self, chunk: GenerationChunk) -> None:
        self.chunks.append(chunk)
        if self.final_only and chunk.finish_reason is None:
            return  # the reader wakes for the finished request only
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():  # done: its reader was cancelled
            waiter.set_result(None)

    async def take(self) -> list[GenerationChunk]:
        while not self.chunks:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        chunks, self.chunks = self.chunks, []
        return chunks


class AsyncEngine:
    def __init__(self, executor: ExecutorConnection, tokenizer: Tokenizer, limits: EngineLimits | None = None) -> None:
        self.executor = executor
        self.tokenizer = tokenizer
        self.limits = limits or EngineLimits()
        self.scheduler: Scheduler | None = None
        self.info: ExecutorInfo | None = None
        self._streams: dict[str, _Stream] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._healthy = False
        self.num_steps = 0
        self.num_serial_steps = 0  # steps planned while none was in flight: the GPU waited for the host's plan
        # The step in flight that chains verification rounds, until a request arrives and asks it to end them.
        self._chained_step: int | None = None
        self.num_rounds_ended = 0  # chained steps asked to end early for an arriving request
        self._background: set[asyncio.Task] = set()
        # Host seconds the step loop spent planning, applying results and streaming them:
        # with overlap, the GPU waits only when these (plus the executor's) exceed a step.
        # Wall time, and this thread's CPU time: the difference is time spent waiting for
        # the interpreter lock while another thread (the in-process executor) held it.
        self.host_seconds = {"schedule": 0.0, "update": 0.0, "deliver": 0.0}
        self.host_cpu_seconds = dict.fromkeys(self.host_seconds, 0.0)
        # Finished requests, tokens and latencies for the metrics page (the clock of Request.arrival_time).
        self.request_metrics = RequestMetrics(time.monotonic)

    async def start(self) -> None:
        await self._attach()
        self._task = asyncio.create_task(self._loop(), name="inflight-step-loop")

    async def _attach(self) -> None:
        """Ask the executor for its capacity and size a fresh scheduler from it."""
        self.info = await self.executor.info()
        lim, info = self.limits, self.info
        num_kv_blocks = min(lim.num_kv_blocks or info.num_kv_blocks, info.num_kv_blocks)
        config = SchedulerConfig(
            max_batch_size=min(lim.max_batch_size or info.max_batch_size, info.max_batch_size),
            max_num_tokens=min(lim.max_num_tokens or info.max_num_tokens, info.max_num_tokens),
            tokens_per_block=info.tokens_per_block,
            num_kv_blocks=num_kv_blocks,
            # A sequence must fit in the pool, also when the pool is cut below the executor's.
            max_seq_len=min(lim.max_seq_len or info.max_seq_len, info.max_seq_len, num_kv_blocks * info.tokens_per_block),
            capacity_policy=lim.capacity_policy,
            enable_prefix_caching=lim.enable_prefix_caching,
            num_host_blocks=min(lim.max_host_blocks or info.num_host_blocks, info.num_host_blocks),
            max_draft_tokens=info.max_draft_tokens if lim.max_draft_tokens < 0 else min(lim.max_draft_tokens, info.max_draft_tokens),
            draft_lookahead_slots=info.drafts_need_lookahead_slots,
            adaptive_draft_length=lim.adaptive_draft_length,
            max_speculative_rounds=max(1, info.max_speculative_rounds),
            max_chained_step_seconds=lim.max_chained_step_ms / 1e3,
            draft_tree_rows=tuple(info.draft_tree_rows),
        )
        self.scheduler = Scheduler(config)
        self.scheduler.draft_policy.overlap_available = lim.overlap_scheduling
        self._healthy = True
        log.info(
            "attached to executor: %s on %s, %d KV blocks of %d tokens (+%d host), max_batch_size=%d max_num_tokens=%d "
            "max_seq_len=%d, %s, prefix caching %s",
            self.info.model, self.info.device, config.num_kv_blocks, config.tokens_per_block, config.num_host_blocks,
            config.max_batch_size, config.max_num_tokens, config.max_seq_len, config.capacity_policy.value,
            "on" if config.enable_prefix_caching else "off",
        )

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self.executor.close()

    @property
    def healthy(self) -> bool:
        return self._healthy

    def describe(self) -> ModelDescription:
        assert self.info is not None and self.scheduler is not None, "engine not started"
        cfg = self.scheduler.config
        return ModelDescription(
            model=self.info.model, vocab_size=self.info.vocab_size, max_seq_len=cfg.max_seq_len,
            max_batch_size=cfg.max_batch_size, max_num_tokens=cfg.max_num_tokens,
            tokens_per_block=cfg.tokens_per_block, num_kv_blocks=cfg.num_kv_blocks,
            eos_token_ids=sorted(self.tokenizer.eos_token_ids), has_chat_template=self.tokenizer.has_chat_template,
            device=self.info.device, capacity_policy=cfg.capacity_policy.value, prefix_caching=cfg.enable_prefix_caching,
            num_host_blocks=cfg.num_host_blocks,
        )

    def stats(self) -> EngineStats:
        scheduler = self.scheduler
        if scheduler is None:
            return EngineStats(0, 0, self.num_steps, executor_ready=False)
        return EngineStats(
            num_running_requests=len(scheduler.running), num_waiting_requests=len(scheduler.waiting),
            num_steps=self.num_steps, executor_ready=self.healthy, num_preemptions=scheduler.num_preemptions,
            kv=scheduler.kv.stats(), drafts=scheduler.drafts,
        )

    def metrics_page(self) -> str:
        """The Prometheus text of ``stats()`` and the finished requests' counts (scheduler_svc/metrics.py)."""
        return render(self.stats(), self.request_metrics, self.info.model if self.info is not None else "")

    def limits_for_validation(self) -> Limits:
        assert self.info is not None and self.scheduler is not None, "engine not started"
        return Limits(vocab_size=self.info.vocab_size, max_seq_len=self.scheduler.config.max_seq_len)

    # -- requests ------------------------------------------------------------

    def add(self, req: GenerationRequest) -> Request:
        """Validate and enqueue; raises InvalidRequest, QueueFull or EngineUnavailable."""
        if self.scheduler is None or not self._healthy:
            raise EngineUnavailable("no executor is attached")
        request = build_request(req, self.tokenizer, self.limits_for_validation())
        if request.request_id in self.scheduler.requests:
            raise InvalidRequest("request_id", f"{request.request_id!r} is already in flight")
        if len(self.scheduler.waiting) >= self.limits.max_queue_size:
            raise QueueFull(f"{len(self.scheduler.waiting)} requests are waiting (max_queue_size={self.limits.max_queue_size})")
        self._streams[request.request_id] = _Stream(
            IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, request.stopping.stop), req.final_only
        )
        self.scheduler.add_request(request)
        self._end_chained_rounds()
        self._wake.set()
        return request

    def _end_chained_rounds(self) -> None:
        """A request arrived: a step in flight that chains many verification rounds ends them after the round
        it is in, so the newcomer's first token waits for about a round and not for all of them (the next plan
        gives it its prompt step). A full batch would not take it in anyway, and is left to run."""
        step_id, scheduler = self._chained_step, self.scheduler
        if step_id is None or scheduler is None or len(scheduler.running) >= scheduler.config.max_batch_size:
            return
        self._chained_step = None
        self.num_rounds_ended += 1
        task = asyncio.get_running_loop().create_task(self.executor.end_rounds(step_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def stream(self, request: Request) -> AsyncIterator[GenerationChunk]:
        """Chunks of an added request until it finishes; aborts it if left early."""
        stream = self._streams[request.request_id]
        finished = False
        try:
            while not finished:
                # A reader that fell behind gets what piled up as one chunk: under load
                # that is fewer messages to send, and nothing is lost or reordered.
                chunk, *later = await stream.take()
                for following in later:  # a finished chunk is always the last
                    chunk = _merge(chunk, following)
                finished = chunk.finish_reason is not None
                yield chunk
        finally:
            if not finished:
                self.abort(request.request_id)

    async def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        request = self.add(req)
        async for chunk in self.stream(request):
            yield chunk

    def abort(self, request_id: str) -> None:
        """Cancel a request: its blocks are free before the next step is planned."""
        self._streams.pop(request_id, None)
        scheduler = self.scheduler
        request = scheduler.finish_request(request_id, FinishReason.CANCELLED) if scheduler is not None else None
        if request is not None:
            self.request_metrics.request_finished(request, FinishReason.CANCELLED)
            log.info("request %s cancelled", request_id)
            self._wake.set()  # freed blocks may let the queue head in

    # -- the step loop ---------------------------------------------------------

    async def _loop(self) -> None:
        # Plans sent and not answered yet, oldest first. With overlap on, the next step is
        # planned and sent while the executor runs the current one: the scheduler counts
        # the token each running request will get as held, the executor feeds it in itself,
        # and neither side waits for the other between steps.
        # (result, whether another step was in flight when it was planned)
        in_flight: deque[tuple[asyncio.Future[StepResult], bool]] = deque()
        last_result_at = time.perf_counter()  # when the last result came back, or the loop last woke from idling
        while True:
            scheduler = self.scheduler
            assert scheduler is not None
            # Drafts are judged and proposed from each step's result: speculation plans one step at a time
            # (unless the load made it turn speculation off for now).
            overlap = not scheduler.config.max_draft_tokens or scheduler.draft_policy.allows_overlap()
            depth = 2 if self.limits.overlap_scheduling and overlap else 1
            if len(in_flight) < depth and scheduler.has_work and self._send_next(in_flight):
                continue  # room for one more in flight? plan it now
            if not in_flight:
                # Nothing to run (or nothing could be scheduled, e.g. the queue head waits
                # for blocks that only a finishing request frees): wait for a change.
                self._wake.clear()
                await self._wake.wait()
                last_result_at = time.perf_counter()  # time spent idle is no step's cost
                continue
            future, overlapped = in_flight.popleft()
            try:
                result = await future
            except Exception as exc:  # noqa: BLE001 - the executor is gone or broke: its state is lost either way
                for pending, _ in in_flight:  # they went down with the same stream
                    pending.cancel()
                in_flight.clear()
                if not isinstance(exc, ExecutorUnavailable):
                    log.exception("executor step failed")
                await self._executor_lost(str(exc) if isinstance(exc, ExecutorUnavailable) else f"step failed: {type(exc).__name__}: {exc}")
                last_result_at = time.perf_counter()  # nor is the time spent attaching again
                continue
            self.num_steps += 1
            self.num_serial_steps += not overlapped
            if self._chained_step == result.step_id:
                self._chained_step = None
            started, cpu = time.perf_counter(), time.thread_time()
            # What the step cost in wall time: from the previous result to its own, the same
            # measure whether steps overlap or run one at a time (then it includes handling the
            # previous result and planning this step), and from the wake-up after idling.
            period, last_result_at = started - last_result_at, started
            self.request_metrics.step_period.observe(period)
            updates = scheduler.update(result, period, overlapped)
            self._spent("update", started, cpu)
            if len(in_flight) < depth and scheduler.has_work:
                # The next plan goes out before this step's tokens are streamed, so the executor
                # launches it while this thread detokenizes and wakes the readers: the plan needs
                # this result's state, not its text. (A request that a stop string finishes below
                # was planned once more; that step's output for it is dropped, as for a cancel.)
                self._send_next(in_flight)
            started, cpu = time.perf_counter(), time.thread_time()
            texts = self._detokenize(updates)
            for update in updates:
                self._deliver(update, texts.get(update.request.request_id))
            self._spent("deliver", started, cpu)

    def _spent(self, phase: str, started: float, cpu: float) -> None:
        self.host_seconds[phase] += time.perf_counter() - started
        self.host_cpu_seconds[phase] += time.thread_time() - cpu

    def _send_next(self, in_flight: deque) -> bool:
        """Plan a step and send it; False when nothing could be scheduled."""
        started, cpu = time.perf_counter(), time.thread_time()
        plan = self.scheduler.schedule()  # type: ignore[union-attr]
        self._spent("schedule", started, cpu)
        if plan.is_empty:
            return False
        if any(request.num_rounds > 1 for request in plan.cached_requests):
            self._chained_step = plan.step_id
        in_flight.append((asyncio.ensure_future(self.executor.step(plan)), bool(in_flight)))
        return True

    def _detokenize(self, updates: list[RequestUpdate]) -> dict[str, str]:
        """New text of every update that streams its tokens, all requests' tokens decoded in batches."""
        chosen: list[tuple[str, IncrementalDetokenizer, list[int]]] = []
        for update in updates:
            stream = self._streams.get(update.request.request_id)
            if (stream is not None and update.new_token_ids and not stream.detokenizer.stopped
                    and stream.decodes_each_step):
                chosen.append((update.request.request_id, stream.detokenizer, update.new_token_ids))
        texts = detokenize_batch(self.tokenizer, [(detok, token_ids) for _, detok, token_ids in chosen])
        return {request_id: text for (request_id, _, _), text in zip(chosen, texts)}

    def _deliver(self, update: RequestUpdate, text: str | None = None) -> None:
        """Stream one update; ``text`` is its new text when already detokenized."""
        request = update.request
        stream = self._streams.get(request.request_id)
        if stream is None:
            return
        detok = stream.detokenizer
        reason = update.finish_reason
        token_ids = update.new_token_ids
        if token_ids and not request.has_first_token:
            request.has_first_token = True
            self.request_metrics.first_token(request)
        if not stream.decodes_each_step:
            if reason is None:
                return  # the scheduler's request keeps the tokens; its text is decoded once, at the end
            token_ids = list(request.output_token_ids)
            text = detok.add_all(token_ids)
        else:
            if text is None:
                text = detok.add_tokens(token_ids)
            if reason is None and detok.stopped:  # a stop string matched
                reason = FinishReason.STOP
                self.scheduler.finish_request(request.request_id, reason)  # type: ignore[union-attr]
            if reason is None:
                stream.put(GenerationChunk(request.request_id, token_ids, text))
                return
            text += detok.flush() if reason is not FinishReason.STOP else ""
        self.request_metrics.request_finished(request, reason)
        stream.put(
            GenerationChunk(
                request.request_id, token_ids, text, finish_reason=reason,
                usage=Usage(
                    request.num_prompt_tokens, len(request.output_token_ids), request.num_cached_tokens,
                    request.not_reused, request.num_preemptions,
                    request.num_draft_tokens, request.num_accepted_draft_tokens,
                ),
                error=request.error,
            )
        )
        del self._streams[request.request_id]

    async def _executor_lost(self, message: str) -> None:
        """Fail every request in flight, then wait for an executor and attach again.

        Requests cannot be carried over: their KV cache lived in the executor.
        While detached, new requests get UNAVAILABLE instead of queueing.
        """
        log.error("executor lost: %s", message)
        self._healthy = False
        self._chained_step = None
        scheduler = self.scheduler
        assert scheduler is not None
        for request_id in list(scheduler.requests):
            request = scheduler.finish_request(request_id, FinishReason.ERROR, f"executor unavailable: {message}")
            if request is not None:
                self._deliver(RequestUpdate(request, [], FinishReason.ERROR))
        while True:
            try:
                await self._attach()  # the executor may come back with another capacity
                return
            except ExecutorUnavailable as exc:
                log.warning("executor still unavailable: %s", exc)
                await asyncio.sleep(1.0)


def _merge(first: GenerationChunk, second: GenerationChunk) -> GenerationChunk:
    """``first`` followed by ``second``, as one chunk (the finish and usage are the later one's)."""
    return GenerationChunk(
        first.request_id, first.token_ids + second.token_ids, first.text + second.text,
        finish_reason=second.finish_reason, usage=second.usage, error=second.error,
    )
