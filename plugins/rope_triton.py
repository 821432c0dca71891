"""Triton rotary embedding fused with the KV-cache write: one program per token.

Each program looks up its token's cos/sin row by position, rotates every q
and k head of the token, stores the rotated q, and stores the rotated k and
the v heads straight into their paged-cache slot. The reference reads and
writes k twice (rotate, then index_copy_) and launches about a dozen kernels;
this is one launch with one read of q, k, v and one write of each.

The rounding follows the reference (and Hugging Face): cos/sin are cast to
the input dtype, each product is rounded to that dtype and so is the sum, and
FMA contraction is switched off so that float32 rounds the same way too.

A 1-byte cache (FP8 E4M3 or INT8, ``kv_cache_quant.py``) gets k and v
quantized in the same pass: the value the 16-bit cache would hold, times the
float32 reciprocal of the layer's scale, saturated and rounded to nearest even
in float32 arithmetic, so the bytes equal the torch reference's.

CUDA-graph safe: the grid comes from shapes only and nothing is read back to
the host; the scales are scalar arguments. A negative slot (a padding token) rotates q but writes nothing.
Registered for CUDA; tests also run it on the CPU through Triton's
interpreter (TRITON_INTERPRET=1) on small shapes.
"""

from __future__ import annotations

import torch

from plugins.kv_cache_quant import check_kv_cache_support, kv_quant_code
from plugins.pdl import enter, pdl_launch_args
from plugins.registry import register_kernel

try:
    import triton
    import triton.language as tl
except ImportError:  # no triton: the kernel is simply not registered
    triton = None

ROPE_STYLES = ("neox", "gptj")


