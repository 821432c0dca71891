"""The public ``inflight.v1.Generation`` gRPC service, plus health and reflection."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos import generation_pb2 as pb
from protos import generation_pb2_grpc as pb_grpc
from protos.grpc_settings import SERVER_OPTIONS, listen
from scheduler_svc import wire
from scheduler_svc.engine_loop import AsyncEngine, EngineUnavailable, QueueFull
from scheduler_svc.validation import InvalidRequest, prompt_token_ids

log = logging.getLogger("inflight.scheduler")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):  # type: ignore[override]
        try:
            added = self.engine.add(wire.generation_request_from_pb(request))
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except QueueFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except EngineUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        # Leaving this generator early (client cancel, deadline) aborts the request.
        async for chunk in self.engine.stream(added):
            yield wire.chunk_to_pb(chunk)

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        try:
            ids = prompt_token_ids(wire.tokenize_input_from_pb(request), self.engine.tokenizer, self.engine.limits_for_validation())
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.TokenizeResponse(token_ids=ids, tokens=self.engine.tokenizer.token_strings(ids))

    async def ModelInfo(self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfoResponse:
        return wire.model_info_to_pb(self.engine.describe())

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        return wire.stats_to_pb(self.engine.stats())


@dataclass(slots=True)
class SchedulerServer:
    server: grpc.aio.Server
    health: health.HealthServicer
    health_task: asyncio.Task[None]

    async def stop(self, grace: float = 2.0) -> None:
        self.health_task.cancel()
        await self.server.stop(grace=grace)


async def start_scheduler_server(engine: AsyncEngine, address: str) -> SchedulerServer:
    """Serve Generation, grpc.health.v1 and reflection on ``address``; returns the running server."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    pb_grpc.add_GenerationServicer_to_server(GenerationService(engine), server)
    health_servicer = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    listen(server, address, "scheduler")
    await server.start()
    task = asyncio.create_task(_mirror_health(engine, health_servicer), name="inflight-health")
    log.info("scheduler serving inflight.v1.Generation on %s", address)
    return SchedulerServer(server, health_servicer, task)


async def _mirror_health(engine: AsyncEngine, health_servicer: health.HealthServicer) -> None:
    """Report SERVING while an executor is attached, NOT_SERVING while it is not."""
    current = None
    while True:
        status = health_pb2.HealthCheckResponse.SERVING if engine.healthy else health_pb2.HealthCheckResponse.NOT_SERVING
        if status != current:
            for name in ("", SERVICE_NAME):
                result = health_servicer.set(name, status)
                if result is not None:
                    await result
            current = status
        await asyncio.sleep(0.5)
