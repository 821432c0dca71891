"""The asyncio client keeps at most ``max_open_streams`` generation streams open; the rest wait in the client."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from inflight.client import AsyncClient
from protos import generation_pb2 as pb
from protos import generation_pb2_grpc as pb_grpc
from tests.conftest import run_async


class _CountingGeneration(pb_grpc.GenerationServicer):
    """Answers every Generate with one token after a short wait, counting the streams open at once."""

    def __init__(self) -> None:
        self.open = 0
        self.most_open = 0

    async def Generate(self, request, context):
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            await asyncio.sleep(0.05)
            yield pb.GenerateResponse(request_id="r", token_ids=[7], text="x", finish_reason=pb.FINISH_REASON_LENGTH)
        finally:
            self.open -= 1


def test_open_streams_are_limited_and_the_rest_wait():
    async def main():
        service = _CountingGeneration()
        server = grpc.aio.server()
        pb_grpc.add_GenerationServicer_to_server(service, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with AsyncClient(f"127.0.0.1:{port}", max_open_streams=3) as client:
                completions = await asyncio.gather(*(client.generate("hi", max_tokens=1) for _ in range(10)))
        finally:
            await server.stop(0)
        return service.most_open, completions

    most_open, completions = run_async(main())
    assert most_open == 3
    assert [c.token_ids for c in completions] == [[7]] * 10


def test_max_open_streams_must_be_positive():
    with pytest.raises(ValueError, match="max_open_streams"):
        AsyncClient("127.0.0.1:1", max_open_streams=0)
