"""Overlapped scheduling: step N+1 is planned and run before step N's result is back.

The scheduler counts the token a step will sample as held, the executor feeds it
into the next step itself, and the tokens that come out are the same as with
one step at a time.
"""

from __future__ import annotations

import asyncio

from protos.plan import RequestOutput, StepResult
from scheduler_svc.api_types import GenerationRequest
from scheduler_svc.request import FinishReason
from tests.conftest import PROMPTS, run_async
from tests.test_scheduler import make_request, make_scheduler


def test_scheduler_plans_ahead_without_passing_max_tokens():
    s = make_scheduler()
    s.add_request(make_request("a", 5, max_tokens=3))
    plans = [s.schedule(), s.schedule()]  # the prompt, then its first decode before any result
    assert plans[0].new_requests[0].num_scheduled_tokens == 5
    assert plans[1].cached_requests[0].num_computed_tokens == 5  # position 5: the token still on its way
    assert plans[1].cached_requests[0].num_scheduled_tokens == 1
    tokens = iter([11, 12, 13, 14])
    finished = None
    while finished is None:
        plan = plans.pop(0)
        out = RequestOutput("a", [next(tokens)]) if "a" in s.requests else RequestOutput("a", [])
        for update in s.update(StepResult(plan.step_id, [out])):
            finished = update.finish_reason
        nxt = s.schedule()
        if not nxt.is_empty:
            plans.append(nxt)
    assert finished is FinishReason.LENGTH
    # Three outputs, three sampling steps: never a fourth planned past max_tokens.
    assert not plans
    assert s.kv.num_free_blocks == s.config.num_kv_blocks


class _CountingExecutor:
    """Wraps an executor connection and records how many steps were outstanding at once."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.outstanding = 0
        self.max_outstanding = 0

    async def info(self):
        return await self.inner.info()

    async def step(self, plan):
        self.outstanding += 1
        self.max_outstanding = max(self.max_outstanding, self.outstanding)
        try:
            return await self.inner.step(plan)
        finally:
            self.outstanding -= 1

    async def close(self) -> None:
        await self.inner.close()


def _generate_all(engine, tokenizer, overlap: bool) -> tuple[list[list[int]], int]:
    from inflight.inprocess import InProcessExecutor
    from scheduler_svc.engine_loop import AsyncEngine, EngineLimits

    async def run():
        executor = _CountingExecutor(InProcessExecutor(engine))
        async_engine = AsyncEngine(executor, tokenizer, EngineLimits(overlap_scheduling=overlap))
        await async_engine.start()
        try:
            async def one(i: int, prompt: str) -> list[int]:
                # A mix: greedy to EOS or max_tokens, seeded sampling, and penalties (which need
                # the previous token on the host before sampling the next).
                extra = [dict(temperature=0.0), dict(temperature=0.8, seed=i), dict(temperature=0.0, repetition_penalty=1.3)][i % 3]
                request = GenerationRequest(text=prompt, max_tokens=12 + i, **extra)
                ids: list[int] = []
                async for chunk in async_engine.generate(request):
                    ids.extend(chunk.token_ids)
                return ids

            outputs = await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))
            assert async_engine.scheduler.kv.num_free_blocks == async_engine.scheduler.config.num_kv_blocks
            return list(outputs), executor.max_outstanding
        finally:
            await async_engine.stop()

    return run_async(run())


def test_overlap_gives_the_same_tokens_as_one_step_at_a_time(engine, tokenizer):
    serial, serial_depth = _generate_all(engine, tokenizer, overlap=False)
    overlapped, overlap_depth = _generate_all(engine, tokenizer, overlap=True)
    assert serial_depth == 1 and overlap_depth == 2
    assert overlapped == serial
