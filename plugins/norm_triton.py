"""Triton RMSNorm with the residual add fused in: one program per token row.

One read of x (and the residual), one write of the sum and of the normalised
row, instead of the separate add, square, mean, rsqrt and multiply kernels of
the reference. Registered for CUDA; tests also run it on the CPU through
Triton's interpreter (TRITON_INTERPRET=1) on small shapes.
"""

from __future__ import annotations

import torch

from plugins.pdl import enter, pdl_launch_args
from plugins.registry import register_kernel

try:
    import triton
    import triton.language as tl
except ImportError:  # no triton: the kernel is simply not registered
    triton = None


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
        n_cols, x_stride, residual_stride, eps, weight_offset,
        HAS_RESIDUAL: tl.constexpr, HAS_OFFSET: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
    ):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
        enter(PDL)
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            x = x + tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
            tl.store(residual_out_ptr + row * n_cols + cols, x, mask=mask)
        x32 = x.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=0) / n_cols + eps)
        if HAS_OFFSET:  # Gemma: scale by (offset + weight) in float32, cast last
            out = (x32 * inv_rms * (weight.to(tl.float32) + weight_offset)).to(x.dtype)
        else:  # Llama: cast back before the weight, as the reference does
            out = weight * (x32 * inv_rms).to(x.dtype)
        tl.store(out_ptr + row * n_cols + cols, out, mask=mask)

    @register_kernel(
        "rmsnorm", "triton", device_types=frozenset({"cuda"}),
        description="Triton: residual add + RMSNorm fused, one row per program",
    )
    def rms_norm_triton(
        x: torch.Tensor,  # [tokens, hidden]
        weight: torch.Tensor,  # [hidden]
        eps: float,
        residual: torch.Tensor | None = None,  # [tokens, hidden]
        weight_offset: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        tokens, hidden = x.shape
        if x.stride(-1) != 1:
            x = x.contiguous()
        out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
        residual_out = torch.empty_like(out) if residual is not None else None
        if residual is not None and residual.stride(-1) != 1:
            residual = residual.contiguous()
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(tokens,)](
            x, residual if residual is not None else x, weight, out, residual_out if residual_out is not None else out,
            hidden, x.stride(0), residual.stride(0) if residual is not None else 0, eps, weight_offset,
            HAS_RESIDUAL=residual is not None, HAS_OFFSET=weight_offset != 0.0, BLOCK=block, num_warps=4 if block <= 4096 else 8,
            **pdl_launch_args(x.device),
        )
        return out, residual_out
