"""Runs StepPlans: packs the scheduled tokens, runs the model, samples.

The runner holds per-request state between steps, because plans are diffs:
the tokens a request holds (prompt plus what was sampled here), its block
table and its sampling state. It never allocates KV blocks; it writes where
the plan's block ids say.

A step is launched (``launch``: inputs copied, kernels queued, sampled ids on
their way to the host) and later finished (``finish``: wait for those ids).
Between the two the next plan may be launched already: a request whose last
token is still on its way reads it straight from the previous step's device
tensor, so the GPU never waits for the host to learn it. ``execute`` does both
halves back to back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from executor_svc.engine import Engine
from executor_svc.sampler import RequestSamplingState, Sampler
from executor_svc.step_timeline import StepTimeline
from kvcache.layout import slot_mapping
from plugins.attention_metadata import AttentionMetadata
from protos.plan import NewRequest, RequestOutput, StepPlan, StepResult


@dataclass(slots=True)
class RequestState:
    token_ids: list[int]  # known on the host
    num_prompt_tokens: int
    block_table: list[int]
    num_computed_tokens: int
    sampling: RequestSamplingState
    # Tokens sampled by launched steps whose results are not on the host yet, in
    # order: (that step, the row of this request among its sampled ids).
    pending: list[tuple[LaunchedStep, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + len(self.pending)


Scheduled = tuple[str, RequestState, int]  # (request id, state, tokens to compute)


@dataclass(slots=True)
class LaunchedStep:
    """A step whose kernels are queued; ``finish`` turns it into a StepResult."""

    result: StepResult
    scheduled: list[Scheduled] = field(default_factory=list)
    sampling_requests: list[tuple[str, RequestState]] = field(default_factory=list)
    sampled: torch.Tensor | None = None  # [len(sampling_requests)] int64 on the device
    sampled_host: torch.Tensor | None = None  # pinned copy, valid once `done` has completed
    done: torch.cuda.Event | None = None
    marks: tuple[torch.cuda.Event, torch.cuda.Event] | None = None  # for the GPU timeline
    started: float = 0.0
    num_tokens: int = 0  # tokens computed
    error: str = ""  # the forward failed: every scheduled request fails

    def is_done(self) -> bool:
        return self.done is None or self.done.query()


class PlanError(ValueError):
    """A plan entry that contradicts the executor's state or limits."""


