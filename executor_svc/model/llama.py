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

from collections.abc import Callable

import torch
from torch import nn

from executor_svc.model.config import ModelConfig
from executor_svc.quantization.quantize import quantize_fp8_per_token
from plugins.attention_metadata import AttentionMetadata
from plugins.fp8_rows import Fp8Rows, fp8_rows_variant, wants_fp8_rows
from plugins.kernels import Kernels
from plugins.rope_torch import rope_cos_sin, rope_inv_freq

# (q, k_cache, v_cache, meta, scale[, sliding_window]) -> out; see plugins/attention_torch.py
class RMSNorm(nn.Module):
    """Holds the weight; the arithmetic is the engine's rmsnorm kernel."""

    def __init__(self, size: int, eps: float, kernels: Kernels, weight_offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.weight_offset = weight_offset
        self.kernel = kernels.rmsnorm

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, fp8_rows: bool = False,
    ) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor | None]:
        """(normed rows, x + residual); with ``fp8_rows`` the normed rows come quantized per token
        for the FP8 projection that reads them (``plugins/fp8_rows.py``)."""
        if not fp8_rows:
            return self.kernel(x, self.weight, self.eps, residual, self.weight_offset)
        fused = fp8_rows_variant(self.kernel, x.dtype)
        if fused is not None:
            return fused(x, self.weight, self.eps, residual, self.weight_offset)
        out, residual = self.kernel(x, self.weight, self.eps, residual, self.weight_offset)
        return as_fp8_rows(out), residual


def as_fp8_rows(x: torch.Tensor) -> Fp8Rows:
    """16-bit rows quantized per token, exactly as an FP8 projection quantizes its input."""
    values, scales = quantize_fp8_per_token(x)
    return Fp8Rows(values, scales, x.dtype)


def gated_activation(
    kernel: Callable[..., torch.Tensor], x: torch.Tensor, activation: str, fp8_rows: bool = False,
) -> torch.Tensor | Fp8Rows:
    """act(gate) * up with the engine's activation ``kernel``; with ``fp8_rows`` quantized per token
    for the FP8 down projection (the kernel's fused variant where it has one)."""
    if not fp8_rows:
        return kernel(x, activation)
    fused = fp8_rows_variant(kernel, x.dtype)
    return fused(x, activation) if fused is not None else as_fp8_rows(kernel(x, activation))


class Linear(nn.Module):
    """A bias-free projection whose GEMM is the engine's gemm kernel."""

    def __init__(self, in_features: int, out_features: int, kernels: Kernels) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.kernel = kernels.gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight)


# From this many rows the LM head is a cuBLAS GEMM (the decode GEMV kernels stop at 16 rows), which
# can accumulate 16-bit inputs straight into float32 logits.
FLOAT32_OUT_MIN_ROWS = 17
_float32_out_gemm = hasattr(torch.ops.aten.mm, "dtype_out")  # torch.mm(..., out_dtype=): CUDA, torch >= 2.8


