"""Reference rotary position embedding: tables, rotation, and the "rope" kernel
kind, which rotates q and k and writes k and v into the paged KV cache.

Two layouts: GPT-NeoX style (``neox``: the two halves of each head rotate
together; Llama, Mistral, Gemma in Hugging Face layout) and GPT-J style
(``gptj``: even/odd pairs rotate together). Llama-3 frequency scaling is
applied when the model's ``rope_scaling`` asks for it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from plugins.attention_torch import write_kv
from plugins.registry import register_kernel


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim / 2]`` (float32), with Llama-3 scaling if asked."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    scaling = scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "llama3":
        factor = scaling["factor"]
        low_freq_factor = scaling.get("low_freq_factor", 1.0)
        high_freq_factor = scaling.get("high_freq_factor", 4.0)
        old_context = scaling.get("original_max_position_embeddings", 8192)
        low_freq_wavelen = old_context / low_freq_factor
        high_freq_wavelen = old_context / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    elif rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type not in ("default", None):
        raise ValueError(f"rope scaling type {rope_type!r} is not supported")
    return inv_freq


def rope_cos_sin(inv_freq: torch.Tensor, max_positions: int, style: str = "neox") -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[max_positions, head_dim]`` laid out for ``style``."""
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    if style == "neox":
        emb = torch.cat((freqs, freqs), dim=-1)
    elif style == "gptj":
        emb = freqs.repeat_interleave(2, dim=-1)
    else:
        raise ValueError(f"rope style must be 'neox' or 'gptj', got {style!r}")
    return emb.cos(), emb.sin()


def _rotate(x: torch.Tensor, style: str) -> torch.Tensor:
    if style == "neox":
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    pairs = x.unflatten(-1, (-1, 2))  # gptj: (x0, x1) -> (-x1, x0) for each pair
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


def apply_rope(
    q: torch.Tensor,  # [tokens, heads, head_dim]
    k: torch.Tensor,  # [tokens, kv_heads, head_dim]
    cos_table: torch.Tensor,  # [max_positions, head_dim]
    sin_table: torch.Tensor,
    positions: torch.Tensor,  # [tokens]
    style: str = "neox",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by their positions (the rotation alone, no cache write).

    Applied in q's dtype with cos/sin cast to it, as Hugging Face does, so that
    greedy tokens match transformers'.
    """
    cos = cos_table.index_select(0, positions)[:, None, :].to(q.dtype)
    sin = sin_table.index_select(0, positions)[:, None, :].to(q.dtype)
    return q * cos + _rotate(q, style) * sin, k * cos + _rotate(k, style) * sin


@register_kernel("rope", "torch", description="reference: table lookup + rotate (neox or gptj), then KV-cache write")
def rope_and_write_kv(
    q: torch.Tensor,  # [tokens, heads, head_dim]
    k: torch.Tensor,  # [tokens, kv_heads, head_dim]
    v: torch.Tensor,  # [tokens, kv_heads, head_dim]
    cos_table: torch.Tensor,  # [max_positions, head_dim]
    sin_table: torch.Tensor,
    positions: torch.Tensor,  # [tokens] int64
    k_cache: torch.Tensor,  # [num_blocks, tokens_per_block, kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [tokens] int64: flat cache slot of each token
    style: str = "neox",
    k_scale: float = 1.0,  # a 1-byte cache stores k / k_scale (see kv_cache_quant.py); 16-bit caches ignore it
    v_scale: float = 1.0,
) -> torch.Tensor:  # [tokens, heads, head_dim]: the rotated q
    """Rotate q and k, store the rotated k and v at their cache slots, return the rotated q.

    The kernel kind is rotation and cache write together because a fused
    kernel does both in one pass over k; this reference runs them one after
    the other. A 1-byte cache gets the rotated k (rounded to q's dtype first,
    as a 16-bit cache would hold it) and v quantized with the layer's scales.
    """
    q, k = apply_rope(q, k, cos_table, sin_table, positions, style)
    write_kv(k_cache, v_cache, k, v, slot_mapping, k_scale, v_scale)
    return q
