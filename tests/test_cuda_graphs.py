"""CUDA graphs for generation steps: bucketing everywhere, replay parity on a GPU."""

from __future__ import annotations

import asyncio

import pytest

from executor_svc.cuda_graphs import batch_buckets, width_buckets
from scheduler_svc.api_types import GenerationRequest
from tests.conftest import PROMPTS, TEST_DEVICE, run_async


def test_batch_buckets_cover_every_batch_size():
    sizes = batch_buckets(256)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 256
    assert batch_buckets(5) == [1, 2, 4, 5]
    for n in range(1, 257):  # every batch has a bucket, and padding is under half of it
        bucket = next(s for s in sizes if s >= n)
        assert (bucket - n) / bucket < 0.5


def test_width_buckets_end_at_the_longest_sequence():
    assert width_buckets(128) == [8, 16, 32, 64, 128]
    assert width_buckets(100) == [8, 16, 32, 64, 100]
    assert width_buckets(3) == [3]


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_graph_replay_gives_the_eager_tokens(engine, make_async_engine):
    """The same greedy tokens with generation steps replayed from graphs and run eagerly."""
    graphs = engine.decode_graphs
    assert graphs is not None and graphs.graphs

    async def generate_all() -> list[list[int]]:
        async_engine = await make_async_engine()
        try:
            async def one(prompt: str) -> list[int]:
                ids: list[int] = []
                async for chunk in async_engine.generate(GenerationRequest(text=prompt, max_tokens=24, temperature=0.0, ignore_eos=True)):
                    ids.extend(chunk.token_ids)
                return ids

            return list(await asyncio.gather(*(one(p) for p in PROMPTS)))
        finally:
            await async_engine.stop()

    replays_before = graphs.num_replays
    with_graphs = run_async(generate_all())
    assert graphs.num_replays > replays_before
    engine.decode_graphs = None
    try:
        eager = run_async(generate_all())
    finally:
        engine.decode_graphs = graphs
    assert with_graphs == eager


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_every_graph_writes_one_logits_buffer_with_the_lm_head_of_its_rows(engine):
    """Per-graph logits would add up over the buckets; all graphs write the first rows of one buffer."""
    import torch

    graphs = engine.decode_graphs
    assert graphs is not None and len(graphs.graphs) > 1
    for (batch, _), entry in graphs.graphs.items():
        assert entry.logits.data_ptr() == graphs.logits.data_ptr() and entry.logits.shape[0] == batch
    # Two buckets in turn: each replay's logits are the LM head of its own hidden rows (the other
    # bucket's replay in between wrote the same buffer).
    first = 9  # tokens of a sequence whose KV is written by the first replay
    small, large = graphs.batch_sizes[0], graphs.batch_sizes[2]
    for n in (small, large):
        ids = list(range(100, 100 + n))
        positions = [first] * n
        slots = [graphs.scratch_block * graphs.tokens_per_block] * n  # every row writes the scratch block
        tables = [[graphs.scratch_block]] * n
        logits, hidden = graphs.run(ids, positions, slots, [first + 1] * n, tables)
        assert torch.isfinite(logits).all() and logits.dtype == torch.float32
        # The same GEMM at another row count may round differently in the last bit of a 16-bit logit.
        torch.testing.assert_close(logits, engine.model.compute_logits(hidden), rtol=1e-2, atol=1e-2)
