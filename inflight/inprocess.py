"""An executor in the scheduler's own process: the offline path of the LLM API.

It implements the scheduler's ``ExecutorConnection`` interface by calling the
executor's ``ModelRunner`` directly, so the same StepPlan / StepResult
dataclasses pass between the two services without gRPC or protobuf.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from executor_svc.engine import Engine
from executor_svc.runner import ModelRunner
from executor_svc.service import executor_info
from protos.plan import ExecutorInfo, StepPlan, StepResult


class InProcessExecutor:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.runner = ModelRunner(engine)
        # Every step on the same thread: each new thread that enters torch gets its own
        # OpenMP team, and idle teams spinning on a small CPU slow the one computing.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inflight-executor")

    async def info(self) -> ExecutorInfo:
        return executor_info(self.engine)

    async def step(self, plan: StepPlan) -> StepResult:
        # In a worker thread: torch releases the GIL, so the event loop keeps
        # streaming and accepting requests while the model runs.
        return await asyncio.get_running_loop().run_in_executor(self._thread, self.runner.execute, plan)

    async def close(self) -> None:
        self.runner.reset()
        self._thread.shutdown(wait=False)
