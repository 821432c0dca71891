"""The executor's gRPC server: Info, the Step stream that runs plans, and EndRounds.

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
from executor_svc.speculative.proposer import SpeculativeMode
from executor_svc.step_pipeline import StepPipeline
from protos import executor_pb2 as ex
from protos import executor_pb2_grpc as ex_grpc
from protos.grpc_settings import SERVER_OPTIONS, listen
from protos.plan import ExecutorInfo

log = logging.getLogger("inflight.executor")


def executor_info(runner: ModelRunner) -> ExecutorInfo:
    engine, spec = runner.engine, runner.engine.speculative
    return ExecutorInfo(
        model=engine.model_config.name, vocab_size=engine.model_config.vocab_size,
        num_kv_blocks=engine.num_kv_blocks, tokens_per_block=engine.tokens_per_block,
        max_batch_size=engine.max_batch_size, max_num_tokens=engine.max_num_tokens,
        max_seq_len=engine.max_seq_len, device=engine.device_name, dtype=engine.manifest.dtype,
        num_host_blocks=engine.kv_offload.num_host_blocks if engine.kv_offload is not None else 0,
        speculative_mode=spec.mode.value,
        max_draft_tokens=runner.max_draft_tokens,
        drafts_need_lookahead_slots=spec.mode is SpeculativeMode.DRAFT_MODEL,
        max_speculative_rounds=runner.max_rounds,
        draft_tree_rows=runner.draft_tree_rows,
    )


class ExecutorService(ex_grpc.ExecutorServicer):
    def __init__(self, engine: Engine, pipeline: StepPipeline) -> None:
        self.engine = engine
        self.pipeline = pipeline
        self._attached = threading.Lock()

    def Info(self, request: ex.InfoRequest, context: grpc.ServicerContext) -> ex.InfoResponse:
        return wire.info_to_pb(executor_info(self.pipeline.runner))

    def EndRounds(self, request: ex.EndRoundsRequest, context: grpc.ServicerContext) -> ex.EndRoundsResponse:
        self.pipeline.runner.end_rounds(request.step_id)
        return ex.EndRoundsResponse()

    def Step(self, request_iterator: Iterator[ex.StepPlan], context: grpc.ServicerContext) -> Iterator[ex.StepResult]:
        if not self._attached.acquire(blocking=False):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "another scheduler is attached to this executor")
        log.info("scheduler attached from %s", context.peer())
        # Plans are read on their own thread, so that the next plan reaches the
        # pipeline while the current step still runs (the overlap needs it there).
        results: queue.SimpleQueue = queue.SimpleQueue()

        def read_plans() -> None:
            try:
                for plan_pb in request_iterator:
                    self.pipeline.submit(wire.plan_from_pb(plan_pb), results.put)
            except ValueError as exc:  # a malformed plan: end the stream, the scheduler attaches again
                log.error("malformed step plan, closing the step stream: %s", exc)
            except Exception as exc:  # noqa: BLE001 - the stream broke: the scheduler is gone
                log.info("step stream ended: %s", exc)
            finally:
                results.put(_END_OF_PLANS)

        reader = threading.Thread(target=read_plans, name="inflight-plan-reader", daemon=True)
        reader.start()
        try:
            while (item := results.get()) is not _END_OF_PLANS:
                if isinstance(item, BaseException):
                    raise item
                yield wire.result_to_pb(item)
        finally:
            try:
                self.pipeline.reset()  # after every plan already submitted
            except RuntimeError:  # shutting down: the state goes with the process
                pass
            self._attached.release()
            log.info("scheduler detached")


_END_OF_PLANS = object()


def serve_executor(engine: Engine, address: str, overlap: bool = True) -> tuple[grpc.Server, StepPipeline]:
    """Start the executor's gRPC server on ``address`` (host:port).

    Returns the running server and the step pipeline, whose ``run_forever``
    the caller runs on the main thread until ``stop``.
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4),
        options=SERVER_OPTIONS,
    )
    pipeline = StepPipeline(ModelRunner(engine), overlap=overlap)
    ex_grpc.add_ExecutorServicer_to_server(ExecutorService(engine, pipeline), server)
    listen(server, address, "executor")
    server.start()
    log.info("executor serving on %s", address)
    return server, pipeline
