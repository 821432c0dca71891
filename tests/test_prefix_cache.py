"""Prefix reuse on the real model: the same greedy tokens with reuse on and off,
usage.cached_tokens and the not-reused reasons, salts, and no leaked block."""

from __future__ import annotations

import asyncio

from scheduler_svc.api_types import GenerationRequest, Usage
from scheduler_svc.engine_loop import AsyncEngine
from tests.conftest import PROMPTS, run_async

# A shared "system prompt" (about 190 tokens: several 16-token blocks) and different questions.
SHARED = PROMPTS[-1].rsplit("In one sentence", 1)[0]
QUESTIONS = ["In one sentence, the main benefit is", "Name the two ideas:", "Why are blocks fixed-size?"]


async def complete(engine: AsyncEngine, prompt: str, max_tokens: int = 8, **options) -> tuple[list[int], Usage]:
    ids, usage = [], None
    async for chunk in engine.generate(GenerationRequest(text=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **options)):
        ids += chunk.token_ids
        usage = chunk.usage or usage
    assert usage is not None
    return ids, usage


async def first_then_together(engine: AsyncEngine, prompts: list[str]) -> list[tuple[list[int], Usage]]:
    """The first prompt alone (it fills the cache), then the others at once."""
    first = await complete(engine, prompts[0])
    rest = await asyncio.gather(*(complete(engine, p) for p in prompts[1:]))
    return [first, *rest]


def assert_no_leaks(engine: AsyncEngine) -> None:
    scheduler = engine.scheduler
    assert not scheduler.has_work and not scheduler.requests
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks
    assert scheduler.kv.check_consistency() == []


def test_greedy_tokens_identical_with_reuse_on_and_off(make_async_engine, tokenizer):
    prompts = [SHARED + q for q in QUESTIONS]

    async def run(enable: bool):
        engine = await make_async_engine(enable_prefix_caching=enable)
        try:
            results = await first_then_together(engine, prompts)
            assert_no_leaks(engine)
            return results, engine.stats()
        finally:
            await engine.stop()

    on, stats_on = run_async(run(True))
    off, stats_off = run_async(run(False))
    assert [ids for ids, _ in on] == [ids for ids, _ in off]
    shared_blocks = len(tokenizer.encode(SHARED)) // 16
    for ids, usage in on[1:]:
        assert usage.cached_tokens >= 16 * (shared_blocks - 1) and usage.cached_tokens % 16 == 0
    for _, usage in on:  # every prompt token is reused or has exactly one reason
        assert usage.cached_tokens + usage.not_reused.total == usage.prompt_tokens
    for _, usage in off:
        assert usage.cached_tokens == 0 and usage.not_reused.caching_disabled == usage.prompt_tokens
    assert stats_on.kv.hit_tokens == sum(u.cached_tokens for _, u in on) > 0
    assert stats_off.kv.hit_tokens == 0


def test_cache_salt_isolates_and_is_explained(make_async_engine):
    async def run():
        engine = await make_async_engine()
        try:
            plain = await complete(engine, SHARED + QUESTIONS[0])
            salted = await complete(engine, SHARED + QUESTIONS[0], cache_salt="tenant-b")
            salted_again = await complete(engine, SHARED + QUESTIONS[1], cache_salt="tenant-b")
            assert_no_leaks(engine)
            return plain, salted, salted_again
        finally:
            await engine.stop()

    (ids, _), (salted_ids, salted), (_, again) = run_async(run())
    assert salted_ids == ids
    assert salted.cached_tokens == 0 and salted.not_reused.salt_differs > 0
    assert again.cached_tokens > 0  # the same salt shares


def test_finished_and_cancelled_requests_leave_their_blocks_cached_not_leaked(make_async_engine):
    async def run():
        engine = await make_async_engine(max_batch_size=2)
        try:
            await complete(engine, SHARED + QUESTIONS[0])
            requests = [engine.add(GenerationRequest(text=SHARED + q, max_tokens=200, ignore_eos=True)) for q in QUESTIONS]
            got_token = asyncio.Event()

            async def consume(request):
                async for _ in engine.stream(request):
                    got_token.set()

            clients = [asyncio.create_task(consume(r)) for r in requests]
            await got_token.wait()
            for client in clients:
                client.cancel()
            await asyncio.gather(*clients, return_exceptions=True)
            await asyncio.sleep(0.2)
            assert_no_leaks(engine)
            stats = engine.stats().kv
            assert stats.num_cached_free_blocks > 0  # the shared prefix is still there to reuse
            _, usage = await complete(engine, SHARED + QUESTIONS[2])
            assert usage.cached_tokens > 0
            assert_no_leaks(engine)
        finally:
            await engine.stop()

    run_async(run())


def test_request_options_are_validated_with_the_field_named(tokenizer):
    import pytest

    from kvcache import KvCacheRetention
    from scheduler_svc.validation import InvalidRequest, Limits, build_request

    limits = Limits(vocab_size=49152, max_seq_len=64)
    ok = build_request(GenerationRequest(token_ids=[1, 2, 3], priority=-100, cache_salt="t",
                                         kv_cache_retention=KvCacheRetention(16, 90)), tokenizer, limits)
    assert (ok.priority, ok.cache_salt, ok.retention) == (-100, "t", KvCacheRetention(16, 90))
    for bad, field in [
        (dict(priority=101), "priority"),
        (dict(cache_salt="x" * 257), "cache_salt"),
        (dict(kv_cache_retention=KvCacheRetention(16, 101)), "kv_cache_retention.priority"),
        (dict(kv_cache_retention=KvCacheRetention(-1, 50)), "kv_cache_retention.num_prefix_tokens"),
    ]:
        with pytest.raises(InvalidRequest) as info:
            build_request(GenerationRequest(token_ids=[1, 2, 3], **bad), tokenizer, limits)
        assert info.value.field == field


def test_offline_llm_api_passes_priorities_salts_and_retention(engine_dir):
    from inflight import LLM, SamplingParams
    from kvcache import KvCacheRetention
    from tests.conftest import TEST_DEVICE

    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    with LLM(engine_dir=engine_dir, device=TEST_DEVICE, kv_cache_gb=0.1, capacity_policy="max_utilization") as llm:
        (first,) = llm.generate(SHARED + QUESTIONS[0], greedy)
        both = llm.generate([SHARED + QUESTIONS[0], SHARED + QUESTIONS[1]], greedy, priority=[0, 5],
                            kv_cache_retention=KvCacheRetention(num_prefix_tokens=64, priority=80))
        (salted,) = llm.generate(SHARED + QUESTIONS[0], greedy, cache_salt="tenant-b")
        stats = llm.stats()
    assert both[0].token_ids == first.token_ids == salted.token_ids
    assert both[0].cached_tokens > 0 and both[1].cached_tokens > 0 and first.cached_tokens == 0
    assert salted.cached_tokens == 0 and salted.not_reused.salt_differs > 0
    assert stats.kv.hit_tokens == both[0].cached_tokens + both[1].cached_tokens
    assert stats.num_running_requests == 0 and stats.kv.num_free_blocks == stats.kv.num_blocks
