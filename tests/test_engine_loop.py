"""The scheduler's step loop in one process: queue limits, ids, aborts."""

from __future__ import annotations

import asyncio

import pytest

from scheduler_svc.api_types import ChatMessage, GenerationRequest
from scheduler_svc.engine_loop import QueueFull
from scheduler_svc.request import FinishReason
from scheduler_svc.validation import InvalidRequest
from tests.conftest import run_async


def test_full_queue_is_refused_and_duplicate_ids_rejected(make_async_engine):
    async def run():
        engine = await make_async_engine(max_batch_size=1, max_queue_size=2)
        try:
            first = engine.add(GenerationRequest(request_id="a", text="one", max_tokens=4, temperature=0.0))
            with pytest.raises(InvalidRequest, match="request_id"):
                engine.add(GenerationRequest(request_id="a", text="again", max_tokens=4))
            engine.add(GenerationRequest(text="two", max_tokens=4))  # queue: a, two (nothing ran yet)
            with pytest.raises(QueueFull):
                engine.add(GenerationRequest(text="three", max_tokens=4))
            chunks = [c async for c in engine.stream(first)]
            assert chunks[-1].finish_reason is FinishReason.LENGTH
        finally:
            await engine.stop()

    run_async(run())


def test_abort_of_waiting_and_running_requests_returns_every_block(make_async_engine):
    async def run():
        engine = await make_async_engine(max_batch_size=2)
        try:
            requests = [engine.add(GenerationRequest(text=f"Story {i}:", max_tokens=200, ignore_eos=True)) for i in range(4)]
            first_chunk = asyncio.Event()

            async def consume(request):
                async for _ in engine.stream(request):
                    first_chunk.set()

            clients = [asyncio.create_task(consume(r)) for r in requests]
            await first_chunk.wait()  # two are running, two are waiting
            assert len(engine.scheduler.running) == 2 and len(engine.scheduler.waiting) == 2
            for client in clients:  # every client goes away mid-stream
                client.cancel()
            await asyncio.gather(*clients, return_exceptions=True)
            await asyncio.sleep(0.2)
            assert not engine.scheduler.has_work
            assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks
            assert all(r.finish_reason is FinishReason.CANCELLED for r in requests)
        finally:
            await engine.stop()

    run_async(run())


def test_min_tokens_and_ignore_eos_are_honoured(make_async_engine, tokenizer):
    async def run():
        engine = await make_async_engine()
        try:
            eos = min(tokenizer.eos_token_ids)
            ids, last = [], None
            # A short chat answer ends with <|im_end|>, the model's EOS.
            chat = [ChatMessage("user", "What is the capital of France?")]
            req = GenerationRequest(chat=chat, temperature=0.0, max_tokens=64)
            async for chunk in engine.generate(req):
                ids += chunk.token_ids
                last = chunk
            assert last.finish_reason is FinishReason.EOS and ids[-1] == eos
            natural = len(ids)
            forced = GenerationRequest(chat=chat, temperature=0.0, max_tokens=64, min_tokens=natural + 5)
            ids2 = [t async for c in engine.generate(forced) for t in c.token_ids]
            assert len(ids2) >= natural + 5 and eos not in ids2[: natural + 4]
            ignored = GenerationRequest(chat=chat, temperature=0.0, max_tokens=natural + 8, ignore_eos=True)
            ids3 = [t async for c in engine.generate(ignored) for t in c.token_ids]
            assert len(ids3) == natural + 8
        finally:
            await engine.stop()

    run_async(run())


def test_final_only_requests_get_one_chunk_equal_to_the_stream(make_async_engine):
    """A non-streaming caller gets the same tokens and text as a streaming one, in one chunk,
    with and without stop strings (which still end the request where the stream would)."""
    async def run():
        engine = await make_async_engine()
        try:
            prompt = "Once upon a time, in a small village,"
            streamed = [c async for c in engine.generate(GenerationRequest(text=prompt, max_tokens=40, temperature=0.0))]
            assert len(streamed) > 1
            text = "".join(c.text for c in streamed)
            for stop in ([], [text.split()[3]]):
                plain = [c async for c in engine.generate(GenerationRequest(text=prompt, max_tokens=40, temperature=0.0, stop=stop))]
                final = [c async for c in engine.generate(
                    GenerationRequest(text=prompt, max_tokens=40, temperature=0.0, stop=stop, final_only=True))]
                assert len(final) == 1 and final[0].finish_reason is plain[-1].finish_reason
                assert final[0].token_ids == [t for c in plain for t in c.token_ids]
                assert final[0].text == "".join(c.text for c in plain)
                assert final[0].usage.completion_tokens == plain[-1].usage.completion_tokens
            assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks
        finally:
            await engine.stop()

    run_async(run())
