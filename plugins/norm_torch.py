"""Reference RMSNorm with an optional fused residual add."""

from __future__ import annotations

import torch

from plugins.registry import register_kernel


@register_kernel("rmsnorm", "torch", description="reference: float32 RMSNorm (+ residual add)")
def rms_norm(
    x: torch.Tensor,  # [tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [tokens, hidden]
    weight_offset: float = 0.0,  # Gemma scales by (1 + weight)
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x + residual`` (returned as the new residual), then RMS-normalised.

    The arithmetic is Hugging Face's: normalise in float32; Llama then casts
    back and multiplies by the weight in the model's dtype, while Gemma
    (``weight_offset`` 1) multiplies by ``1 + weight`` in float32 and casts last.
    """
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight_offset == 0.0:
        return weight * x32.to(dtype), residual
    return (x32 * (weight.float() + weight_offset)).to(dtype), residual
