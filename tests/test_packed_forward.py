"""Packing a step: context chunks as one tile set or as single-token rows give the same logits,
and the rule that turns short chunks into rows only does so when the whole step can replay a graph."""

from __future__ import annotations

import torch

from executor_svc.packed_forward import MAX_ROWS_PER_CHUNK, Segment, pack, run_packed, short_chunks_as_rows


def segments(*specs: tuple[int, int, bool]) -> list[Segment]:
    return [Segment(block_table=[0], start=start, count=count, as_rows=rows) for start, count, rows in specs]


def always(rows: int, context: int) -> bool:
    return True


def test_short_chunks_become_rows_when_the_step_then_fits_a_graph():
    step = segments((2048, 32, False), (100, 1, False), (50, 3, True))
    assert short_chunks_as_rows(step, always)
    assert all(seg.as_rows for seg in step if seg.count > 1)
    seen: list[tuple[int, int]] = []
    short_chunks_as_rows(segments((10, 4, False), (7, 1, False)), lambda r, c: seen.append((r, c)) or True)
    assert seen == [(5, 14)]  # every token is a row; the longest context ends the first chunk


def test_chunks_stay_tiles_when_rows_would_not_help():
    long_chunk = segments((0, MAX_ROWS_PER_CHUNK + 1, False), (40, 8, False))
    assert not short_chunks_as_rows(long_chunk, always)  # one chunk too long: the step stays eager anyway
    assert not any(seg.as_rows for seg in long_chunk)
    assert not short_chunks_as_rows(segments((8000, 32, False)), always)  # rows would re-read a long context
    assert not short_chunks_as_rows(segments((0, 8, False)), lambda r, c: False)  # no graph fits
    assert not short_chunks_as_rows(segments((0, 8, False)), always, max_rows_per_chunk=0)  # switched off
    assert not short_chunks_as_rows(segments((9, 1, False), (3, 2, True)), always)  # nothing to change


def test_pack_lays_out_tokens_and_attention_rows():
    """Against a direct reading of the layout rules, for random mixes of the three kinds of segment."""
    import random

    rng = random.Random(0)
    block = 4
    for _ in range(200):
        segs = []
        for _ in range(rng.randrange(1, 8)):
            count = rng.choice([1, 1, rng.randrange(2, 10)])
            start = rng.randrange(30)
            table = rng.sample(range(100), -(-(start + count) // block) + rng.randrange(3))
            segs.append(Segment(table, start, count, as_rows=rng.random() < 0.5))
        packed = pack(segs, block)
        positions, slots, context_lens, tables, single, multi, query_start = [], [], [], [], [], [], [0]
        for seg in segs:
            for pos in range(seg.start, seg.start + seg.count):
                positions.append(pos)
                slots.append(seg.block_table[pos // block] * block + pos % block)
            if seg.as_rows or seg.count == 1:  # one attention row per token, each seeing up to itself
                for pos in range(seg.start, seg.start + seg.count):
                    single.append(len(context_lens))
                    context_lens.append(pos + 1)
                    tables.append(seg.block_table)
                    query_start.append(query_start[-1] + 1)
            else:  # one row for the chunk
                multi.append(len(context_lens))
                context_lens.append(seg.start + seg.count)
                tables.append(seg.block_table)
                query_start.append(query_start[-1] + seg.count)
        assert (packed.positions, packed.slots, packed.context_lens, packed.tables) == (positions, slots, context_lens, tables)
        assert (packed.single_rows, packed.multi_rows, packed.query_start) == (single, multi, query_start)


@torch.inference_mode()
def test_a_chunk_as_rows_gives_the_tile_logits(engine):
    """A prompt's prefix in the cache, then its last 12 tokens computed both ways (real weights)."""
    block = engine.tokens_per_block
    table = list(range(1, 1 + -(-80 // block)))  # any blocks: no scheduler runs here
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, engine.model_config.vocab_size, (80,), generator=gen).tolist()
    prefix, tail = tokens[:68], tokens[68:]

    def forward(start: int, ids: list[int], rows: bool) -> torch.Tensor:
        packed = pack([Segment(table, start, len(ids), as_rows=rows)], block)
        logits, _ = run_packed(engine.model, engine.kv_cache, None, packed, ids, list(range(len(ids))))
        return logits

    forward(0, prefix, rows=False)
    as_tiles = forward(68, tail, rows=False)
    as_rows = forward(68, tail, rows=True)
    assert torch.allclose(as_tiles, as_rows, atol=1e-3, rtol=1e-3)
    assert torch.equal(as_tiles.argmax(-1), as_rows.argmax(-1))
