"""Gemma-3 text decoder (Gemma3ForCausalLM) over packed tokens, and its checkpoint loader.

Same interface and packing as ``llama.py`` (``[num_tokens, hidden]``, no batch
dimension, paged KV cache, fused q/k/v and gate/up projections), with what
Gemma-3 adds, following Hugging Face's ``modeling_gemma3`` step for step:

* embeddings scaled by ``sqrt(hidden)`` (in the model dtype);
* RMSNorm scaling by ``1 + weight`` (zero-centred weights), four per layer:
  input, post-attention, pre-feedforward and post-feedforward;
* QK-norm: an RMSNorm over ``head_dim`` on every query and key head, before RoPE;
* sliding-window layers interleaved with global ones (``config.layer_types``),
  each kind with its own RoPE theta (local 10k, global 1M);
* attention scale ``query_pre_attn_scalar ** -0.5``; GeGLU MLP (tanh GELU);
* tied input/output embeddings.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from executor_svc.model.config import ModelConfig
from executor_svc.model.llama import Linear, RMSNorm, RotaryEmbedding
from executor_svc.model.weights import load_decoder_weights
from plugins.attention_metadata import AttentionMetadata
from plugins.kernels import Kernels

SLIDING, FULL = "sliding_attention", "full_attention"
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh"}  # HF name -> activation kernel's name


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_type: str, kernels: Kernels) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.is_sliding = layer_type == SLIDING
        self.sliding_window = config.sliding_window if self.is_sliding else 0  # 0: attend to everything
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        self.k_scale, self.v_scale = 1.0, 1.0  # KV-cache scales, as in llama.DecoderLayer
        self.activation = ACTIVATIONS[config.hidden_act]
        self.input_layernorm = RMSNorm(hidden, eps, kernels, weight_offset=1.0)
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, kernels)
        self.q_norm = RMSNorm(config.head_dim, eps, kernels, weight_offset=1.0)
        self.k_norm = RMSNorm(config.head_dim, eps, kernels, weight_offset=1.0)
        self.o_proj = Linear(self.q_size, hidden, kernels)
        self.post_attention_layernorm = RMSNorm(hidden, eps, kernels, weight_offset=1.0)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, kernels, weight_offset=1.0)
        self.gate_up_proj = Linear(hidden, 2 * config.intermediate_size, kernels)
        self.down_proj = Linear(config.intermediate_size, hidden, kernels)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, kernels, weight_offset=1.0)
        self.attention = kernels.attention
        self.act_and_mul = kernels.activation

    def forward(
        self,
        x: torch.Tensor,  # [tokens, hidden]: this layer's input before the residual add
        residual: torch.Tensor | None,  # [tokens, hidden]; None for the first layer
        positions: torch.Tensor,  # [tokens]
        kv_cache: torch.Tensor,  # [2, num_blocks, tokens_per_block, kv_heads, D]
        meta: AttentionMetadata,
        rotary: RotaryEmbedding,  # the table of this layer's kind (local or global)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (output before the residual add, residual)
        tokens, dim = x.shape[0], self.head_dim
        h, residual = self.input_layernorm(x, residual)
        if residual is None:
            residual = x
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # QK-norm per head: [tokens * heads, D] rows through the 2-D norm kernel.
        q = self.q_norm(q.reshape(-1, dim))[0].view(tokens, self.num_heads, dim)
        k = self.k_norm(k.reshape(-1, dim))[0].view(tokens, self.num_kv_heads, dim)
        v = v.view(tokens, self.num_kv_heads, dim)
        q = rotary(q, k, v, positions, kv_cache[0], kv_cache[1], meta.slot_mapping, self.k_scale, self.v_scale)
        attn = self.attention(
            q, kv_cache[0], kv_cache[1], meta, self.scale, self.sliding_window, self.k_scale, self.v_scale
        )
        h = self.post_attention_layernorm(self.o_proj(attn.reshape(tokens, self.q_size)))[0]
        h, residual = self.pre_feedforward_layernorm(h, residual)  # residual += attention output
        h = self.down_proj(self.act_and_mul(self.gate_up_proj(h), self.activation))
        return self.post_feedforward_layernorm(h)[0], residual


class Gemma3ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int, kernels: Kernels) -> None:
        super().__init__()
        if config.attn_logit_softcapping is not None:
            raise ValueError("Gemma attention logit soft-capping is not supported by the attention kernels")
        if config.hidden_act not in ACTIVATIONS:
            raise ValueError(f"Gemma-3 activation {config.hidden_act!r} is not one of {list(ACTIVATIONS)}")
        layer_types = list(config.layer_types or ())
        if len(layer_types) != config.num_layers or set(layer_types) - {SLIDING, FULL}:
            raise ValueError(f"Gemma-3 needs one of {SLIDING!r}/{FULL!r} per layer, got layer_types={layer_types}")
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        # HF keeps sqrt(hidden) as a float32 tensor and casts it to the weights' dtype.
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5), persistent=False)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, t, kernels) for t in layer_types)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels, weight_offset=1.0)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, kernels)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight  # one tensor, not a copy
        dim = config.head_dim
        self.rotary_global = RotaryEmbedding(dim, config.rope_theta, config.rope_scaling, max_positions, kernels)
        self.rotary_local = RotaryEmbedding(dim, config.rope_local_theta or 10_000.0, None, max_positions, kernels)

    def forward(
        self,
        input_ids: torch.Tensor,  # [tokens]
        positions: torch.Tensor,  # [tokens]
        kv_cache: torch.Tensor,  # [layers, 2, num_blocks, tokens_per_block, kv_heads, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [tokens, hidden], final-normed
        x = self.embed_tokens(input_ids)
        x, residual = x * self.embed_scale.to(x.dtype), None
        for index, layer in enumerate(self.layers):
            rotary = self.rotary_local if layer.is_sliding else self.rotary_global
            x, residual = layer(x, residual, positions, kv_cache[index], meta, rotary)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [rows, hidden] -> logits [rows, vocab] in float32 (for sampling), into ``out`` when given."""
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float() if out is None else out.copy_(logits)


GEMMA3_LAYER_NORMS = {
    name: name for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
} | {"q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}


def load_gemma3_weights(model: Gemma3ForCausalLM, folder: Path) -> None:
    """Copy a Hugging Face Gemma-3 checkpoint into ``model``, fusing q/k/v and gate/up.

    Norm weights are copied as stored (zero-centred); the model adds the 1.
    """
    load_decoder_weights(model, folder, GEMMA3_LAYER_NORMS)
