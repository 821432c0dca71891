"""The prompt-step warm-up at load: it runs the step it promises and leaves nothing behind that a request sees."""

from __future__ import annotations

import asyncio

import pytest
import torch

import executor_svc.warm_up as warm_up
from executor_svc.warm_up import PROMPT_TOKENS, warm_up_prompt_step
from scheduler_svc.api_types import GenerationRequest
from tests.conftest import MAX_NEW_TOKENS, PROMPTS, run_async


def test_warm_up_runs_whole_prompts_within_the_token_budget(engine):
    assert warm_up_prompt_step(engine, max_tokens=2 * PROMPT_TOKENS + 5) == 2 * PROMPT_TOKENS
    assert warm_up_prompt_step(engine, max_tokens=1) == PROMPT_TOKENS  # at least one prompt


def test_requests_after_a_warm_up_match_hf(engine, make_async_engine, hf_reference):
    """The warm-up writes KV entries into blocks that requests get later: they must not leak into outputs."""
    warm_up_prompt_step(engine, max_tokens=4 * PROMPT_TOKENS)

    async def run():
        async_engine = await make_async_engine()
        try:
            async def one(prompt: str) -> list[int]:
                ids: list[int] = []
                request = GenerationRequest(text=prompt, temperature=0.0, max_tokens=MAX_NEW_TOKENS)
                async for chunk in async_engine.generate(request):
                    ids += chunk.token_ids
                return ids

            return await asyncio.gather(*(one(p) for p in PROMPTS))
        finally:
            await async_engine.stop()

    assert run_async(run()) == hf_reference


def test_a_warm_up_that_runs_out_of_memory_says_what_to_change(engine, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(warm_up, "run_packed", out_of_memory)
    with pytest.raises(RuntimeError, match="max_num_tokens .*--kv-cache-fraction"):
        warm_up_prompt_step(engine, max_tokens=PROMPT_TOKENS)
