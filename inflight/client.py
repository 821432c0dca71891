"""Python client for the ``inflight.v1`` API, sync (``Client``) and async (``AsyncClient``).

    from inflight.client import Client
    with Client("127.0.0.1:50051") as client:
        for chunk in client.generate_stream("Once upon a time", max_tokens=32):
            print(chunk.text, end="", flush=True)

Errors surface as ``grpc.RpcError`` with the server's status code and message
(INVALID_ARGUMENT names the field at fault).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from protos import generation_pb2 as pb
from protos import generation_pb2_grpc as pb_grpc

DEFAULT_ADDRESS = "127.0.0.1:50051"
DEFAULT_RETENTION_PRIORITY = 35  # the server's retention priority for ordinary blocks
_FINISH_NAMES = {
    pb.FINISH_REASON_UNSPECIFIED: None,
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_EOS: "eos",
    pb.FINISH_REASON_CANCELLED: "cancelled",
    pb.FINISH_REASON_ERROR: "error",
}


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens reused from the prefix cache
    # Why the other prompt tokens were computed: reason -> tokens (see NotReusedTokens in generation.proto).
    not_reused: dict[str, int] = field(default_factory=dict)
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # speculative decoding: drafts verified for the request
    num_accepted_draft_tokens: int = 0


@dataclass(slots=True)
class Chunk:
    """One streamed message: new tokens and their text; the last has finish_reason."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    usage: Usage | None
    error: str