if triton is not None:

    @triton.jit
    def round_to_e4m3(y):
        """float32 ``y`` (|y| <= 448) rounded to nearest even on the E4M3 grid, still in float32.

        The conversion that follows is then exact, whatever rounding the
        conversion instruction does (Triton's CPU interpreter mis-rounds values
        just under a power of two). The grid step is 2**(exponent - 3) for
        normal values and 2**-9 below 2**-6; scaling by a power of two is
        exact, and adding and subtracting 1.5 * 2**23 rounds to an integer,
        half to even.
        """
        bits = y.to(tl.int32, bitcast=True)
        exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6) - 3  # log2 of the grid step at |y|
        step = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
        inv_step = ((127 - exponent) << 23).to(tl.float32, bitcast=True)
        steps = (tl.abs(y) * inv_step + 12582912.0) - 12582912.0
        rounded = (steps * step).to(tl.int32, bitcast=True)
        # The sign goes back as a bit: a negative value that rounds to zero stays -0.0, as in torch
        # (negating it compiles to 0 - x on the GPU, which gives +0.0).
        return (rounded | (bits & -2147483648)).to(tl.float32, bitcast=True)

    @triton.jit
    def _cache_value(x, inv_scale, KV_QUANT: tl.constexpr):
        """``x`` (in the model dtype) as the cache stores it: itself, or quantized with ``inv_scale``."""
        if KV_QUANT == 1:  # KV_FP8, E4M3: saturate, round to nearest even
            y = tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -448.0), 448.0)
            out = round_to_e4m3(y).to(tl.float8e4nv)
        elif KV_QUANT == 2:  # KV_INT8: clamp, round half to even (both exact on integers)
            y = tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -127.0), 127.0)
            out = ((y + 12582912.0) - 12582912.0).to(tl.int8)
        else:
            out = x
        return out

    @triton.jit
    def _rotate_heads(
        src_ptr, src_head_stride, dst_ptr, dst_head_stride, num_heads,
        first, second, col_mask, cos1, sin1, cos2, sin2, inv_scale,
        BLOCK_HEADS: tl.constexpr, KV_QUANT: tl.constexpr,
    ):
        """Rotate the first ``num_heads`` [head_dim] rows at src and store them at dst.

        ``first``/``second`` are the columns that rotate together; cos/sin are
        the table entries of those columns, already rounded to the input dtype.
        KV_QUANT != 0: dst is a 1-byte cache; store quantized with ``inv_scale``.
        """
        heads = tl.arange(0, BLOCK_HEADS)[:, None]
        mask = (heads < num_heads) & col_mask[None, :]
        x1 = tl.load(src_ptr + heads * src_head_stride + first[None, :], mask=mask, other=0.0)
        x2 = tl.load(src_ptr + heads * src_head_stride + second[None, :], mask=mask, other=0.0)
        dtype = x1.dtype
        # out = x * cos + rotate(x) * sin with rotate(x1, x2) = (-x2, x1); every
        # product and sum is rounded to the input dtype, as the reference does.
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        out1 = (x1f * cos1[None, :]).to(dtype).to(tl.float32) - (x2f * sin1[None, :]).to(dtype).to(tl.float32)
        out2 = (x2f * cos2[None, :]).to(dtype).to(tl.float32) + (x1f * sin2[None, :]).to(dtype).to(tl.float32)
        tl.store(dst_ptr + heads * dst_head_stride + first[None, :], _cache_value(out1.to(dtype), inv_scale, KV_QUANT),
                 mask=mask)
        tl.store(dst_ptr + heads * dst_head_stride + second[None, :], _cache_value(out2.to(dtype), inv_scale, KV_QUANT),
                 mask=mask)

    @triton.jit
    def _rope_write_kv_kernel(
        q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, positions_ptr, slots_ptr,
        q_out_ptr, k_cache_ptr, v_cache_ptr,
        q_token_stride, q_head_stride, k_token_stride, k_head_stride, v_token_stride, v_head_stride,
        table_stride, cache_block_stride, cache_slot_stride, cache_head_stride,
        num_heads, num_kv_heads, head_dim, tokens_per_block, inv_k_scale, inv_v_scale,
        IS_NEOX: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_KV_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr,
        KV_QUANT: tl.constexpr, PDL: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        # Positions, slots and the cos/sin tables are step inputs and constants: read before the
        # wait for the kernel before (plugins/pdl.py), which takes two dependent loads off the path.
        position = tl.load(positions_ptr + token)
        slot = tl.load(slots_ptr + token)
        half = head_dim // 2
        pair = tl.arange(0, BLOCK_HALF)
        col_mask = pair < half
        if IS_NEOX:  # the two halves of a head rotate together
            first, second = pair, pair + half
        else:  # gptj: even/odd neighbours rotate together
            first, second = 2 * pair, 2 * pair + 1
        dtype = q_out_ptr.dtype.element_ty
        row = position * table_stride
        # Cast to the input dtype first (the reference's .to(q.dtype)), then widen for the arithmetic.
        cos1 = tl.load(cos_ptr + row + first, mask=col_mask, other=0.0).to(dtype).to(tl.float32)
        sin1 = tl.load(sin_ptr + row + first, mask=col_mask, other=0.0).to(dtype).to(tl.float32)
        cos2 = tl.load(cos_ptr + row + second, mask=col_mask, other=0.0).to(dtype).to(tl.float32)
        sin2 = tl.load(sin_ptr + row + second, mask=col_mask, other=0.0).to(dtype).to(tl.float32)
        enter(PDL)  # q, k and v are the projection's output

        _rotate_heads(
            q_ptr + token * q_token_stride, q_head_stride, q_out_ptr + token * num_heads * head_dim, head_dim,
            num_heads, first, second, col_mask, cos1, sin1, cos2, sin2, 1.0, BLOCK_HEADS, 0,
        )
        # A padding token (slot < 0) stores nothing: its count of heads to store
        # is 0, a limit that the head-index bounds check of every store applies.
        is_real = slot >= 0
        safe_slot = tl.where(is_real, slot, 0)
        kv_heads_stored = tl.where(is_real, num_kv_heads, 0)
        block, row_in_block = safe_slot // tokens_per_block, safe_slot % tokens_per_block
        cache_offset = block * cache_block_stride + row_in_block * cache_slot_stride
        _rotate_heads(
            k_ptr + token * k_token_stride, k_head_stride, k_cache_ptr + cache_offset, cache_head_stride,
            kv_heads_stored, first, second, col_mask, cos1, sin1, cos2, sin2, inv_k_scale, BLOCK_KV_HEADS, KV_QUANT,
        )
        kv_heads = tl.arange(0, BLOCK_KV_HEADS)[:, None]
        cols = tl.arange(0, 2 * BLOCK_HALF)[None, :]
        v_mask = (kv_heads < kv_heads_stored) & (cols < head_dim)
        v = tl.load(v_ptr + token * v_token_stride + kv_heads * v_head_stride + cols, mask=v_mask, other=0.0)
        v_stored = _cache_value(v, inv_v_scale, KV_QUANT)
        tl.store(v_cache_ptr + cache_offset + kv_heads * cache_head_stride + cols, v_stored, mask=v_mask)

    @register_kernel(
        "rope", "triton", device_types=frozenset({"cuda"}),
        description="Triton: rotate q, k by table lookup and write k, v into the paged cache, one token per program",
    )
    def rope_and_write_kv_triton(
        q: torch.Tensor,  # [tokens, heads, head_dim]
        k: torch.Tensor,  # [tokens, kv_heads, head_dim]
        v: torch.Tensor,  # [tokens, kv_heads, head_dim]
        cos_table: torch.Tensor,  # [max_positions, head_dim]
        sin_table: torch.Tensor,
        positions: torch.Tensor,  # [tokens] int64
        k_cache: torch.Tensor,  # [num_blocks, tokens_per_block, kv_heads, head_dim]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [tokens] int64; < 0: do not store this token
        style: str = "neox",
        k_scale: float = 1.0,  # a 1-byte cache stores k / k_scale; 16-bit caches ignore it
        v_scale: float = 1.0,
    ) -> torch.Tensor:  # [tokens, heads, head_dim]: the rotated q
        """Same contract as ``plugins.rope_torch.rope_and_write_kv``, in one launch."""
        if style not in ROPE_STYLES:
            raise ValueError(f"rope style must be one of {ROPE_STYLES}, got {style!r}")
        tokens, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        if head_dim % 2:
            raise ValueError(f"rope needs an even head_dim, got {head_dim}")
        if k_cache.stride() != v_cache.stride() or k_cache.dtype != v_cache.dtype:
            raise ValueError("k_cache and v_cache must share one layout and dtype")
        kv_quant = kv_quant_code(k_cache.dtype)
        if kv_quant:
            check_kv_cache_support(k_cache.dtype, k_cache.device)
        # The kernel indexes the last dimension densely; a view that splits a
        # fused qkv tensor already is (only its token stride is wide).
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        cos_table, sin_table = cos_table.contiguous(), sin_table.contiguous()
        if k_cache.stride(-1) != 1:
            raise ValueError("the KV cache must be dense in head_dim")
        q_out = torch.empty((tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
        if tokens == 0:
            return q_out
        block_half = triton.next_power_of_2(head_dim // 2)
        block_heads = triton.next_power_of_2(num_heads)
        _rope_write_kv_kernel[(tokens,)](
            q, k, v, cos_table, sin_table, positions, slot_mapping,
            q_out, k_cache, v_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cos_table.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            num_heads, num_kv_heads, head_dim, k_cache.shape[1],
            1.0 / k_scale if kv_quant else 1.0, 1.0 / v_scale if kv_quant else 1.0,
            IS_NEOX=style == "neox", BLOCK_HEADS=block_heads, BLOCK_KV_HEADS=triton.next_power_of_2(num_kv_heads),
            BLOCK_HALF=block_half, KV_QUANT=kv_quant, num_warps=4 if block_heads * block_half <= 2048 else 8,
            enable_fp_fusion=False,  # no FMA: round like the reference
            **pdl_launch_args(q.device),
        )
        return q_out
