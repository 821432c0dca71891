"""Triton paged attention: the same contract as ``plugins/attention_torch.py``.

Two kernels behind one entry point:

* single-token queries (generation): split-K decode attention, GQA-grouped,
  in ``attention_triton_decode.py``. Graph-safe: its grid and scratch depend
  on tensor shapes only and it never reads a tensor value on the host.
* multi-token queries (prompts, context chunks, drafts): varlen
  FlashAttention-style tiling over the paged cache, all requests in one
  launch, in ``attention_triton_context.py``.

Both accumulate in float32 and support head dims up to 128, any GQA ratio and
any tokens_per_block, over a 16-bit cache or a 1-byte one (FP8 or INT8 with
per-layer K and V scales). Registered for CUDA; tests also run the kernels on the
CPU through Triton's interpreter (TRITON_INTERPRET=1) on small shapes.
"""

from __future__ import annotations

import torch

from plugins.attention_metadata import AttentionMetadata
from plugins.kv_cache_quant import check_kv_cache_support
from plugins.registry import register_kernel

try:
    import triton  # noqa: F401
except ImportError:  # no triton: the kernel is simply not registered
    triton = None

# The query tile and accumulator of one program live in registers / shared memory. 256 runs under
# the interpreter but faults on the H200 (illegal address, not yet understood): refused until fixed.
MAX_HEAD_DIM = 128
INTERPRETER_SMS = 4  # stand-in SM count under the CPU interpreter, where the split heuristic has no GPU to fill


def check_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Refuse, with the reason, the shapes these kernels do not handle."""
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(
            f"triton attention supports head_dim <= {MAX_HEAD_DIM}, got {head_dim}; use the torch attention plugin"
        )
    if heads % kv_heads:
        raise ValueError(f"triton attention needs heads ({heads}) to be a multiple of kv_heads ({kv_heads})")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) must share one dtype")
    check_kv_cache_support(k_cache.dtype, k_cache.device)
    if k_cache.shape != v_cache.shape or k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be "
                         f"[num_blocks, tokens_per_block, kv_heads, {head_dim}]")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("triton attention needs the KV cache's head_dim to be its innermost, contiguous dimension")


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors the decode split heuristic aims to fill."""
    if device.type == "cuda":  # a cached property read: no synchronisation
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_SMS


if triton is not None:
    from plugins.attention_triton_context import context_attention, context_tiles
    from plugins.attention_triton_decode import decode_attention, decode_tiles

    @register_kernel(
        "attention", "triton", device_types=frozenset({"cuda"}),
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
        description="Triton: split-K GQA decode + varlen flash attention over the paged cache",
    )
    def paged_attention_triton(
        q: torch.Tensor,  # [num_tokens, heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, tokens_per_block, kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int = 0,  # > 0: a query sees only the last `sliding_window` positions
        k_scale: float = 1.0,  # a 1-byte cache holds k / k_scale; ignored for a 16-bit cache
        v_scale: float = 1.0,
    ) -> torch.Tensor:  # [num_tokens, heads, head_dim]
        check_shapes(q, k_cache, v_cache)
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        head_dim = q.shape[2]
        if meta.single_query_rows.numel():  # a shape, not a value: graph-safe
            decode_attention(
                q, k_cache, v_cache, meta, scale, sliding_window, out,
                decode_tiles(head_dim, q.dtype, k_cache.dtype), num_sms(q.device), k_scale, v_scale,
            )
        if meta.multi_query_rows:
            tiles = context_tiles(head_dim, q.dtype)
            context_attention(q, k_cache, v_cache, meta, scale, sliding_window, out, tiles, k_scale, v_scale)
        return out