@dataclass(slots=True)
class Completion:
    """A whole completion, assembled from its chunks."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str = ""

    def add(self, chunk: Chunk) -> None:
        self.request_id = chunk.request_id
        self.text += chunk.text
        self.token_ids.extend(chunk.token_ids)
        if chunk.finish_reason is not None:
            self.finish_reason, self.usage, self.error = chunk.finish_reason, chunk.usage, chunk.error


def build_request(
    prompt: str | None = None,
    *,
    token_ids: Sequence[int] | None = None,
    messages: Sequence[dict[str, str]] | None = None,
    add_generation_prompt: bool = True,
    max_tokens: int | None = None,
    min_tokens: int = 0,
    temperature: float | None = None,
    top_k: int = 0,
    top_p: float | None = None,
    min_p: float = 0.0,
    repetition_penalty: float | None = None,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    request_id: str = "",
    priority: int = 0,
    cache_salt: str = "",
    retain_prefix_tokens: int = 0,
    retention_priority: int = DEFAULT_RETENTION_PRIORITY,
    final_only: bool = False,
) -> pb.GenerateRequest:
    """A GenerateRequest from keyword arguments (exactly one of prompt, token_ids, messages).

    ``priority`` (higher first, [-100, 100]) orders admission; ``cache_salt`` keeps
    this request's prefix-cache blocks apart from other salts'; the blocks of the
    first ``retain_prefix_tokens`` tokens stay cached at ``retention_priority``
    ([0, 100]; ordinary blocks have 35, lower is evicted first). ``final_only``: the
    server answers once, with the finished completion (what ``generate`` asks for).
    """
    req = pb.GenerateRequest(request_id=request_id, priority=priority, cache_salt=cache_salt, final_only=final_only)
    if retain_prefix_tokens:
        req.kv_cache_retention.num_prefix_tokens = retain_prefix_tokens
        req.kv_cache_retention.priority = retention_priority
    if prompt is not None:
        req.text = prompt
    if token_ids is not None:
        req.token_ids.ids.extend(token_ids)
    if messages is not None:
        req.chat.SetInParent()
        for message in messages:
            req.chat.messages.add(role=message["role"], content=message["content"])
        req.chat.add_generation_prompt = add_generation_prompt
    s = req.sampling
    if temperature is not None:
        s.temperature = temperature
    if top_p is not None:
        s.top_p = top_p
    if repetition_penalty is not None:
        s.repetition_penalty = repetition_penalty
    if seed is not None:
        s.seed = seed
    s.top_k, s.min_p, s.presence_penalty, s.frequency_penalty = top_k, min_p, presence_penalty, frequency_penalty
    t = req.stopping
    if max_tokens is not None:
        t.max_tokens = max_tokens
    t.min_tokens, t.ignore_eos = min_tokens, ignore_eos
    t.stop.extend(stop)
    t.stop_token_ids.extend(stop_token_ids)
    return req


def chunk_from_pb(msg: pb.GenerateResponse) -> Chunk:
    usage = None
    if msg.HasField("usage"):
        not_reused = {f.name: value for f, value in msg.usage.not_reused.ListFields()}
        usage = Usage(
            msg.usage.prompt_tokens, msg.usage.completion_tokens, msg.usage.cached_tokens, not_reused, msg.usage.num_preemptions,
            msg.usage.num_draft_tokens, msg.usage.num_accepted_draft_tokens,
        )
    return Chunk(msg.request_id, list(msg.token_ids), msg.text, _FINISH_NAMES[msg.finish_reason], usage, msg.error)


class Client:
    """Blocking client."""

    def __init__(self, address: str = DEFAULT_ADDRESS) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.GenerationStub(self.channel)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def wait_ready(self, timeout: float = 60.0) -> None:
        grpc.channel_ready_future(self.channel).result(timeout=timeout)

    def generate_stream(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs) -> Iterator[Chunk]:
        """Stream chunks as they are produced; see ``build_request`` for the arguments."""
        call = self.stub.Generate(build_request(prompt, **kwargs), timeout=timeout)
        try:
            for msg in call:
                yield chunk_from_pb(msg)
        finally:
            call.cancel()  # no-op when the stream ended; frees the request when left early

    def generate(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs) -> Completion:
        """The whole completion, sent by the server in one response."""
        completion = Completion(request_id="")
        for chunk in self.generate_stream(prompt, timeout=timeout, final_only=True, **kwargs):
            completion.add(chunk)
        return completion

    def tokenize(self, text: str | None = None, messages: Sequence[dict[str, str]] | None = None) -> list[int]:
        req = pb.TokenizeRequest(text=text) if text is not None else pb.TokenizeRequest()
        for message in messages or ():
            req.chat.messages.add(role=message["role"], content=message["content"])
        return list(self.stub.Tokenize(req).token_ids)

    def model_info(self) -> pb.ModelInfoResponse:
        return self.stub.ModelInfo(pb.ModelInfoRequest())

    def stats(self) -> pb.StatsResponse:
        return self.stub.Stats(pb.StatsRequest())


# Generation streams one asyncio client keeps open at once; the rest wait their turn in the
# client. With grpcio 1.84's asyncio stack, a process holding more than about 1,100 open
# streams saw some of them cancelled by its own gRPC core (1,500 concurrent calls: about 60
# CANCELLED; 3,000 with at most 1,000 open: none), whatever the server, and on several channels
# alike.
MAX_OPEN_STREAMS = 1000


class AsyncClient:
    """asyncio client. At most ``max_open_streams`` generation calls are open at once; more wait."""

    def __init__(self, address: str = DEFAULT_ADDRESS, max_open_streams: int = MAX_OPEN_STREAMS) -> None:
        if max_open_streams < 1:
            raise ValueError(f"max_open_streams must be at least 1, got {max_open_streams}")
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self._open_streams = asyncio.Semaphore(max_open_streams)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def wait_ready(self, timeout: float = 60.0) -> None:
        import asyncio

        await asyncio.wait_for(self.channel.channel_ready(), timeout)

    async def generate_stream(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs) -> AsyncIterator[Chunk]:
        request = build_request(prompt, **kwargs)  # a bad argument fails here, before taking a stream
        async with self._open_streams:
            call = self.stub.Generate(request, timeout=timeout)
            try:
                async for msg in call:
                    yield chunk_from_pb(msg)
            finally:
                call.cancel()

    async def generate(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs) -> Completion:
        """The whole completion, sent by the server in one response."""
        completion = Completion(request_id="")
        async for chunk in self.generate_stream(prompt, timeout=timeout, final_only=True, **kwargs):
            completion.add(chunk)
        return completion

    async def tokenize(self, text: str | None = None, messages: Sequence[dict[str, str]] | None = None) -> list[int]:
        req = pb.TokenizeRequest(text=text) if text is not None else pb.TokenizeRequest()
        for message in messages or ():
            req.chat.messages.add(role=message["role"], content=message["content"])
        return list((await self.stub.Tokenize(req)).token_ids)

    async def model_info(self) -> pb.ModelInfoResponse:
        return await self.stub.ModelInfo(pb.ModelInfoRequest())

    async def stats(self) -> pb.StatsResponse:
        return await self.stub.Stats(pb.StatsRequest())
