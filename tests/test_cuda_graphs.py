"""CUDA graphs for generation steps: bucketing everywhere, replay parity on a GPU."""

from __future__ import annotations

import asyncio

import pytest

from executor_svc.cuda_graphs import batch_buckets, width_buckets
from executor_svc.packed_forward import MAX_ROWS_PER_CHUNK
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
def test_a_prompt_longer_than_the_batch_size_runs_as_rows_through_a_graph(engine, tokenizer, make_async_engine):
    """Graphs cover short prompts' rows, not only the batch size: a prompt step is a replay, same tokens."""
    graphs = engine.decode_graphs
    assert graphs is not None and graphs.batch_sizes[-1] == MAX_ROWS_PER_CHUNK > engine.max_batch_size
    prompt = "Count on: " + ", ".join(str(n) for n in range(40))
    assert engine.max_batch_size < len(tokenizer.encode(prompt)) <= MAX_ROWS_PER_CHUNK

    async def generate(max_tokens: int) -> list[int]:
        async_engine = await make_async_engine()
        try:
            ids: list[int] = []
            request = GenerationRequest(text=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            async for chunk in async_engine.generate(request):
                ids.extend(chunk.token_ids)
            return ids
        finally:
            await async_engine.stop()

    replays_before = graphs.num_replays
    first = run_async(generate(1))  # the prompt's step alone
    assert graphs.num_replays > replays_before  # eagerly, a prompt-only request replays no graph
    with_graphs = run_async(generate(16))
    engine.decode_graphs = None
    try:
        eager = run_async(generate(16))
    finally:
        engine.decode_graphs = graphs
    assert with_graphs == eager and with_graphs[:1] == first


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


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="the float32-output LM head GEMM runs on a GPU")
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_a_16bit_lm_head_gives_float32_logits_from_one_gemm(dtype_name):
    import torch

    from executor_svc.model.llama import FLOAT32_OUT_MIN_ROWS, Linear, float32_logits
    from plugins.kernels import Kernels

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(0)
    head = Linear(256, 1000, Kernels.reference(torch.device("cuda"), dtype)).to("cuda", dtype)
    head.weight.data.copy_(torch.randn(1000, 256, generator=gen) * 0.05)
    for rows in (1, FLOAT32_OUT_MIN_ROWS, 64):
        hidden = torch.randn(rows, 256, generator=gen).to("cuda", dtype)
        exact = hidden.double() @ head.weight.double().t()
        logits = float32_logits(head, hidden)
        assert logits.dtype == torch.float32 and logits.shape == (rows, 1000)
        # 16-bit inputs, float32 sums: within float32 rounding of the exact products' sum (below 16
        # rows the head's own GEMM rounds the logits to 16 bits first).
        tol = 1e-4 if rows >= FLOAT32_OUT_MIN_ROWS else 1e-2
        torch.testing.assert_close(logits.double(), exact, rtol=tol, atol=tol)
        out = torch.empty(rows + 3, 1000, device="cuda")
        assert float32_logits(head, hidden, out=out[:rows]).data_ptr() == out.data_ptr()
        torch.testing.assert_close(out[:rows], logits)

