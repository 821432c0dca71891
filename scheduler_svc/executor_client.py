"""How the scheduler reaches an executor.

``ExecutorConnection`` is the whole interface: Info once, then one StepResult
per StepPlan. ``GrpcExecutorConnection`` speaks the ``inflight.executor.v1``
protocol over one bidirectional stream; the offline LLM API plugs an
in-process runner into the same interface from above.
"""

from __future__ import annotations

from typing import Protocol

import grpc

from protos import executor_pb2 as ex
from protos import executor_pb2_grpc as ex_grpc
from protos.plan import ExecutorInfo, StepPlan, StepResult
from scheduler_svc import wire

MAX_MESSAGE_BYTES = 64 << 20


class ExecutorUnavailable(RuntimeError):
    """The executor cannot be reached or went away mid-stream."""


class ExecutorConnection(Protocol):
    async def info(self) -> ExecutorInfo: ...

    async def step(self, plan: StepPlan) -> StepResult: ...

    async def close(self) -> None: ...


class GrpcExecutorConnection:
    def __init__(self, address: str, connect_timeout_s: float = 600.0) -> None:
        self.address = address
        self.connect_timeout_s = connect_timeout_s
        self._channel = grpc.aio.insecure_channel(
            address,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                # Notice a restarted executor within seconds, not grpc's default two minutes.
                ("grpc.initial_reconnect_backoff_ms", 200),
                ("grpc.max_reconnect_backoff_ms", 2000),
            ],
        )
        self._stub = ex_grpc.ExecutorStub(self._channel)
        self._call: grpc.aio.StreamStreamCall | None = None

    async def info(self) -> ExecutorInfo:
        """Waits (up to connect_timeout_s) for the executor to come up: it may still be loading."""
        try:
            reply = await self._stub.Info(ex.InfoRequest(), wait_for_ready=True, timeout=self.connect_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise ExecutorUnavailable(f"executor at {self.address}: {exc.code().name}: {exc.details()}") from exc
        return wire.info_from_pb(reply)

    async def step(self, plan: StepPlan) -> StepResult:
        try:
            if self._call is None:
                self._call = self._stub.Step(wait_for_ready=True)
            await self._call.write(wire.plan_to_pb(plan))
            reply = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            self._call = None
            raise ExecutorUnavailable(f"executor at {self.address}: {exc.code().name}: {exc.details()}") from exc
        if reply is grpc.aio.EOF:
            self._call = None
            raise ExecutorUnavailable(f"executor at {self.address} closed the step stream")
        return wire.result_from_pb(reply)

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None
        await self._channel.close()
