"""Triton RMSNorm with the residual add fused in: one program per token row.

One read of x (and the residual), one write of the sum and of the normalised
row, instead of the separate add, square, mean, rsqrt and multiply kernels of
the reference. Registered for CUDA; tests also run it on the CPU through
Triton's interpreter (TRITON_INTERPRET=1) on small shapes.

Its FP8-rows variant (``rms_norm_fp8_triton``, see ``plugins/fp8_rows.py``)
quantizes the normalised row for the FP8 projection after it in the same
program: the row is in registers already, so its maximum and its E4M3 values
cost no further read. The row is rounded to the model dtype first, so the bytes
and the scale equal what the projection's own quantizer makes of this kernel's
16-bit output.
"""

from __future__ import annotations

import torch

from plugins.fp8_rows import Fp8Rows
from plugins.pdl import enter, pdl_launch_args
from plugins.registry import register_kernel

try:
    import triton
    import triton.language as tl

    from plugins.quant_activation_triton import (
        HAS_DIV_RN_OP, INV_FP8_MAX, MIN_SCALE, fp8_row_scale, fp8_rows_buffers, to_e4m3,
    )
except ImportError:  # no triton: the kernel is simply not registered
    triton = None


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, scale_ptr,
        n_cols, x_stride, residual_stride, eps, weight_offset, inv_fp8_max, min_scale,
        HAS_RESIDUAL: tl.constexpr, HAS_OFFSET: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
        FP8_OUT: tl.constexpr, HAS_DIV_RN: tl.constexpr,
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
        if FP8_OUT:  # out_ptr holds E4M3 values: quantize the 16-bit row per token
            out32 = out.to(tl.float32)
            scale, inv_scale = fp8_row_scale(tl.max(tl.abs(out32), axis=0), inv_fp8_max, min_scale, HAS_DIV_RN)
            tl.store(out_ptr + row * n_cols + cols, to_e4m3(out32, inv_scale), mask=mask)
            tl.store(scale_ptr + row, scale)
        else:
            tl.store(out_ptr + row * n_cols + cols, out, mask=mask)

    def _launch(x, weight, eps, residual, weight_offset, fp8_out: bool):
        tokens, hidden = x.shape
        if x.stride(-1) != 1:
            x = x.contiguous()
        if fp8_out:
            out, scales = fp8_rows_buffers(tokens, hidden, x.device)
        else:
            out, scales = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device), None
        residual_out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device) if residual is not None else None
        if residual is not None and residual.stride(-1) != 1:
            residual = residual.contiguous()
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(tokens,)](
            x, residual if residual is not None else x, weight, out, residual_out if residual_out is not None else x,
            scales if scales is not None else x,
            hidden, x.stride(0), residual.stride(0) if residual is not None else 0, eps, weight_offset,
            INV_FP8_MAX, MIN_SCALE,
            HAS_RESIDUAL=residual is not None, HAS_OFFSET=weight_offset != 0.0, BLOCK=block,
            num_warps=4 if block <= 4096 else 8,
            FP8_OUT=fp8_out, HAS_DIV_RN=HAS_DIV_RN_OP, **pdl_launch_args(x.device),
        )
        return (Fp8Rows(out, scales, x.dtype) if fp8_out else out), residual_out

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
        return _launch(x, weight, eps, residual, weight_offset, fp8_out=False)

    def rms_norm_fp8_triton(
        x: torch.Tensor, weight: torch.Tensor, eps: float,
        residual: torch.Tensor | None = None, weight_offset: float = 0.0,
    ) -> tuple[Fp8Rows, torch.Tensor | None]:
        """``rms_norm_triton`` whose normalised rows come out quantized per token to E4M3."""
        return _launch(x, weight, eps, residual, weight_offset, fp8_out=True)

    rms_norm_triton.fp8_rows_variant = rms_norm_fp8_triton
