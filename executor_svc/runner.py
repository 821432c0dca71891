"""Runs one StepPlan: packs the scheduled tokens, runs the model, samples.

The runner holds per-request state between steps, because plans are diffs:
the tokens a request holds (prompt plus what was sampled here), its block
table and its sampling state. It never allocates KV blocks; it writes where
the plan's block ids say.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from executor_svc.engine import Engine
from executor_svc.sampler import RequestSamplingState, Sampler
from kvcache.layout import slot_mapping
from plugins.attention_metadata import AttentionMetadata
from protos.plan import NewRequest, RequestOutput, StepPlan, StepResult


@dataclass(slots=True)
class RequestState:
    token_ids: list[int]
    num_prompt_tokens: int
    block_table: list[int]
    num_computed_tokens: int
    sampling: RequestSamplingState


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
        started = time.perf_counter()
        for request_id in plan.finished_request_ids:
            self.requests.pop(request_id, None)
        errors: dict[str, str] = {}
        scheduled: list[tuple[str, RequestState, int]] = []  # (id, state, num_tokens)
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
            if count <= 0 or end > len(state.token_ids) or end > capacity or end > self.engine.max_seq_len:
                errors[request_id] = (
                    f"cannot compute tokens [{state.num_computed_tokens}, {end}): request holds "
                    f"{len(state.token_ids)} tokens, its blocks hold {capacity}, max_seq_len is {self.engine.max_seq_len}"
                )
                scheduled.remove((request_id, state, count))
        for request_id in errors:
            self.requests.pop(request_id, None)

        result = StepResult(step_id=plan.step_id, request_errors=errors)
        # Context work (several tokens) is packed before generation work (one token).
        scheduled.sort(key=lambda item: item[2] == 1)
        if scheduled:
            try:
                self._run(scheduled, result)
            except Exception as exc:  # a failed forward fails its batch, not the executor
                result.outputs.clear()
                for request_id, _, _ in scheduled:
                    errors[request_id] = f"step failed: {type(exc).__name__}: {exc}"
                    self.requests.pop(request_id, None)
        result.step_us = int((time.perf_counter() - started) * 1e6)
        return result

    @torch.inference_mode()
    def _run(self, scheduled: list[tuple[str, RequestState, int]], result: StepResult) -> None:
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        context_lens: list[int] = []
        sample_rows: list[int] = []  # token index whose logits pick the next token
        sampling_requests: list[tuple[str, RequestState]] = []  # the requests those rows belong to
        single_rows: list[int] = []
        multi_rows: list[int] = []
        for row, (request_id, state, count) in enumerate(scheduled):
            start, end = state.num_computed_tokens, state.num_computed_tokens + count
            tokens.extend(state.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(slot_mapping(state.block_table, start, end, self.tokens_per_block))
            query_start.append(query_start[-1] + count)
            context_lens.append(end)
            (single_rows if count == 1 else multi_rows).append(row)
            if end == len(state.token_ids):  # reached the last known token: sample the next
                sample_rows.append(query_start[-1] - 1)
                sampling_requests.append((request_id, state))

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
        forward_start = time.perf_counter()
        hidden = self.engine.model(
            _to_device(tokens, torch.int64, device), _to_device(positions, torch.int64, device), self.engine.kv_cache, meta
        )
        logits = self.engine.model.compute_logits(hidden.index_select(0, _to_device(sample_rows, torch.int64, device)))
        sample_start = time.perf_counter()
        sampled = self.sampler.sample(logits, [s.sampling for _, s in sampling_requests]) if sampling_requests else []
        done = time.perf_counter()
        result.forward_us = int((sample_start - forward_start) * 1e6)
        result.sample_us = int((done - sample_start) * 1e6)

        next_token = dict(zip((rid for rid, _ in sampling_requests), sampled))
        for request_id, state, count in scheduled:
            state.num_computed_tokens += count
            token = next_token.get(request_id)
            if token is None:
                result.outputs.append(RequestOutput(request_id, []))
                continue
            state.token_ids.append(token)
            state.sampling.append_output([token])
            result.outputs.append(RequestOutput(request_id, [token]))


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    tensor = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor
