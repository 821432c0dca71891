"""MAX_UTILIZATION on the real model with a KV pool too small for the load:
requests are preempted and resumed by recompute, produce the same greedy
tokens as without preemption, and leave no block behind (also when cancelled)."""

from __future__ import annotations

import asyncio

from scheduler_svc.api_types import GenerationRequest
from scheduler_svc.scheduler import CapacityPolicy
from tests.conftest import PROMPTS, run_async
from tests.test_prefix_cache import assert_no_leaks, complete

SHORT_PROMPTS = PROMPTS[:4]  # a few tokens each
OUTPUT_TOKENS = 24  # ~30 tokens = 2-3 blocks of 16 per request: 4 requests need ~10 blocks
TINY_POOL = 6


def test_greedy_tokens_identical_under_preemption(make_async_engine):
    async def run(**limits):
        engine = await make_async_engine(max_batch_size=4, **limits)
        try:
            results = await asyncio.gather(*(complete(engine, p, max_tokens=OUTPUT_TOKENS) for p in SHORT_PROMPTS))
            assert_no_leaks(engine)
            return results, engine.stats()
        finally:
            await engine.stop()

    reference, _ = run_async(run())
    squeezed, stats = run_async(run(num_kv_blocks=TINY_POOL, capacity_policy=CapacityPolicy.MAX_UTILIZATION))
    assert stats.num_preemptions > 0
    assert sum(usage.num_preemptions for _, usage in squeezed) == stats.num_preemptions
    assert [ids for ids, _ in squeezed] == [ids for ids, _ in reference]


def test_cancelling_during_preemptions_returns_every_block(make_async_engine):
    async def run():
        engine = await make_async_engine(
            max_batch_size=4, num_kv_blocks=TINY_POOL, capacity_policy=CapacityPolicy.MAX_UTILIZATION
        )
        try:
            requests = [engine.add(GenerationRequest(text=p, max_tokens=80, ignore_eos=True)) for p in SHORT_PROMPTS]

            async def consume(request):
                async for _ in engine.stream(request):
                    pass

            clients = [asyncio.create_task(consume(r)) for r in requests]
            while engine.scheduler.num_preemptions < 2:
                await asyncio.sleep(0.05)
            for client in clients:
                client.cancel()
            await asyncio.gather(*clients, return_exceptions=True)
            await asyncio.sleep(0.2)
            assert_no_leaks(engine)
        finally:
            await engine.stop()

    run_async(run())


def test_high_priority_request_overtakes_a_full_pool(make_async_engine):
    """Under MAX_UTILIZATION a high-priority arrival preempts the running low-priority work."""

    async def run():
        engine = await make_async_engine(
            max_batch_size=4, num_kv_blocks=TINY_POOL, capacity_policy=CapacityPolicy.MAX_UTILIZATION
        )
        try:
            background = [
                asyncio.create_task(complete(engine, p, max_tokens=40)) for p in SHORT_PROMPTS[:3]
            ]
            while engine.scheduler.kv.num_free_blocks > 1:  # the pool fills up
                await asyncio.sleep(0.05)
            urgent, usage = await complete(engine, SHORT_PROMPTS[3], max_tokens=4, priority=50)
            still_running = sum(not t.done() for t in background)
            await asyncio.gather(*background)
            assert_no_leaks(engine)
            return usage, still_running
        finally:
            await engine.stop()

    usage, still_running = run_async(run())
    assert usage.completion_tokens == 4 and usage.num_preemptions == 0
    assert still_running > 0  # it finished while the earlier requests were still going
