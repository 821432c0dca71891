"""Triton paged attention for multi-token queries (prompts, context chunks, drafts).

FlashAttention-style tiling with an online softmax, reading keys and values
straight from the paged cache through the block table. All multi-token
requests of a step go in one launch: the host cuts each request's queries into
tiles of ``BLOCK_Q`` tokens and the grid is (tiles, KV heads). A tile's M
dimension packs its tokens times the query heads of one GQA group (row ``r`` is
token ``r // GROUP``, head ``r % GROUP``), so each K/V tile is read once per
group and even a short draft fills a tensor-core tile.

Query ``i`` of a request with ``q_len`` queries and ``ctx`` cached tokens (this
step's included) sits at position ``ctx - q_len + i`` and sees keys up to that
position (and, with a sliding window, only the last ``window`` of them). Key
tiles that every row of the query tile sees in full skip the masking.

A 1-byte cache is read as in the decode kernel: widened exactly, the K scale
folded into the softmax scale and the V scale into the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from plugins.attention_metadata import AttentionMetadata
from plugins.attention_triton_decode import LOG2_E, _dot, _load_kv, dot_mode
from plugins.kv_cache_quant import kv_quant_code

TILE_FIELDS = 5  # per query tile: request row, first query token, query length, context length, first query of the tile


@dataclass(frozen=True, slots=True)
class ContextTiles:
    """Launch settings of the context kernel (the knobs to tune per GPU)."""

    block_m: int  # query rows (tokens x heads of one group) per program
    block_n: int  # keys per inner iteration
    num_warps: int
    num_stages: int


def context_tiles(head_dim: int, dtype: torch.dtype) -> ContextTiles:
    """Defaults for Hopper-class GPUs (H100/H200)."""
    if dtype == torch.float32:  # tiles take twice the shared memory and registers
        if head_dim > 128:
            return ContextTiles(block_m=64, block_n=16, num_warps=8, num_stages=1)
        return ContextTiles(block_m=64, block_n=32, num_warps=4 if head_dim <= 64 else 8, num_stages=2)
    if head_dim > 128:
        return ContextTiles(block_m=64, block_n=32, num_warps=8, num_stages=2)
    # 8 warps = two warp groups of 64 rows each: half the registers per thread of 4 warps.
    return ContextTiles(block_m=128, block_n=64, num_warps=8, num_stages=3)


def query_tiles(meta: AttentionMetadata, block_q: int, device: torch.device) -> torch.Tensor:
    """[num_tiles, TILE_FIELDS] int32: the query tiles of the step's multi-token requests.

    Built once per step from the host lists and kept in ``meta.derived`` for the
    other layers. Tiles with the most keys to visit come first, so the long ones
    start early and short ones fill the gaps at the end of the launch.
    """
    key = ("triton_context_tiles", block_q)
    if key not in meta.derived:
        tiles = []
        for row in meta.multi_query_rows:
            start, end, ctx = meta.query_start[row], meta.query_start[row + 1], meta.context_lens[row]
            q_len = end - start
            for first in range(0, q_len, block_q):
                tiles.append((row, start, q_len, ctx, first))
        tiles.sort(key=lambda t: t[3] - t[2] + min(t[4] + block_q, t[2]), reverse=True)
        host = torch.tensor(tiles, dtype=torch.int32).view(-1, TILE_FIELDS)
        if device.type == "cuda":  # pinned + non_blocking: the copy does not wait for queued kernels
            meta.derived[key] = host.pin_memory().to(device, non_blocking=True)
        else:
            meta.derived[key] = host.to(device)
    return meta.derived[key]


@triton.jit
def _attend_tile(
    acc, l_i, m_i, q, k_ptr, v_ptr, table, n0, q_pos, ctx, kv_head, qk_scale,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    offs_d, d_mask, BLOCK_N: tl.constexpr, TOKENS_PER_BLOCK: tl.constexpr,
    WINDOW: tl.constexpr, MASKED: tl.constexpr, DOT_MODE: tl.constexpr, KV_QUANT: tl.constexpr,
):
    """One key tile [n0, n0 + BLOCK_N) folded into the online softmax of every row."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        n_mask = offs_n < ctx
        block = tl.load(table + offs_n // TOKENS_PER_BLOCK, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
    else:  # every key of the tile is in the cache
        block = tl.load(table + offs_n // TOKENS_PER_BLOCK).to(tl.int64)
        kv_mask = d_mask[None, :]
    offset = offs_n % TOKENS_PER_BLOCK
    k = _load_kv(
        k_ptr + block[:, None] * stride_kb + offset[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
        kv_mask, q.dtype, KV_QUANT,
    )  # [BLOCK_N, BLOCK_D]
    qk = _dot(q, tl.trans(k), DOT_MODE) * qk_scale  # [BLOCK_M, BLOCK_N], log2 domain
    if MASKED:
        visible = offs_n[None, :] <= q_pos[:, None]
        if WINDOW > 0:
            visible &= offs_n[None, :] > q_pos[:, None] - WINDOW
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # A row may have seen no key yet (window edge): keep exp2 away from -inf - -inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_kv(
        v_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
        kv_mask, q.dtype, KV_QUANT,
    )
    acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v, DOT_MODE)
    return acc, l_i, m_new


@triton.jit
def _context_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tiles_ptr, tables_ptr, qk_scale, v_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_table,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, TOKENS_PER_BLOCK: tl.constexpr,
    WINDOW: tl.constexpr, DOT_MODE: tl.constexpr, FIELDS: tl.constexpr, KV_QUANT: tl.constexpr,
):
    tile = tiles_ptr + tl.program_id(0) * FIELDS
    kv_head = tl.program_id(1)
    row = tl.load(tile)
    q_start = tl.load(tile + 1)
    q_len = tl.load(tile + 2)
    ctx = tl.load(tile + 3)
    first_q = tl.load(tile + 4)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_idx = first_q + offs_m // GROUP  # query index within the request
    heads = kv_head * GROUP + offs_m % GROUP
    row_mask = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = ctx - q_len + q_idx
    q_rows = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=row_mask[:, None] & d_mask[None, :], other=0.0,
    )  # [BLOCK_M, BLOCK_D]

    # Key ranges, from the positions of the tile's first and last query:
    # [lo, full_lo) and [full_hi, hi) need masks, [full_lo, full_hi) is seen by every row.
    first_pos = ctx - q_len + first_q
    last_pos = ctx - q_len + tl.minimum(first_q + BLOCK_Q, q_len) - 1
    hi = last_pos + 1
    if WINDOW > 0:
        lo = tl.maximum(first_pos - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(last_pos - WINDOW + 1, 0), BLOCK_N) * BLOCK_N
        full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    else:
        lo = 0
        full_lo = 0
    full_hi = tl.minimum(tl.maximum((first_pos + 1) // BLOCK_N * BLOCK_N, full_lo), hi)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = tables_ptr + row.to(tl.int64) * stride_table
    for n0 in range(lo, full_lo, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, k_ptr, v_ptr, table, n0, q_pos, ctx, kv_head, qk_scale,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, offs_d, d_mask,
            BLOCK_N, TOKENS_PER_BLOCK, WINDOW, True, DOT_MODE, KV_QUANT,
        )
    for n0 in range(full_lo, full_hi, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, k_ptr, v_ptr, table, n0, q_pos, ctx, kv_head, qk_scale,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, offs_d, d_mask,
            BLOCK_N, TOKENS_PER_BLOCK, WINDOW, False, DOT_MODE, KV_QUANT,
        )
    for n0 in range(full_hi, hi, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, k_ptr, v_ptr, table, n0, q_pos, ctx, kv_head, qk_scale,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, offs_d, d_mask,
            BLOCK_N, TOKENS_PER_BLOCK, WINDOW, True, DOT_MODE, KV_QUANT,
        )

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if KV_QUANT != 0:  # the values were summed as stored: scale the weighted sum once
        o = o * v_scale
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :],
    )


def context_attention(
    q: torch.Tensor,  # [num_tokens, heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, tokens_per_block, kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int,
    out: torch.Tensor,  # [num_tokens, heads, head_dim]; the multi-query rows are written
    tiles: ContextTiles,
    k_scale: float = 1.0,  # scales of a 1-byte cache; ignored for a 16-bit one
    v_scale: float = 1.0,
) -> None:
    """Attention of every multi-token query in ``meta``, in one launch, written into ``out``."""
    heads, head_dim = q.shape[1], q.shape[2]
    tokens_per_block, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    block_m = max(tiles.block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    query_tile_table = query_tiles(meta, block_q, q.device)
    kv_quant = kv_quant_code(k_cache.dtype)
    if not kv_quant:
        k_scale = v_scale = 1.0
    _context_kernel[(query_tile_table.shape[0], kv_heads)](
        q, k_cache, v_cache, out, query_tile_table, meta.block_tables, scale * LOG2_E * k_scale, v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), meta.block_tables.stride(0),
        GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=tiles.block_n, TOKENS_PER_BLOCK=tokens_per_block, WINDOW=max(0, sliding_window),
        DOT_MODE=dot_mode(q.dtype), FIELDS=TILE_FIELDS, KV_QUANT=kv_quant,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
