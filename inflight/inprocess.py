"""An executor in the scheduler's own process: the offline path of the LLM API.

It implements the scheduler's ``ExecutorConnection`` interface by calling the
executor's ``ModelRunner`` directly, so the same StepPlan / StepResult
dataclasses pass between the two services without gRPC or protobuf.
"""

from __future__ import annotations

import asyncio
import threading

from executor_svc.engine import Engine
from executor_svc.runner import ModelRunner
from executor_svc.service import executor_info
from executor_svc.step_pipeline import StepPipeline
from protos.plan import ExecutorInfo, StepPlan, StepResult


class InProcessExecutor:
    def __init__(self, engine: Engine, overlap: bool = True) -> None:
        self.engine = engine
        self.runner = ModelRunner(engine)
        self.pipeline = StepPipeline(self.runner, overlap=overlap)
        # Every step on the same thread: each new thread that enters torch gets its own
        # OpenMP team, and idle teams spinning on a small CPU slow the one computing.
        # torch releases the GIL, so the event loop keeps streaming while the model runs.
        self._thread = threading.Thread(target=self.pipeline.run_forever, name="inflight-executor", daemon=True)
        self._thread.start()

    async def info(self) -> ExecutorInfo:
        """Called when a scheduler attaches: whatever an earlier one left in the runner is dropped (as a new gRPC stream does)."""
        await asyncio.get_running_loop().run_in_executor(None, self.pipeline.reset)
        return executor_info(self.runner)

    async def step(self, plan: StepPlan) -> StepResult:
        """Results come back in plan order; a second plan may be sent before the first returns."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[StepResult] = loop.create_future()

        def deliver(result: StepResult | BaseException) -> None:
            loop.call_soon_threadsafe(_settle, future, result)

        self.pipeline.submit(plan, deliver)
        return await future

    async def end_rounds(self, step_id: int) -> None:
        self.runner.end_rounds(step_id)

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.pipeline.reset)
        self.pipeline.stop()
        # Wait for the model's thread to end: a daemon thread still inside torch when the
        # interpreter exits is killed there, and torch aborts the process ("terminate called").
        await loop.run_in_executor(None, self._thread.join, 30.0)


def _settle(future: asyncio.Future, result: StepResult | BaseException) -> None:
    if future.done():  # the awaiting task was cancelled
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
