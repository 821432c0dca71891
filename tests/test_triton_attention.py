"""Triton paged attention against the torch reference: under Triton's interpreter
on the CPU (small shapes, CI), and on a GPU (INFLIGHT_TEST_DEVICE=cuda) in
Llama-3.1-8B's shape too.

Every step is built the way the runner builds it: requests packed back to back
(context requests first, then generation), KV blocks drawn at random from a
pool bigger than needed (so block tables are shuffled, non-contiguous ids and
stray reads would hit other requests' data), tables padded with block 0.
"""

from __future__ import annotations

import pytest
import torch

from plugins.attention_metadata import AttentionMetadata
from plugins.attention_torch import paged_attention
from tests.conftest import TEST_DEVICE

triton = pytest.importorskip("triton")
from plugins.attention_triton import paged_attention_triton  # noqa: E402
from plugins.attention_triton_context import ContextTiles, context_attention, query_tiles  # noqa: E402
from plugins.attention_triton_decode import DecodeTiles, decode_attention, decode_splits  # noqa: E402

TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def make_step(
    requests: list[tuple[int, int]],  # (tokens already cached, new query tokens) per request, in packing order
    heads: int, kv_heads: int, head_dim: int, tokens_per_block: int,
    dtype: torch.dtype = torch.float32, seed: int = 0, extra_table_blocks: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """q, k_cache, v_cache and the metadata of one packed step, on TEST_DEVICE."""
    gen = torch.Generator().manual_seed(seed)
    needed = sum(-(-(cached + new) // tokens_per_block) for cached, new in requests)
    num_blocks = needed + 7
    shape = (num_blocks, tokens_per_block, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(TEST_DEVICE, dtype)
    v_cache = torch.randn(shape, generator=gen).to(TEST_DEVICE, dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables, query_start, context_lens = [], [0], []
    for cached, new in requests:
        context_lens.append(cached + new)
        tables.append([free.pop() for _ in range(-(-(cached + new) // tokens_per_block))])
        query_start.append(query_start[-1] + new)
    width = max(map(len, tables)) + extra_table_blocks
    single = [i for i, (_, new) in enumerate(requests) if new == 1]

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=TEST_DEVICE)

    meta = AttentionMetadata(
        query_start=query_start, context_lens=context_lens,
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64, device=TEST_DEVICE),
        context_lens_t=tensor(context_lens), slot_mapping=tensor([0] * query_start[-1]),
        single_query_rows=tensor(single), single_query_tokens=tensor([query_start[i] for i in single]),
        multi_query_rows=[i for i, (_, new) in enumerate(requests) if new > 1],
    )
    q = torch.randn(query_start[-1], heads, head_dim, generator=gen).to(TEST_DEVICE, dtype)
    return q, k_cache, v_cache, meta


def reference(q, k_cache, v_cache, meta, scale, window=0) -> torch.Tensor:
    """The torch plugin in float32 (the oracle: low-precision inputs, exact arithmetic)."""
    return paged_attention(q.float(), k_cache.float(), v_cache.float(), meta, scale, window)


def assert_matches(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (6, 2), (8, 2)])  # GQA ratios 1, 3, 4
def test_generation_batch(heads, kv_heads):
    # Contexts of 1 token, under one block, exactly one block, and not multiples of it.
    requests = [(0, 1), (16, 1), (4, 1), (49, 1), (94, 1)]
    q, k, v, meta = make_step(requests, heads, kv_heads, 64, 16, seed=heads)
    assert_matches(paged_attention_triton(q, k, v, meta, 0.125), reference(q, k, v, meta, 0.125), q.dtype)


@pytest.mark.parametrize("window", [0, 24])
def test_generation_split_k_with_empty_splits(window):
    # A table padded far beyond the longest context and splits of 16 tokens: the
    # short rows leave most of their splits empty, the long one fills many.
    requests = [(0, 1), (20, 1), (150, 1)]
    q, k, v, meta = make_step(requests, 6, 2, 64, 16, seed=1, extra_table_blocks=6)
    tiles = DecodeTiles(block_n=16, num_warps=4, num_stages=1, programs_per_sm=64, min_split_tokens=16)
    span = meta.block_tables.shape[1] * 16 if window == 0 else window
    num_splits, split_len = decode_splits(len(requests), 2, span, 4, tiles)
    assert num_splits >= 2 and num_splits * split_len >= span
    out = torch.full_like(q, float("nan"))
    decode_attention(q, k, v, meta, 0.125, window, out, tiles, num_sms=4)
    assert_matches(out, reference(q, k, v, meta, 0.125, window), q.dtype)


@pytest.mark.parametrize("window", [0, 24])
def test_generation_splits_cut_from_each_rows_own_keys(window):
    # dynamic_split: each row's keys (or its window) spread over all four splits (of the 256-token table)
    # in whole key tiles: 48 keys a split for the 151-key row (64 with fixed splits), 16 for the 21-key
    # row, one split for the 1-key row; padding rows stay zeros.
    requests = [(0, 1), (20, 1), (150, 1)]
    q, k, v, meta = make_step(requests, 6, 2, 64, 16, seed=3, extra_table_blocks=6)
    tiles = DecodeTiles(block_n=16, num_warps=4, num_stages=1, programs_per_sm=64, min_split_tokens=64,
                        dynamic_split=True)
    assert decode_splits(len(requests), 2, meta.block_tables.shape[1] * 16, 4, tiles) == (4, 64)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, k, v, meta, 0.125, window, out, tiles, num_sms=4)
    assert_matches(out, reference(q, k, v, meta, 0.125, window), q.dtype)
    meta.context_lens_t[1] = 0
    decode_attention(q, k, v, meta, 0.125, window, out, tiles, num_sms=4)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_generation_row_without_keys_gives_zeros():
    # A row with no keys at all (a padding row) must come out as finite zeros,
    # not NaN, and leave the real rows alone: with one split and with several.
    for extra_table_blocks in (0, 6):
        q, k, v, meta = make_step([(30, 1), (7, 1)], 4, 2, 64, 16, seed=2, extra_table_blocks=extra_table_blocks)
        expected = reference(q, k, v, meta, 0.125)
        meta.context_lens_t[1] = 0
        out = paged_attention_triton(q, k, v, meta, 0.125)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert_matches(out[0], expected[0], q.dtype)


@pytest.mark.parametrize("tokens_per_block", [16, 32, 64])
def test_whole_prompts(tokens_per_block):
    # Two prompts in one launch, lengths not multiples of the tiles; GQA ratio 3 (SmolLM2).
    q, k, v, meta = make_step([(0, 37), (0, 70)], 6, 2, 64, tokens_per_block, seed=tokens_per_block)
    assert_matches(paged_attention_triton(q, k, v, meta, 0.125), reference(q, k, v, meta, 0.125), q.dtype)


@pytest.mark.parametrize("tokens_per_block", [16, 32])
def test_chunk_after_cached_tokens(tokens_per_block):
    # Chunked context: the earlier chunks are in the cache; query i sits at ctx - q_len + i.
    q, k, v, meta = make_step([(64, 32), (32, 45)], 8, 2, 64, tokens_per_block, seed=3)
    assert_matches(paged_attention_triton(q, k, v, meta, 0.125), reference(q, k, v, meta, 0.125), q.dtype)


def test_context_tiles_smaller_and_larger_than_blocks():
    # Key tiles of 16 over blocks of 32 and of 64 over blocks of 32; query tiles of 16 rows = 4 tokens x 4 heads.
    q, k, v, meta = make_step([(40, 23), (0, 9)], 8, 2, 64, 32, seed=4)
    expected = reference(q, k, v, meta, 0.125)
    for tiles in (ContextTiles(block_m=16, block_n=16, num_warps=4, num_stages=1),
                  ContextTiles(block_m=32, block_n=64, num_warps=4, num_stages=1)):
        meta.derived.clear()
        out = torch.full_like(q, float("nan"))
        context_attention(q, k, v, meta, 0.125, 0, out, tiles)
        assert_matches(out, expected, q.dtype)


@pytest.mark.parametrize("window", [7, 40])
def test_sliding_window_mixed_step(window):
    # Windows shorter than the prompts and than the cached context, in both kernels;
    # 40 is longer than a key tile, so some tiles are seen in full by every row of a query tile.
    requests = [(0, 90), (50, 20), (3, 1), (60, 1)]
    q, k, v, meta = make_step(requests, 4, 1, 64, 16, seed=window)
    out = paged_attention_triton(q, k, v, meta, 0.125, window)
    assert_matches(out, reference(q, k, v, meta, 0.125, window), q.dtype)


@pytest.mark.parametrize("tokens_per_block", [16, 64])  # smaller and larger than the kernels' key tiles
def test_mixed_step_as_the_runner_packs_it(tokens_per_block):
    # Context requests first (a prompt, a chunk, a 3-token draft check), then generation.
    requests = [(0, 33), (48, 17), (21, 3), (5, 1), (77, 1), (31, 1)]
    q, k, v, meta = make_step(requests, 9, 3, 64, tokens_per_block, seed=5)
    out = paged_attention_triton(q, k, v, meta, 0.125)
    assert_matches(out, reference(q, k, v, meta, 0.125), q.dtype)
    # The per-step query tile table is built by the first layer and kept for the others.
    (key,) = [key for key in meta.derived if key[0] == "triton_context_tiles"]
    assert query_tiles(meta, key[1], q.device) is meta.derived[key]


@pytest.mark.parametrize("head_dim", [96, 128])
def test_other_head_dims(head_dim):
    # Llama (128) and one that is not a power of two, 4 heads on 1 KV head.
    q, k, v, meta = make_step([(20, 12), (40, 1)], 4, 1, head_dim, 16, seed=head_dim)
    scale = head_dim**-0.5
    assert_matches(paged_attention_triton(q, k, v, meta, scale), reference(q, k, v, meta, scale), q.dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(dtype):
    q, k, v, meta = make_step([(16, 20), (40, 1), (9, 1)], 8, 2, 64, 16, dtype=dtype, seed=6)
    out = paged_attention_triton(q, k, v, meta, 0.125)
    assert out.dtype == dtype
    assert_matches(out, reference(q, k, v, meta, 0.125), dtype)


def test_refuses_head_dims_it_cannot_hold():
    q, k, v, meta = make_step([(3, 1)], 2, 1, 256, 16)  # Gemma-3's head_dim: the torch plugin serves it
    with pytest.raises(ValueError, match="head_dim <= 128"):
        paged_attention_triton(q, k, v, meta, 0.05)


def test_registered_for_cuda_only():
    from plugins import get_kernel

    with pytest.raises(ValueError, match="cannot run on cpu"):
        get_kernel("attention", "triton", torch.device("cpu"), torch.bfloat16)
    assert get_kernel("attention", "triton", torch.device("cuda"), torch.bfloat16).fn is paged_attention_triton


# ----------------------------------------------------------------------------- GPU only: Llama-3.1-8B's shape

cuda_only = pytest.mark.skipif(TEST_DEVICE != "cuda", reason="needs INFLIGHT_TEST_DEVICE=cuda")
LLAMA_8B = dict(heads=32, kv_heads=8, head_dim=128, tokens_per_block=32, dtype=torch.bfloat16)


@cuda_only
@pytest.mark.parametrize("batch,context", [(1, 4096), (16, 1000), (256, 300)])
def test_llama8b_generation(batch, context):
    requests = [(context - 1 - 37 * i % context, 1) for i in range(batch)]
    q, k, v, meta = make_step(requests, seed=batch, **LLAMA_8B)
    assert_matches(paged_attention_triton(q, k, v, meta, 128**-0.5), reference(q, k, v, meta, 128**-0.5), q.dtype)


@cuda_only
@pytest.mark.parametrize("window", [0, 512])
def test_llama8b_mixed_step(window):
    requests = [(0, 1500), (2048, 700), (100, 4)] + [(300 + 50 * i, 1) for i in range(12)]
    q, k, v, meta = make_step(requests, seed=7, **LLAMA_8B)
    out = paged_attention_triton(q, k, v, meta, 128**-0.5, window)
    assert_matches(out, reference(q, k, v, meta, 128**-0.5, window), q.dtype)


@cuda_only
def test_llama8b_generation_replays_in_a_cuda_graph():
    # Capture with one set of context lengths and block tables, replay with
    # others of the same shapes: nothing may have been read on the host.
    q, k, v, meta = make_step([(900, 1), (100, 1), (1500, 1), (5, 1)], seed=8, **LLAMA_8B)
    paged_attention_triton(q, k, v, meta, 128**-0.5)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention_triton(q, k, v, meta, 128**-0.5)
    gen = torch.Generator().manual_seed(9)
    new_lens = [30, 1400, 2, 700]
    meta.context_lens_t.copy_(torch.tensor(new_lens))
    meta.block_tables.copy_(torch.randint(0, k.shape[0], tuple(meta.block_tables.shape), generator=gen))
    q.copy_(torch.randn(q.shape, generator=gen))
    graph.replay()
    replayed = AttentionMetadata(
        query_start=meta.query_start, context_lens=new_lens, block_tables=meta.block_tables,
        context_lens_t=meta.context_lens_t, slot_mapping=meta.slot_mapping, single_query_rows=meta.single_query_rows,
        single_query_tokens=meta.single_query_tokens, multi_query_rows=[],
    )
    assert_matches(out, reference(q, k, v, replayed, 128**-0.5), q.dtype)