def float32_logits(lm_head: Linear, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``lm_head(hidden)`` as float32 logits ([rows, vocab]), into ``out`` when given.

    A large 16-bit batch on a GPU has its GEMM write float32 directly: writing 16-bit
    logits, reading them back and writing float32 moved twice the bytes in two kernels
    (the copy alone took 0.38 ms a step for a 128k vocabulary at 1,024 rows on an H200).
    The logits are then the GEMM's float32 sums, not those sums rounded to 16 bits.
    That GEMM has no derivative, so anything that trains through the head (draft heads'
    distillation) takes the plain one.
    """
    weight = lm_head.weight if isinstance(lm_head, Linear) else None  # a quantized head keeps its own GEMM
    differentiated = torch.is_grad_enabled() and (hidden.requires_grad or (weight is not None and weight.requires_grad))
    if (
        weight is not None and _float32_out_gemm and not differentiated and hidden.is_cuda and hidden.dim() == 2
        and hidden.shape[0] >= FLOAT32_OUT_MIN_ROWS
        and hidden.dtype in (torch.bfloat16, torch.float16) and weight.dtype == hidden.dtype
    ):
        if out is None:
            return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32, out=out)
    logits = lm_head(hidden)
    return logits.float() if out is None else out.copy_(logits)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_positions; applied by the rope kernel,
    which also writes the layer's k and v into the paged cache."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_positions: int, kernels: Kernels) -> None:
        super().__init__()
        cos, sin = rope_cos_sin(rope_inv_freq(head_dim, theta, scaling), max_positions, style="neox")
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.kernel = kernels.rope

    def forward(
        self,
        q: torch.Tensor,  # [tokens, heads, D]
        k: torch.Tensor,  # [tokens, kv_heads, D]
        v: torch.Tensor,  # [tokens, kv_heads, D]
        positions: torch.Tensor,  # [tokens]
        k_cache: torch.Tensor,  # [num_blocks, tokens_per_block, kv_heads, D]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [tokens]
        k_scale: float = 1.0,  # the layer's KV-cache scales (used by a 1-byte cache only)
        v_scale: float = 1.0,
    ) -> torch.Tensor:  # [tokens, heads, D]
        """Rotate q and k, store the rotated k and v at their cache slots; returns the rotated q."""
        return self.kernel(
            q, k, v, self.cos, self.sin, positions, k_cache, v_cache, slot_mapping, "neox", k_scale, v_scale
        )


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, kernels)
        self.o_proj = Linear(self.q_size, config.hidden_size, kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, kernels)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, kernels)
        self.scale = config.head_dim**-0.5
        # KV-cache scales of this layer: a 1-byte cache stores k / k_scale and v / v_scale. Set once
        # when an FP8 / INT8 engine loads (plain floats: CUDA graphs keep them as kernel arguments).
        self.k_scale, self.v_scale = 1.0, 1.0
        # Mistral-style sliding window on every layer (0 = full attention).
        self.sliding_window = config.sliding_window
        self.attention = kernels.attention
        self.act_and_mul = kernels.activation

    def forward(
        self,
        x: torch.Tensor,  # [tokens, hidden]: this layer's input before the residual add
        residual: torch.Tensor | None,  # [tokens, hidden]; None for the first layer
        positions: torch.Tensor,  # [tokens]
        kv_cache: torch.Tensor,  # [2, num_blocks, tokens_per_block, kv_heads, D]
        meta: AttentionMetadata,
        rotary: RotaryEmbedding,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = x.shape[0]
        # FP8 projections with per-token scales take their input quantized by the kernel before them.
        h, residual = self.input_layernorm(x, residual, wants_fp8_rows(self.qkv_proj, tokens))
        if residual is None:
            residual = x
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        q = rotary(q, k, v, positions, kv_cache[0], kv_cache[1], meta.slot_mapping, self.k_scale, self.v_scale)
        attn = self.attention(
            q, kv_cache[0], kv_cache[1], meta, self.scale, self.sliding_window, self.k_scale, self.v_scale
        )
        h, residual = self.post_attention_layernorm(
            self.o_proj(attn.reshape(tokens, self.q_size)), residual, wants_fp8_rows(self.gate_up_proj, tokens)
        )
        h = gated_activation(self.act_and_mul, self.gate_up_proj(h), "silu", wants_fp8_rows(self.down_proj, tokens))
        return self.down_proj(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int, kernels: Kernels) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, kernels) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, kernels)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight  # one tensor, not a copy
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling, max_positions, kernels)

    def forward(
        self,
        input_ids: torch.Tensor,  # [tokens]
        positions: torch.Tensor,  # [tokens]
        kv_cache: torch.Tensor,  # [layers, 2, num_blocks, tokens_per_block, kv_heads, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [tokens, hidden], final-normed
        x, residual = self.embed_tokens(input_ids), None
        for index, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, kv_cache[index], meta, self.rotary)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [rows, hidden] -> logits [rows, vocab] in float32 (for sampling), into ``out`` when given."""
        return float32_logits(self.lm_head, hidden, out)
