"""The offline LLM API: same tokens as the served path, engine round trip, streaming."""

from __future__ import annotations

import asyncio
import threading

import pytest

from inflight import LLM, BuildConfig, SamplingParams
from tests.conftest import MAX_NEW_TOKENS, PROMPTS, TEST_DEVICE


@pytest.fixture(scope="module")
def llm(engine_dir):
    with LLM(engine_dir=engine_dir, device=TEST_DEVICE, kv_cache_gb=0.25) as instance:
        yield instance


def test_generate_matches_transformers(llm, hf_reference):
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0))
    assert [o.prompt for o in outputs] == PROMPTS
    for out, expected in zip(outputs, hf_reference):
        assert out.token_ids == expected
        assert out.text == llm.tokenizer.decode(expected)
        assert out.finish_reason in ("length", "eos")


def test_generate_async_streams(llm):
    async def run():
        chunks = [c async for c in llm.generate_async(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0))]
        return chunks

    chunks = asyncio.run(run())
    assert len(chunks) >= 2 and chunks[-1].finish_reason is not None
    assert sum(len(c.token_ids) for c in chunks) == 8


def test_bad_params_raise_with_field_name(llm):
    from scheduler_svc.validation import InvalidRequest

    with pytest.raises(InvalidRequest, match="top_p"):
        llm.generate("hi", SamplingParams(top_p=0.0))


def test_build_save_and_reload_engine(model_dir, tmp_path, hf_reference):
    build = BuildConfig(max_batch_size=8, max_seq_len=512, tokens_per_block=16, dtype="float32")
    before = {t.ident for t in threading.enumerate()}  # the module's engine runs on beside these two
    with LLM(model=str(model_dir), build_config=build, device=TEST_DEVICE, kv_cache_gb=0.1) as first:
        saved = first.save_engine(tmp_path / "smol.engine")
        a = first.generate(PROMPTS[:3], SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0))
    with LLM(engine_dir=saved, device=TEST_DEVICE, kv_cache_gb=0.1) as second:
        b = second.generate(PROMPTS[:3], SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0))
    assert [o.token_ids for o in a] == [o.token_ids for o in b] == hf_reference[:3]
    # Shutdown ends the threads the engines started: a daemon thread left inside torch when the
    # interpreter exits makes torch abort the process.
    engine_threads = {"inflight-llm", "inflight-executor", "inflight-step-waiter"}
    assert [t.name for t in threading.enumerate() if t.name in engine_threads and t.ident not in before] == []


def test_a_running_engine_keeps_long_lived_objects_out_of_the_collector(llm):
    """While an engine runs, what it loaded is frozen (not re-scanned by every full collection)
    and young collections are rare; releasing hands everything back to the collector."""
    import gc

    from inflight.gc_tuning import MIN_GEN0_THRESHOLD, release_garbage_collector, settle_garbage_collector

    assert gc.get_freeze_count() > 0 and gc.get_threshold()[0] >= MIN_GEN0_THRESHOLD
    settle_garbage_collector()  # a second engine comes and goes: the first keeps its settings
    release_garbage_collector()
    assert gc.get_freeze_count() > 0 and gc.get_threshold()[0] >= MIN_GEN0_THRESHOLD
    release_garbage_collector()  # the last one: everything goes back to the collector
    try:
        assert gc.get_freeze_count() == 0 and gc.get_threshold()[0] < MIN_GEN0_THRESHOLD
    finally:
        settle_garbage_collector()  # the module's engine runs on
