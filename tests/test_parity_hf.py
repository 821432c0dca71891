"""Greedy tokens equal Hugging Face transformers' on the same weights.

The oracle is transformers' own Llama implementation loading the same
checkpoint folder (``generate``, greedy, one prompt at a time). inflight must
reproduce it token for token: each prompt alone, all prompts batched
inflight at once, and with a max_num_tokens small enough that long prompts
are split into several context chunks that interleave with generation.
"""

from __future__ import annotations

import asyncio

import pytest

from scheduler_svc.api_types import GenerationRequest
from tests.conftest import MAX_NEW_TOKENS, PROMPTS, run_async


async def _generate(async_engine, prompt: str, **params) -> tuple[list[int], str]:
    ids, text = [], ""
    async for chunk in async_engine.generate(GenerationRequest(text=prompt, **params)):
        ids += chunk.token_ids
        text += chunk.text
    return ids, text


def _greedy(async_engine, prompts):
    async def run():
        return await asyncio.gather(
            *(_generate(async_engine, p, temperature=0.0, max_tokens=MAX_NEW_TOKENS) for p in prompts)
        )

    return [ids for ids, _ in run_async(run())]


@pytest.mark.parametrize(
    "limits",
    [
        pytest.param({}, id="default"),
        pytest.param({"max_num_tokens": 32}, id="chunked-context-32"),
        pytest.param({"max_num_tokens": 48, "max_batch_size": 3}, id="chunked-48-batch3"),
    ],
)
def test_all_prompts_at_once_match_hf(make_async_engine, hf_reference, limits):
    async def run():
        async_engine = await make_async_engine(**limits)
        try:
            results = await asyncio.gather(
                *(_generate(async_engine, p, temperature=0.0, max_tokens=MAX_NEW_TOKENS) for p in PROMPTS)
            )
            # Every block is back in the pool once all requests finished.
            assert async_engine.scheduler.kv.num_free_blocks == async_engine.scheduler.kv.num_blocks
            if limits:  # the long prompts really were split into chunks
                assert async_engine.num_steps > MAX_NEW_TOKENS + 2
            return results
        finally:
            await async_engine.stop()

    results = run_async(run())
    for prompt, (ids, _), expected in zip(PROMPTS, results, hf_reference):
        assert ids == expected, f"prompt {prompt[:40]!r}"


def test_each_prompt_alone_matches_hf(make_async_engine, hf_reference):
    async def run():
        async_engine = await make_async_engine()
        try:
            return [await _generate(async_engine, p, temperature=0.0, max_tokens=MAX_NEW_TOKENS) for p in PROMPTS]
        finally:
            await async_engine.stop()

    for prompt, (ids, _), expected in zip(PROMPTS, run_async(run()), hf_reference):
        assert ids == expected, f"prompt {prompt[:40]!r}"


def test_streamed_text_equals_decoding_all_tokens(make_async_engine, tokenizer):
    async def run():
        async_engine = await make_async_engine()
        try:
            return await asyncio.gather(*(_generate(async_engine, p, temperature=0.0, max_tokens=40) for p in PROMPTS[:4]))
        finally:
            await async_engine.stop()

    for ids, text in run_async(run()):
        assert text == tokenizer.decode(ids)


def test_seeded_sampling_is_reproducible_alone_and_batched(make_async_engine):
    params = dict(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=16)

    async def run():
        async_engine = await make_async_engine()
        try:
            alone = await _generate(async_engine, PROMPTS[2], **params)
            again = await _generate(async_engine, PROMPTS[2], **params)
            others = [_generate(async_engine, p, temperature=1.0, seed=i, max_tokens=16) for i, p in enumerate(PROMPTS)]
            batched, *_ = await asyncio.gather(_generate(async_engine, PROMPTS[2], **params), *others)
            different = await _generate(async_engine, PROMPTS[2], **{**params, "seed": 99})
            return alone, again, batched, different
        finally:
            await async_engine.stop()

    alone, again, batched, different = run_async(run())
    assert alone == again == batched
    assert different != alone
