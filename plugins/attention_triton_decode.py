"""Triton paged decode attention: single-token queries, split-K (flash-decoding).

One program owns one (request, KV head, split of the sequence): it loads the
query rows of every query head that shares the KV head (the GQA group, padded
to 16 rows so it can be the M side of ``tl.dot``), walks its split of the
request's keys through the block table, and keeps an online softmax. Each K/V
tile is therefore read once per group, not once per query head. A second
kernel merges the splits with their log-sum-exp weights.

Everything the host decides (grid, number of splits, scratch sizes) comes from
tensor shapes only, never from context-length values, so the launch can be
captured in a CUDA graph: a row whose context is shorter than the padded table
simply leaves its last splits empty, and the merge gives empty splits zero weight.

A row may carry a packed tree mask (speculative tree drafts,
``AttentionMetadata.tree_masks``): the keys among the 63 before it that its
mask hides are left out like keys past the context. The kernel is compiled
with that check (``TREE``) only for graphs and steps that carry masks.

A 1-byte cache (FP8 or INT8) is read as it is stored and its per-layer scales
are folded in where they cost nothing: the K scale into the softmax scale
(q . k = k_scale * (q . k_stored)) and the V scale into the output (one multiply
per row instead of one per key). With 16-bit queries the tiles are multiplied in
float16: E4M3 and INT8 values widen to float16 exactly in one instruction, and a
bfloat16 query converts to float16 exactly (float16 has more mantissa bits) as
long as it stays inside float16's range, which the kernel clamps it to. Widening
through float32 to bfloat16 instead costs two conversions per value and made
the 1-byte cache barely faster to read than the 2-byte one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from plugins.attention_metadata import AttentionMetadata
from plugins.kv_cache_quant import kv_quant_code
from plugins.pdl import enter, pdl_launch_args

LOG2_E = 1.4426950408889634


@dataclass(frozen=True, slots=True)
class DecodeTiles:
    """Launch settings of the decode kernels (the knobs to tune per GPU)."""

    block_n: int  # keys per inner iteration
    num_warps: int
    num_stages: int
    # Splitting: aim for this many programs per SM, but never make a split
    # shorter than min_split_tokens (each split costs a partial write and a merge
    # read) and never use more than max_splits (the merge holds them all at once).
    programs_per_sm: int = 4
    min_split_tokens: int = 128
    max_splits: int = 64
    # Cut each row's own keys into the splits (at least block_n each) instead of the padded table width:
    # a short context then spreads over several splits of one key tile each (a shorter chain of
    # dependent loads per program) where fixed splits give it one or two splits of several tiles.
    dynamic_split: bool = False


def decode_tiles(head_dim: int, dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> DecodeTiles:
    """Defaults for Hopper-class GPUs (H100/H200), for queries of ``dtype`` over a cache of ``kv_dtype``.

    Chosen from a sweep of tile, warp and stage counts on an H200 (Llama-3.1-8B's
    attention shape, 16 to 1024 requests, 192 to 3072 cached tokens): two stages
    beat three for a 16-bit cache at every size, and a 1-byte cache, half the
    bytes per tile, wants two warps (four left it no faster than the 16-bit cache).
    Two other layouts of the work lost to this one on the same sweep: loading the
    next K/V tile into registers an iteration ahead (Triton's own pipelining
    already overlaps the loads), and one program walking 2 to 8 KV heads of a row
    in one flattened loop (fewer programs and block-table reads, but 255
    registers per thread: 20-25% slower for a 1-byte cache at 1,024 rows).
    """
    if dtype == torch.float32 and head_dim > 128:
        return DecodeTiles(block_n=16, num_warps=8, num_stages=2, min_split_tokens=64)
    if dtype == torch.float32 or head_dim > 128:
        return DecodeTiles(block_n=32, num_warps=4, num_stages=2, min_split_tokens=64)
    if kv_dtype is not None and kv_quant_code(kv_dtype):
        return DecodeTiles(block_n=64, num_warps=2, num_stages=2)
    return DecodeTiles(block_n=64, num_warps=4, num_stages=2)


def decode_splits(batch: int, kv_heads: int, span_tokens: int, num_sms: int, tiles: DecodeTiles) -> tuple[int, int]:
    """(number of splits, tokens per split) for ``span_tokens`` keys at most per row.

    Shape-only: ``span_tokens`` is the padded table width (or the window), so the
    result is the same for every step of a CUDA graph bucket.
    """
    wanted = triton.cdiv(tiles.programs_per_sm * num_sms, max(1, batch * kv_heads))
    splits = max(1, min(wanted, triton.cdiv(span_tokens, tiles.min_split_tokens), tiles.max_splits))
    split_len = triton.cdiv(triton.cdiv(span_tokens, splits), tiles.block_n) * tiles.block_n
    return triton.cdiv(span_tokens, split_len), split_len


DOT_NATIVE, DOT_FP32, DOT_UPCAST = 0, 1, 2


def dot_mode(dtype: torch.dtype) -> int:
    """How ``_dot`` multiplies tiles of ``dtype``.

    float32 multiplies on tensor cores with the three-pass TF32 split (about
    float32 accuracy; Triton's default, one TF32 pass, keeps only 10 mantissa
    bits, and "ieee" products on FMA units spill registers at these tile sizes).
    Triton's CPU interpreter multiplies bfloat16 tiles as their raw uint16 bits,
    so there (and only there) bfloat16 tiles are widened to float32 first.
    """
    if dtype == torch.float32:
        return DOT_FP32
    if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "yes", "on"):
        return DOT_UPCAST
    return DOT_NATIVE


@triton.jit
def _dot(a, b, DOT_MODE: tl.constexpr):
    if DOT_MODE == 1:
        c = tl.dot(a, b, input_precision="tf32x3")
    elif DOT_MODE == 2:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def _load_kv(ptrs, mask, DTYPE: tl.constexpr, KV_QUANT: tl.constexpr):
    """A K or V tile in DTYPE (the scale comes later). 1-byte values widen exactly: directly to
    float16, through float32 to anything else."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    if KV_QUANT != 0 and DTYPE != tl.float16:
        x = x.to(tl.float32)
    return x.to(DTYPE)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    rows_ptr, tokens_ptr, tables_ptr, lens_ptr, tree_masks_ptr,
    qk_scale, v_scale, split_len, num_splits, num_heads,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_table,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, TOKENS_PER_BLOCK: tl.constexpr, WINDOW: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr, DOT_MODE: tl.constexpr, KV_QUANT: tl.constexpr, KV_F16: tl.constexpr,
    PDL: tl.constexpr, TREE: tl.constexpr, DYNAMIC_SPLIT: tl.constexpr = False,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # The step's metadata is read before waiting for the kernel before (plugins/pdl.py): two
    # dependent loads off the critical path of a kernel that is mostly latency at small batches.
    row = tl.load(rows_ptr + b)
    token = tl.load(tokens_ptr + b)
    seq_len = tl.load(lens_ptr + row).to(tl.int32)  # the query sits at position seq_len - 1
    first = 0
    if WINDOW > 0:
        first = tl.maximum(seq_len - WINDOW, 0)
    if DYNAMIC_SPLIT:  # this row's keys over the splits, whole key tiles each
        split_len = tl.cdiv(tl.cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N
    start = first + split * split_len
    end = tl.minimum(start + split_len, seq_len)  # start >= end: an empty split
    if TREE:  # a draft-tree row: bit d of its mask says whether it sees the key d positions back
        tree_mask = tl.load(tree_masks_ptr + row)
    enter(PDL)  # q, and the key and value just written, come from the kernels before

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    head_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h
    q = tl.load(
        q_ptr + token * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=head_mask[:, None] & d_mask[None, :], other=0.0,
    )  # [BLOCK_H, BLOCK_D]
    if KV_F16:  # a 1-byte cache under a 16-bit query: multiply in float16 (see the module's docstring)
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table = tables_ptr + row.to(tl.int64) * stride_table
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        block = tl.load(table + offs_n // TOKENS_PER_BLOCK, mask=n_mask, other=0).to(tl.int64)
        offset = offs_n % TOKENS_PER_BLOCK
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = _load_kv(
            k_ptr + block[:, None] * stride_kb + offset[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
            kv_mask, q.dtype, KV_QUANT,
        )  # [BLOCK_N, BLOCK_D]
        # V is loaded with K, before the scores need it: both tiles' reads are in flight at once.
        v = _load_kv(
            v_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
            kv_mask, q.dtype, KV_QUANT,
        )
        qk = _dot(q, tl.trans(k), DOT_MODE) * qk_scale  # [BLOCK_H, BLOCK_N], log2 domain (k_scale folded in)
        if TREE:
            back = seq_len - 1 - offs_n
            bit = (tree_mask >> tl.minimum(back, 63).to(tl.int64)) & 1
            qk = tl.where(n_mask[None, :] & ((back >= 64) | (bit != 0))[None, :], qk, float("-inf"))
            # A tile may hold only keys the mask hides (siblings' nodes): keep the exponents finite.
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(qk - m_use[:, None])
        else:
            qk = tl.where(n_mask[None, :], qk, float("-inf"))
            # Every iteration has at least one valid key, so m_new is finite.
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v, DOT_MODE)
        m_i = m_new

    seen = l_i > 0.0  # False for an empty split (or a padding row with no context)
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    if KV_QUANT != 0:  # the values were summed as stored: scale the weighted sum once
        o = o * v_scale
    store_mask = head_mask[:, None] & d_mask[None, :]
    if SINGLE_SPLIT:  # the one split is the answer: no merge kernel
        tl.store(out_ptr + token * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        # part_o: [batch, num_heads, num_splits, HEAD_DIM]; part_lse: [batch, num_heads, num_splits]
        part = (b * num_heads + heads) * num_splits + split  # [BLOCK_H]
        tl.store(part_o_ptr + part[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :], o, mask=store_mask)
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=head_mask)


@triton.jit
def _decode_merge_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, tokens_ptr,
    num_splits, num_heads, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(tokens_ptr + b)  # metadata: read before the wait
    enter(PDL)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    part = (b * num_heads + head) * num_splits + offs_s  # [BLOCK_S]
    lse = tl.load(part_lse_ptr + part, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # no split saw a key: a padding row, output 0
    w = tl.exp2(lse - m)  # 0 for empty splits
    o = tl.load(part_o_ptr + part[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :],
                mask=s_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
    total = tl.sum(w, 0)
    merged = tl.sum(o * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, merged.to(out_ptr.dtype.element_ty), mask=d_mask)


def decode_attention(
    q: torch.Tensor,  # [num_tokens, heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, tokens_per_block, kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int,
    out: torch.Tensor,  # [num_tokens, heads, head_dim]; the single-query rows are written
    tiles: DecodeTiles,
    num_sms: int,
    k_scale: float = 1.0,  # scales of a 1-byte cache; ignored for a 16-bit one
    v_scale: float = 1.0,
) -> None:
    """Attention of every single-token query in ``meta``, written into ``out``."""
    rows, tokens = meta.single_query_rows, meta.single_query_tokens
    batch = rows.shape[0]
    heads, head_dim = q.shape[1], q.shape[2]
    tokens_per_block, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    span = meta.block_tables.shape[1] * tokens_per_block
    if sliding_window > 0:
        span = min(span, sliding_window)
    num_splits, split_len = decode_splits(batch, kv_heads, span, num_sms, tiles)
    single = num_splits == 1
    # Scratch for the partial results; shape-derived, so allocating it is graph-safe.
    part_o = q.new_empty((1,) if single else (batch, heads, num_splits, head_dim), dtype=torch.float32)
    part_lse = q.new_empty((1,) if single else (batch, heads, num_splits), dtype=torch.float32)
    block_d = triton.next_power_of_2(head_dim)
    kv_quant = kv_quant_code(k_cache.dtype)
    if not kv_quant:
        k_scale = v_scale = 1.0
    kv_f16 = bool(kv_quant) and q.dtype in (torch.bfloat16, torch.float16)
    pdl = pdl_launch_args(q.device)
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_o, part_lse,
        rows, tokens, meta.block_tables, meta.context_lens_t,
        meta.tree_masks if meta.tree_masks is not None else rows,
        scale * LOG2_E * k_scale, v_scale, split_len, num_splits, heads,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), meta.block_tables.stride(0),
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_N=tiles.block_n, TOKENS_PER_BLOCK=tokens_per_block, WINDOW=max(0, sliding_window),
        SINGLE_SPLIT=single, DOT_MODE=dot_mode(torch.float16 if kv_f16 else q.dtype), KV_QUANT=kv_quant, KV_F16=kv_f16,
        TREE=meta.tree_masks is not None, DYNAMIC_SPLIT=tiles.dynamic_split and not single,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl,
    )
    if not single:
        _decode_merge_kernel[(batch, heads)](
            part_o, part_lse, out, tokens, num_splits, heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(num_splits), num_warps=4, **pdl,
        )