class ModelRunner:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.device = engine.device
        self.tokens_per_block = engine.tokens_per_block
        self.vocab_size = engine.model_config.vocab_size
        self.sampler = Sampler()
        self.requests: dict[str, RequestState] = {}
        # GPU busy/idle per step, for the benchmarks' idle-time figure.
        self.timeline = StepTimeline(self.device) if self.device.type == "cuda" else None
        # Host seconds spent launching steps (inputs, kernel launches) and finishing them
        # (apart from waiting for the GPU): the executor's share of the time between steps.
        self.host_seconds = {"launch": 0.0, "finish": 0.0}

    # -- state ---------------------------------------------------------------

    def reset(self) -> None:
        """Forget every request (the scheduler that owned them went away)."""
        self.requests.clear()

    def _add(self, new: NewRequest) -> None:
        if new.request_id in self.requests:
            raise PlanError(f"request {new.request_id!r} is already running")
        if any(t < 0 or t >= self.vocab_size for t in new.token_ids):
            raise PlanError(f"request {new.request_id!r}: token id outside [0, {self.vocab_size})")
        # A resumed request brings its output too: penalties and the random stream pick up where they were.
        sampling = RequestSamplingState.from_token_ids(new.sampling, new.token_ids, new.num_prompt_tokens, self.device)
        self.requests[new.request_id] = RequestState(
            token_ids=list(new.token_ids),
            num_prompt_tokens=new.num_prompt_tokens,
            block_table=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            sampling=sampling,
        )

    # -- one step ------------------------------------------------------------

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one plan to completion."""
        return self.finish(self.launch(plan))

    def needs_host_history(self, plan: StepPlan) -> bool:
        """Whether ``plan`` samples for a request whose penalties need a token still on its way."""
        for cached in plan.cached_requests:
            state = self.requests.get(cached.request_id)
            if state is not None and state.pending and state.sampling.needs_output_history:
                return True
        return False

    def launch(self, plan: StepPlan) -> LaunchedStep:
        started = time.perf_counter()
        if plan.swap_out or plan.swap_in:  # host-tier copies, before this step writes or reads those blocks
            self.engine.kv_offload.copy_blocks(plan.swap_out, plan.swap_in)
        for request_id in plan.finished_request_ids:
            self.requests.pop(request_id, None)
        errors: dict[str, str] = {}
        scheduled: list[Scheduled] = []
        for new in plan.new_requests:
            try:
                self._add(new)
                scheduled.append((new.request_id, self.requests[new.request_id], new.num_scheduled_tokens))
            except PlanError as exc:
                errors[new.request_id] = str(exc)
        for cached in plan.cached_requests:
            state = self.requests.get(cached.request_id)
            if state is None:
                errors[cached.request_id] = f"request {cached.request_id!r} is unknown to the executor"
                continue
            state.block_table.extend(cached.new_block_ids)
            if cached.num_computed_tokens != state.num_computed_tokens:
                errors[cached.request_id] = (
                    f"plan says {cached.num_computed_tokens} computed tokens, executor has {state.num_computed_tokens}"
                )
                continue
            scheduled.append((cached.request_id, state, cached.num_scheduled_tokens))
        for request_id, state, count in list(scheduled):
            end = state.num_computed_tokens + count
            capacity = len(state.block_table) * self.tokens_per_block
            if count <= 0 or end > state.num_tokens or end > capacity or end > self.engine.max_seq_len:
                errors[request_id] = (
                    f"cannot compute tokens [{state.num_computed_tokens}, {end}): request holds "
                    f"{state.num_tokens} tokens, its blocks hold {capacity}, max_seq_len is {self.engine.max_seq_len}"
                )
                scheduled.remove((request_id, state, count))
        for request_id in errors:
            self.requests.pop(request_id, None)

        step = LaunchedStep(result=StepResult(step_id=plan.step_id, request_errors=errors), started=started)
        # Context work (several tokens) is packed before generation work (one token).
        scheduled.sort(key=lambda item: item[2] == 1)
        step.scheduled = scheduled
        if scheduled:
            try:
                self._launch(step)
            except Exception as exc:  # a failed forward fails its batch, not the executor
                step.error = f"step failed: {type(exc).__name__}: {exc}"
        self.host_seconds["launch"] += time.perf_counter() - started
        return step

    def finish(self, step: LaunchedStep) -> StepResult:
        """Wait for ``step``'s sampled ids and apply them; returns its result."""
        result = step.result
        sampled: list[int] = []
        finish_started = time.perf_counter()
        if not step.error and step.sampled is not None:
            try:
                if step.done is not None:
                    step.done.synchronize()  # the step's one wait for the device
                    finish_started = time.perf_counter()
                    sampled = step.sampled_host.tolist()
                else:
                    sampled = step.sampled.tolist()
            except Exception as exc:
                step.error = f"step failed: {type(exc).__name__}: {exc}"
        if step.error:
            result.outputs.clear()
            for request_id, state, _ in step.scheduled:
                result.request_errors[request_id] = step.error
                self.requests.pop(request_id, None)
                state.pending.clear()
            if self.timeline is not None:
                self.timeline.discard()
            result.step_us = int((time.perf_counter() - step.started) * 1e6)
            return result
        if self.timeline is not None:
            if step.marks is not None and step.done is not None:
                self.timeline.collect(*step.marks, len(step.scheduled), step.num_tokens)
            else:  # nothing waited for the GPU (a context chunk with no token to sample): no reading
                self.timeline.discard()
        next_token = dict(zip((rid for rid, _ in step.sampling_requests), sampled))
        for request_id, state, _ in step.scheduled:
            token = next_token.get(request_id)
            if token is None:
                result.outputs.append(RequestOutput(request_id, []))
                continue
            assert state.pending and state.pending[0][0] is step, "steps finish in launch order"
            state.pending.pop(0)
            state.token_ids.append(token)
            state.sampling.append_output([token])
            result.outputs.append(RequestOutput(request_id, [token]))
        result.step_us = int((time.perf_counter() - step.started) * 1e6)
        self.host_seconds["finish"] += time.perf_counter() - finish_started
        return result

    @torch.inference_mode()
    def _launch(self, step: LaunchedStep) -> None:
        scheduled = step.scheduled
        start_mark = self.timeline.mark() if self.timeline is not None else None
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        context_lens: list[int] = []
        sample_rows: list[int] = []  # token index whose logits pick the next token
        single_rows: list[int] = []
        multi_rows: list[int] = []
        # Input tokens still on their way from an earlier step: (token index, that step, its row).
        from_device: list[tuple[int, LaunchedStep, int]] = []
        for row, (request_id, state, count) in enumerate(scheduled):
            start, end = state.num_computed_tokens, state.num_computed_tokens + count
            known = len(state.token_ids)
            tokens.extend(state.token_ids[start:min(end, known)])
            for pos in range(max(start, known), end):
                earlier, earlier_row = state.pending[pos - known]
                from_device.append((len(tokens), earlier, earlier_row))
                tokens.append(0)  # placeholder, overwritten on the device
            positions.extend(range(start, end))
            slots.extend(slot_mapping(state.block_table, start, end, self.tokens_per_block))
            query_start.append(query_start[-1] + count)
            context_lens.append(end)
            (single_rows if count == 1 else multi_rows).append(row)
            if end == state.num_tokens:  # reached the last token: sample the next
                sample_rows.append(query_start[-1] - 1)
                step.sampling_requests.append((request_id, state))
        step.num_tokens = len(tokens)
        patch = self._device_tokens(from_device)

        forward_start = time.perf_counter()
        graphs = self.engine.decode_graphs
        if graphs is not None and not multi_rows and graphs.fits(len(scheduled), max(context_lens)):
            # A generation step: replay the captured graph; one row per request.
            logits = graphs.run(tokens, positions, slots, context_lens, [s.block_table for _, s, _ in scheduled], patch)
            if len(sample_rows) < len(scheduled):
                logits = logits.index_select(0, _to_device(sample_rows, torch.int64, self.device))
        else:
            logits = self._forward_eager(scheduled, tokens, positions, slots, query_start, context_lens,
                                         single_rows, multi_rows, sample_rows, patch)
        sample_start = time.perf_counter()
        if step.sampling_requests:
            step.sampled = self.sampler.sample_on_device(logits, [s.sampling for _, s in step.sampling_requests])
            if self.device.type == "cuda":
                step.sampled_host = torch.empty(step.sampled.shape, dtype=step.sampled.dtype, pin_memory=True)
                step.sampled_host.copy_(step.sampled, non_blocking=True)
                step.done = torch.cuda.Event()
                step.done.record()
        if start_mark is not None:
            step.marks = (start_mark, self.timeline.mark())
        step.result.forward_us = int((sample_start - forward_start) * 1e6)
        step.result.sample_us = int((time.perf_counter() - sample_start) * 1e6)
        # Bookkeeping only once everything is queued: a failure above leaves the states as they were.
        for request_id, state, count in scheduled:
            state.num_computed_tokens += count
        for row, (_, state) in enumerate(step.sampling_requests):
            state.pending.append((step, row))

    def _device_tokens(self, from_device: list[tuple[int, LaunchedStep, int]]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(token indices, their ids on the device) for input tokens an earlier step sampled."""
        if not from_device:
            return None
        index = _to_device([i for i, _, _ in from_device], torch.int64, self.device)
        by_step: dict[int, tuple[LaunchedStep, list[int]]] = {}
        for _, earlier, row in from_device:
            by_step.setdefault(id(earlier), (earlier, []))[1].append(row)
        if len(by_step) == 1:
            earlier, rows = next(iter(by_step.values()))
            values = earlier.sampled.index_select(0, _to_device(rows, torch.int64, self.device))
        else:  # tokens from several earlier steps, in from_device order
            values = torch.cat([e.sampled[r : r + 1] for _, e, r in from_device])
        return index, values

    def _forward_eager(
        self, scheduled: list[tuple[str, RequestState, int]], tokens: list[int], positions: list[int], slots: list[int],
        query_start: list[int], context_lens: list[int], single_rows: list[int], multi_rows: list[int], sample_rows: list[int],
        patch: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:  # [len(sample_rows), vocab] float32
        device = self.device
        max_blocks = max(len(s.block_table) for _, s, _ in scheduled)
        tables = [s.block_table + [0] * (max_blocks - len(s.block_table)) for _, s, _ in scheduled]
        meta = AttentionMetadata(
            query_start=query_start,
            context_lens=context_lens,
            block_tables=_to_device(tables, torch.int64, device),
            context_lens_t=_to_device(context_lens, torch.int64, device),
            slot_mapping=_to_device(slots, torch.int64, device),
            single_query_rows=_to_device(single_rows, torch.int64, device),
            single_query_tokens=_to_device([query_start[r] for r in single_rows], torch.int64, device),
            multi_query_rows=multi_rows,
        )
        input_ids = _to_device(tokens, torch.int64, device)
        if patch is not None:
            input_ids.index_copy_(0, *patch)
        hidden = self.engine.model(input_ids, _to_device(positions, torch.int64, device), self.engine.kv_cache, meta)
        return self.engine.model.compute_logits(hidden.index_select(0, _to_device(sample_rows, torch.int64, device)))


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    tensor = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor
