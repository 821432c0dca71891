"""Reference attention over the paged KV cache, in plain torch.

Correct on CPU and CUDA for any GQA ratio; it is the oracle the fast kernels
are tested against. Single-token queries (generation) of all requests are
handled in one batched call by gathering each request's blocks into a padded
``[requests, max_blocks * tokens_per_block]`` key/value tensor with a length
mask; multi-token queries (context chunks, drafts) are handled one request at
a time with a causal mask offset by the tokens already in the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plugins.attention_metadata import TREE_MASK_BITS, AttentionMetadata
from plugins.kv_cache_quant import as_bytes, dequantize_kv, from_bytes, quantize_kv
from plugins.registry import register_kernel


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """Store this step's keys/values at their slots (quantized with k_scale / v_scale for a 1-byte cache).

    k_cache, v_cache: [num_blocks, tokens_per_block, kv_heads, head_dim]
    k, v: [num_tokens, kv_heads, head_dim]; slot_mapping: [num_tokens]
    """
    kv_heads = k.shape[1]
    for cache, x, scale in ((k_cache, k, k_scale), (v_cache, v, v_scale)):
        rows = as_bytes(quantize_kv(x, scale, cache.dtype))
        as_bytes(cache).view(-1, kv_heads, rows.shape[-1]).index_copy_(0, slot_mapping, rows)


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """cache[blocks] for any cache dtype: [len(blocks), tokens_per_block, kv_heads, head_dim]."""
    return from_bytes(as_bytes(cache).index_select(0, blocks), cache.dtype)


@register_kernel("attention", "torch", description="reference: gather blocks + scaled_dot_product_attention")
def paged_attention(
    q: torch.Tensor,  # [num_tokens, heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, tokens_per_block, kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int = 0,  # > 0: a query sees only the last `sliding_window` positions
    k_scale: float = 1.0,  # a 1-byte cache holds k / k_scale; ignored for a 16-bit cache
    v_scale: float = 1.0,
) -> torch.Tensor:  # [num_tokens, heads, head_dim]
    out = torch.empty_like(q)
    if meta.single_query_rows.numel():
        tables, token_idx, valid = _single_query_layout(meta, k_cache.shape[1], sliding_window)
        batch = tables.shape[0]
        # Gather each request's blocks: [B, max_blocks * tokens_per_block, kv_heads, D].
        k = _gather_blocks(k_cache, tables.flatten()).view(batch, -1, *k_cache.shape[2:])
        v = _gather_blocks(v_cache, tables.flatten()).view(batch, -1, *v_cache.shape[2:])
        qb = q.index_select(0, token_idx)[:, :, None, :]  # [B, heads, 1, D]
        ob = F.scaled_dot_product_attention(
            qb, dequantize_kv(k.transpose(1, 2), k_scale, q.dtype), dequantize_kv(v.transpose(1, 2), v_scale, q.dtype),
            attn_mask=valid, scale=scale, enable_gqa=True,
        )
        out.index_copy_(0, token_idx, ob[:, :, 0, :])
    for row in meta.multi_query_rows:
        start, end = meta.query_start[row], meta.query_start[row + 1]
        ctx, q_len = meta.context_lens[row], end - start
        table = meta.block_tables[row, : -(-ctx // k_cache.shape[1])]
        k = _gather_blocks(k_cache, table).flatten(0, 1)[:ctx].transpose(0, 1)[None]  # [1, kv_heads, ctx, D]
        v = _gather_blocks(v_cache, table).flatten(0, 1)[:ctx].transpose(0, 1)[None]
        k, v = dequantize_kv(k, k_scale, q.dtype), dequantize_kv(v, v_scale, q.dtype)
        qr = q[start:end].transpose(0, 1)[None]  # [1, heads, q_len, D]
        if ctx == q_len and sliding_window <= 0:  # a whole prompt: plain causal attention
            o = F.scaled_dot_product_attention(qr, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:  # a chunk after cached tokens (or a window): query i sits at ctx - q_len + i
            q_pos = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
            key_pos = torch.arange(ctx, device=q.device)[None, :]
            mask = key_pos <= q_pos  # [q_len, ctx]
            if sliding_window > 0:
                mask &= key_pos > q_pos - sliding_window
            o = F.scaled_dot_product_attention(qr, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1)
    return out


def tree_visible(masks: torch.Tensor, lens: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
    """Which keys packed tree masks let each query see: masks [B] int64, lens [B] (the query sits at
    lens - 1), key_pos [1, L] -> [B, L] bool (see ``AttentionMetadata.tree_masks``)."""
    back = lens[:, None] - 1 - key_pos  # how far behind the query each key sits
    near = (back >= 0) & (back < TREE_MASK_BITS)
    bits = (masks[:, None] >> back.clamp(0, TREE_MASK_BITS - 1)) & 1
    return ~near | (bits == 1)


def _single_query_layout(
    meta: AttentionMetadata, tokens_per_block: int, sliding_window: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block tables, token indices and key mask of the single-token queries.

    The same for every layer of a step, so it is computed once and kept on the
    step's metadata (per sliding window, since Gemma's layers differ).
    """
    key = ("single_query", sliding_window)
    if key not in meta.derived:
        rows = meta.single_query_rows
        tables = meta.block_tables.index_select(0, rows)  # [B, max_blocks]
        lens = meta.context_lens_t.index_select(0, rows)  # [B]
        key_pos = torch.arange(tables.shape[1] * tokens_per_block, device=tables.device)[None, :]
        valid = key_pos < lens[:, None]  # [B, L]; the query sits at position lens - 1
        if sliding_window > 0:
            valid &= key_pos > lens[:, None] - 1 - sliding_window
        if meta.tree_masks is not None:
            valid &= tree_visible(meta.tree_masks.index_select(0, rows), lens, key_pos)
        meta.derived[key] = (tables, meta.single_query_tokens, valid[:, None, None, :])
    return meta.derived[key]
