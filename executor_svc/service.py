"""The executor's gRPC server: Info, and the Step stream that runs plans.

One scheduler drives an executor at a time: a second Step stream is refused
with FAILED_PRECONDITION rather than interleaving two schedulers' block ids in
one KV cache. When the stream ends (the scheduler went away), all request
state is dropped, since the blocks it referred to belong to that scheduler.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc

from executor_svc import wire
from executor_svc.engine import Engine
from executor_svc.runner import ModelRunner
from protos import executor_pb2 as ex
from protos import executor_pb2_grpc as ex_grpc
from protos.plan import ExecutorInfo, StepPlan, StepResult

log = logging.getLogger("inflight.executor")

MAX_MESSAGE_BYTES = 64 << 20  # a NewRequest carries whole prompts


def executor_info(engine: Engine) -> ExecutorInfo:
    return ExecutorInfo(
        model=engine.model_config.name, vocab_size=engine.model_config.vocab_size,
        num_kv_blocks=engine.num_kv_blocks, tokens_per_block=engine.tokens_per_block,
        max_batch_size=engine.max_batch_size, max_num_tokens=engine.max_num_tokens,
        max_seq_len=engine.max_seq_len, device=engine.device_name, dtype=engine.manifest.dtype,
    )


class MainThreadRunner:
    """Runs steps on the thread that calls ``run_forever`` (the process's main thread).

    gRPC handlers run in a thread pool; torch's CPU kernels measurably lose
    parallelism when called from such a worker thread, so handlers hand their
    plans to the main thread and wait for the result instead.
    """

    _STOP = object()

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = threading.Event()

    def execute(self, plan: StepPlan) -> StepResult:
        return self._submit(plan)

    def reset(self) -> None:
        self._submit(None)

    def _submit(self, plan: StepPlan | None):
        if self._stopped.is_set():
            raise RuntimeError("executor is shutting down")
        done: futures.Future = futures.Future()
        self._work.put((plan, done))
        return done.result()

    def run_forever(self) -> None:
        while (item := self._work.get()) is not self._STOP:
            plan, done = item
            try:
                done.set_result(self.runner.reset() if plan is None else self.runner.execute(plan))
            except BaseException as exc:  # the handler re-raises it
                done.set_exception(exc)
        # Nobody will run what is still queued: release the handlers waiting on it.
        while not self._work.empty():
            item = self._work.get()
            if item is not self._STOP:
                item[1].set_exception(RuntimeError("executor is shutting down"))

    def stop(self) -> None:
        self._stopped.set()
        self._work.put(self._STOP)


class ExecutorService(ex_grpc.ExecutorServicer):
    def __init__(self, engine: Engine, runner: MainThreadRunner | ModelRunner) -> None:
        self.engine = engine
        self.runner = runner
        self._attached = threading.Lock()

    def Info(self, request: ex.InfoRequest, context: grpc.ServicerContext) -> ex.InfoResponse:
        return wire.info_to_pb(executor_info(self.engine))

    def Step(self, request_iterator: Iterator[ex.StepPlan], context: grpc.ServicerContext) -> Iterator[ex.StepResult]:
        if not self._attached.acquire(blocking=False):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "another scheduler is attached to this executor")
        log.info("scheduler attached from %s", context.peer())
        try:
            for plan_pb in request_iterator:
                yield wire.result_to_pb(self.runner.execute(wire.plan_from_pb(plan_pb)))
        finally:
            try:
                self.runner.reset()
            except RuntimeError:  # shutting down: the state goes with the process
                pass
            self._attached.release()
            log.info("scheduler detached")


def serve_executor(engine: Engine, address: str) -> tuple[grpc.Server, MainThreadRunner]:
    """Start the executor's gRPC server on ``address`` (host:port).

    Returns the running server and the step runner, whose ``run_forever`` the
    caller runs on the main thread until ``stop``.
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4),
        options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)],
    )
    runner = MainThreadRunner(ModelRunner(engine))
    ex_grpc.add_ExecutorServicer_to_server(ExecutorService(engine, runner), server)
    if server.add_insecure_port(address) == 0:
        raise OSError(f"executor could not bind {address}")
    server.start()
    log.info("executor serving on %s", address)
    return server, runner
