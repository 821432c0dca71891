"""Two pieces of a tree round as single Triton kernels.

Measured on the H200 inside a CUDA graph (SmolLM2's shape, one request, the
default tree of depth 4), the torch forms of these cost more than the rest of
the tree's extra work together: moving the accepted path's keys and values
(``compact_kv``: a gather of slots, an index_select and an index_copy_ over the
whole cache's view) took 191 us, and ``torch.topk`` of three guesses over a
49,152-token vocabulary 52 us per tree level. Here:

* ``move_kv`` is one program per (request, layer, K or V): it reads the rows of
  every accepted depth before it writes any, which matters when one depth's
  source is another's destination (on the default tree's best path, nodes 1,
  4, 8, 12, depth 2 reads node 4's slot, L + 3, which depth 4 writes).
* ``top_guesses`` ranks every chunk of the vocabulary in parallel (W passes
  of a max, ties to the lowest id), then merges the chunks' winners per row.

Both are checked against the torch references (``draft_tree.compact_kv`` and
``torch.topk``) on the CPU through Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plugins.kv_cache_quant import as_bytes


@triton.jit
def _move_kv_kernel(
    cache_ptr, lens_ptr, best_ptr, accepted_ptr, paths_ptr, tables_ptr,
    plane_stride, stride_tables,
    K: tl.constexpr, K_PAD: tl.constexpr, ROW: tl.constexpr, ROW_PAD: tl.constexpr, TOKENS_PER_BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    plane = tl.program_id(1).to(tl.int64)  # layer * 2 + (0: keys, 1: values)
    depth = tl.arange(0, K_PAD) + 1  # [K_PAD]
    offs = tl.arange(0, ROW_PAD)
    base = tl.load(lens_ptr + b) - 1
    accepted = tl.load(accepted_ptr + b)
    best = tl.load(best_ptr + b)
    node = tl.load(paths_ptr + best * K + depth - 1, mask=depth <= K, other=0)
    moving = (depth <= accepted) & (node != depth)
    src, dst = base + node, base + depth
    table = tables_ptr + b * stride_tables
    src_block = tl.load(table + src // TOKENS_PER_BLOCK, mask=moving, other=0)
    dst_block = tl.load(table + dst // TOKENS_PER_BLOCK, mask=moving, other=0)
    src_slot = src_block * TOKENS_PER_BLOCK + src % TOKENS_PER_BLOCK
    dst_slot = dst_block * TOKENS_PER_BLOCK + dst % TOKENS_PER_BLOCK
    mask = moving[:, None] & (offs < ROW)[None, :]
    plane_ptr = cache_ptr + plane * plane_stride
    rows = tl.load(plane_ptr + src_slot[:, None] * ROW + offs[None, :], mask=mask)  # every read before any write
    tl.store(plane_ptr + dst_slot[:, None] * ROW + offs[None, :], rows, mask=mask)


def move_kv(
    kv_cache: torch.Tensor,  # [layers, 2, blocks, tokens_per_block, kv_heads, D], contiguous
    lens: torch.Tensor, best: torch.Tensor, accepted: torch.Tensor, tables: torch.Tensor, paths: torch.Tensor,
    tokens_per_block: int,
) -> None:
    """``draft_tree.compact_kv`` in one launch (``paths``: ``TreeTensors.paths``, [1 + n, k])."""
    if not kv_cache.is_contiguous():
        raise ValueError("move_kv needs a contiguous KV cache")
    cache = as_bytes(kv_cache)
    layers, _, blocks, _, kv_heads, head_dim = cache.shape
    k = paths.shape[1]
    row = kv_heads * head_dim
    _move_kv_kernel[(lens.shape[0], layers * 2)](
        cache, lens, best, accepted, paths, tables, blocks * tokens_per_block * row, tables.stride(0),
        K=k, K_PAD=triton.next_power_of_2(k), ROW=row, ROW_PAD=triton.next_power_of_2(row),
        TOKENS_PER_BLOCK=tokens_per_block,
    )


@triton.jit
def _chunk_top_kernel(
    logits_ptr, values_ptr, ids_ptr, vocab, stride_logits, num_chunks,
    WIDTH: tl.constexpr, W_PAD: tl.constexpr, CHUNK: tl.constexpr,
):
    """Stage 1: the WIDTH best of one chunk of one row (ties to the lowest id)."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + r * stride_logits + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
    slot = tl.arange(0, W_PAD)
    values = tl.full([W_PAD], float("-inf"), tl.float32)
    ids = tl.full([W_PAD], -1, tl.int32)
    for p in tl.static_range(WIDTH):
        m = tl.max(x, 0)
        i = tl.min(tl.where(x == m, offs, vocab), 0)
        values = tl.where(slot == p, m, values)
        ids = tl.where(slot == p, i, ids)
        x = tl.where(offs == i, float("-inf"), x)
    out = (r * num_chunks + c) * W_PAD + slot
    tl.store(values_ptr + out, values)
    tl.store(ids_ptr + out, ids)


@triton.jit
def _merge_top_kernel(
    values_ptr, ids_ptr, out_ptr, vocab, num_candidates,
    WIDTH: tl.constexpr, W_PAD: tl.constexpr, CANDIDATES: tl.constexpr,
):
    """Stage 2: the WIDTH best of a row's chunk winners, best first."""
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CANDIDATES)
    live = offs < num_candidates
    v = tl.load(values_ptr + r * num_candidates + offs, mask=live, other=float("-inf"))
    ids = tl.load(ids_ptr + r * num_candidates + offs, mask=live, other=-1)
    v = tl.where(ids >= 0, v, float("-inf"))
    slot = tl.arange(0, W_PAD)
    taken = tl.full([W_PAD], -1, tl.int64)
    for p in tl.static_range(WIDTH):
        m = tl.max(v, 0)
        i = tl.min(tl.where((v == m) & (ids >= 0), ids, vocab), 0)
        taken = tl.where(slot == p, i.to(tl.int64), taken)
        v = tl.where(ids == i, float("-inf"), v)
    tl.store(out_ptr + r * W_PAD + slot, taken)


CHUNK = 2048  # vocabulary entries one stage-1 program ranks


def top_guesses(logits: torch.Tensor, width: int) -> torch.Tensor:
    """The ``width`` largest logits' ids per row, best first: logits [N, V] (rows may be strided, ids
    contiguous) -> [N, width] int64; ``torch.topk(...).indices`` up to ties, which go to the lowest id.
    Two launches: every chunk of every row ranks its own best in parallel, then one program per row
    merges them."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    w_pad = triton.next_power_of_2(width)
    num_chunks = triton.cdiv(vocab, CHUNK)
    values = torch.empty((rows, num_chunks, w_pad), dtype=torch.float32, device=logits.device)
    ids = torch.empty((rows, num_chunks, w_pad), dtype=torch.int32, device=logits.device)
    _chunk_top_kernel[(rows, num_chunks)](
        logits, values, ids, vocab, logits.stride(0), num_chunks, WIDTH=width, W_PAD=w_pad, CHUNK=CHUNK,
    )
    out = torch.empty((rows, w_pad), dtype=torch.int64, device=logits.device)
    candidates = num_chunks * w_pad
    _merge_top_kernel[(rows,)](
        values, ids, out, vocab, candidates,
        WIDTH=width, W_PAD=w_pad, CANDIDATES=triton.next_power_of_2(candidates),
    )
    return out[:, :width]
