"""Reference gated activations: SwiGLU (Llama) and GeGLU (Gemma)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plugins.registry import register_kernel

ACTIVATIONS = ("silu", "gelu_tanh")


@register_kernel("activation", "torch", description="reference: act(gate) * up on a fused [gate | up] input")
def act_and_mul(x: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    # x: [tokens, 2 * intermediate] = [gate | up] -> [tokens, intermediate]
    gate, up = x.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
