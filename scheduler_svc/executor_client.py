"""How the scheduler reaches an executor.

``ExecutorConnection`` is the whole interface: Info once, then one StepResult
per StepPlan. ``GrpcExecutorConnection`` speaks the ``inflight.executor.v2``
protocol over one bidirectional stream; the offline LLM API plugs an
in-process runner into the same interface from above.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Protocol

import grpc

from protos import executor_pb2 as ex
from protos import executor_pb2_grpc as ex_grpc
from protos.grpc_settings import MESSAGE_SIZE_OPTIONS
from protos.plan import ExecutorInfo, StepPlan, StepResult
from scheduler_svc import wire

log = logging.getLogger("inflight.scheduler")


class ExecutorUnavailable(RuntimeError):
    """The executor cannot be reached or went away mid-stream."""


class ExecutorConnection(Protocol):
    async def info(self) -> ExecutorInfo: ...

    async def step(self, plan: StepPlan) -> StepResult:
        """The result of ``plan``. Several calls may be outstanding; results come in plan order."""
        ...

    async def end_rounds(self, step_id: int) -> None:
        """Ask step ``step_id`` to end its chained verification rounds after the round in flight."""
        ...

    async def close(self) -> None: ...


class GrpcExecutorConnection:
    def __init__(self, address: str, connect_timeout_s: float = 600.0) -> None:
        self.address = address
        self.connect_timeout_s = connect_timeout_s
        self._channel = grpc.aio.insecure_channel(
            address,
            options=[
                *MESSAGE_SIZE_OPTIONS,
                # Notice a restarted executor within seconds, not grpc's default two minutes.
                ("grpc.initial_reconnect_backoff_ms", 200),
                ("grpc.max_reconnect_backoff_ms", 2000),
            ],
        )
        self._stub = ex_grpc.ExecutorStub(self._channel)
        self._call: grpc.aio.StreamStreamCall | None = None
        # Plans written and not answered yet, oldest first; one reader task answers them.
        self._waiting: deque[asyncio.Future[StepResult]] = deque()
        self._reader: asyncio.Task[None] | None = None
        self._write_lock: asyncio.Lock | None = None  # gRPC allows one write in progress per stream
        self._end_rounds_unsupported = False  # an executor of an earlier version answered UNIMPLEMENTED

    async def info(self) -> ExecutorInfo:
        """Waits (up to connect_timeout_s) for the executor to come up: it may still be loading."""
        try:
            reply = await self._stub.Info(ex.InfoRequest(), wait_for_ready=True, timeout=self.connect_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise ExecutorUnavailable(f"executor at {self.address}: {exc.code().name}: {exc.details()}") from exc
        return wire.info_from_pb(reply)

    async def step(self, plan: StepPlan) -> StepResult:
        future: asyncio.Future[StepResult] = asyncio.get_running_loop().create_future()
        try:
            if self._call is None:
                self._call = self._stub.Step(wait_for_ready=True)
                self._reader = asyncio.create_task(self._read_results(self._call), name="inflight-step-results")
            if self._write_lock is None:
                self._write_lock = asyncio.Lock()
            call = self._call
            self._waiting.append(future)
            message = wire.plan_to_pb(plan)
            async with self._write_lock:  # writes stay in plan order: the lock wakes waiters first come, first served
                await call.write(message)
        except grpc.aio.AioRpcError as exc:
            self._fail(f"executor at {self.address}: {exc.code().name}: {exc.details()}")
        return await future

    async def end_rounds(self, step_id: int) -> None:
        """A hint, not a command: an executor that is gone or predates EndRounds runs the step's rounds out,
        which costs the waiting request time, never a token."""
        if self._end_rounds_unsupported:
            return
        try:
            await self._stub.EndRounds(ex.EndRoundsRequest(step_id=step_id), timeout=5.0)
        except grpc.aio.UsageError:  # the channel closed meanwhile: the engine is stopping
            return
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._end_rounds_unsupported = True
                log.info("executor at %s cannot end a step's rounds early: arriving requests wait for them",
                         self.address)

    async def _read_results(self, call: grpc.aio.StreamStreamCall) -> None:
        try:
            while True:
                reply = await call.read()
                if reply is grpc.aio.EOF:
                    self._fail(f"executor at {self.address} closed the step stream", call)
                    return
                if self._waiting:
                    try:
                        result = wire.result_from_pb(reply)
                    except ValueError as exc:  # columns that disagree: nothing on this stream can be trusted
                        self._fail(f"executor at {self.address} sent a malformed result: {exc}", call)
                        return
                    future = self._waiting.popleft()
                    if not future.done():
                        future.set_result(result)
        except grpc.aio.AioRpcError as exc:
            self._fail(f"executor at {self.address}: {exc.code().name}: {exc.details()}", call)
        except asyncio.CancelledError:
            self._fail(f"executor at {self.address}: connection closed", call)

    def _fail(self, message: str, call: grpc.aio.StreamStreamCall | None = None) -> None:
        """The stream is gone: every outstanding step fails, and the next one opens a new stream."""
        if call is not None and call is not self._call:
            return  # an older stream's reader, already replaced
        if self._call is not None:
            self._call.cancel()
        self._call = None
        while self._waiting:
            future = self._waiting.popleft()
            if not future.done():
                future.set_exception(ExecutorUnavailable(message))

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._fail(f"executor at {self.address}: connection closed")
        await self._channel.close()
