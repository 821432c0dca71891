"""Reference GEMM: ``x @ weight.T`` through torch (cuBLAS / oneDNN)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plugins.registry import register_kernel


@register_kernel("gemm", "torch", description="reference: torch.nn.functional.linear")
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # x: [tokens, in], weight: [out, in] -> [tokens, out]
    return F.linear(x, weight, bias)
