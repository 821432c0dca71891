"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral-style GQA) over packed tokens.

There is no batch dimension: the tokens of every request in a step are
concatenated (``[num_tokens, hidden]``), and attention finds each request's
keys and values in the paged cache through ``AttentionMetadata``. Projections
are fused at load time (q/k/v into one GEMM, gate/up into one), which is both
fewer kernel launches and the layout the fast kernels want.

The arithmetic follows Hugging Face's ``modeling_llama`` step for step (RMSNorm
in float32, rotate-half RoPE, SiLU gate), because greedy tokens must equal
transformers' on the same weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from executor_svc.model.config import ModelConfig
from plugins.attention_metadata import AttentionMetadata
from plugins.attention_torch import write_kv

# (q, k_cache, v_cache, meta, scale[, sliding_window]) -> out; see plugins/attention_torch.py
AttentionFn = Callable[..., torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies, with Llama-3 style scaling when the config asks for it."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
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
    elif rope_type not in ("default", None):
        raise ValueError(f"rope scaling type {rope_type!r} is not supported")
    return inv_freq


class RotaryEmbedding(nn.Module):
    """GPT-NeoX style (rotate-half) RoPE with a precomputed cos/sin table."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(config)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [tokens, heads, D], k: [tokens, kv_heads, D], positions: [tokens]
        cos = self.cos.index_select(0, positions)[:, None, :].to(q.dtype)
        sin = self.sin.index_select(0, positions)[:, None, :].to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.scale = config.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,  # [tokens, hidden]
        positions: torch.Tensor,  # [tokens]
        kv_cache: torch.Tensor,  # [2, num_blocks, tokens_per_block, kv_heads, D]
        meta: AttentionMetadata,
        rotary: RotaryEmbedding,
        attention: AttentionFn,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        h = self.input_layernorm(x)
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        q, k = rotary(q, k, positions)
        write_kv(kv_cache[0], kv_cache[1], k, v, meta.slot_mapping)
        attn = attention(q, kv_cache[0], kv_cache[1], meta, self.scale)
        x = x + self.o_proj(attn.reshape(tokens, self.q_size))
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int, attention: AttentionFn) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config, max_positions)
        self.attention = attention

    def forward(
        self,
        input_ids: torch.Tensor,  # [tokens]
        positions: torch.Tensor,  # [tokens]
        kv_cache: torch.Tensor,  # [layers, 2, num_blocks, tokens_per_block, kv_heads, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [tokens, hidden], final-normed
        x = self.embed_tokens(input_ids)
        for index, layer in enumerate(self.layers):
            x = layer(x, positions, kv_cache[index], meta, self.rotary, self.attention)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [rows, hidden] -> logits: [rows, vocab], float32 for sampling
        return self.lm_head(hidden).float()
