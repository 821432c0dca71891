"""SmoothQuant: migrate activation outliers into the weights before W8A8 (Xiao et al., 2023).

Per-token INT8 activations lose the small channels of a token that has one
huge channel. Dividing each input channel j of x by

    s_j = max|x_j| ** alpha / max|W[:, j]| ** (1 - alpha)

and multiplying W's column j by s_j leaves x @ W.T unchanged but flattens x;
``alpha`` (the migration strength) says how much of the difficulty moves to
the weights. Where a norm feeds the layer alone (q/k/v after the input norm,
gate/up after the MLP norm), 1/s is folded into the norm's weight and costs
nothing at run time; elsewhere (o_proj, down_proj) the quantized module
multiplies x by 1/s itself, as TensorRT-LLM's SmoothQuant layers do.
"""

from __future__ import annotations

import torch
from torch import nn

# Architecture -> (Linear name suffix -> the norm in front of it, the norm's only consumer).
# Gemma-3's norms scale by (1 + weight): a folded 1/s near 0 would sit next to -1 in
# bfloat16 and lose its digits, so Gemma's layers keep s in the module instead.
NORM_IN_FRONT: dict[str, dict[str, str]] = {
    "LlamaForCausalLM": {"qkv_proj": "input_layernorm", "gate_up_proj": "post_attention_layernorm"},
    "MistralForCausalLM": {"qkv_proj": "input_layernorm", "gate_up_proj": "post_attention_layernorm"},
}
MIN_FACTOR = 1e-5


def smoothing_factors(channel_absmax: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """s [in] from the calibration max |x| per input channel [in] and the weight [out, in]."""
    x_max = channel_absmax.float().clamp(min=MIN_FACTOR)
    w_max = weight.float().abs().amax(dim=0).clamp(min=MIN_FACTOR)
    return (x_max.pow(alpha) / w_max.pow(1.0 - alpha)).clamp(min=MIN_FACTOR)


def norm_in_front(architecture: str, linear_name: str) -> str | None:
    """Module name of the norm that feeds ``linear_name`` alone, if the factors can be folded there."""
    parent, _, leaf = linear_name.rpartition(".")
    norm = NORM_IN_FRONT.get(architecture, {}).get(leaf)
    if norm is None or not parent:
        return None
    return f"{parent}.{norm}"


@torch.no_grad()
def fold_into_norm(norm: nn.Module, factors: torch.Tensor) -> None:
    """Make ``norm`` output x / s: its weight (scale ``weight_offset + weight``) is divided by s."""
    offset = norm.weight_offset
    folded = (norm.weight.float() + offset) / factors.float() - offset
    norm.weight.copy_(folded.to(norm.weight.dtype))
