"""Triton gated activations, SwiGLU and GeGLU: act(gate) * up in one pass.

The input is the fused gate/up projection ``[tokens, 2 * intermediate]``
(gate half first). The reference splits it and runs the activation and the
product as separate kernels, rounding to the model dtype in between; this
reads each half once, computes in float32 and rounds once when it stores.
The grid is (tokens, column blocks), from shapes only, so it is CUDA-graph
safe. Registered for CUDA; tests also run it on the CPU through Triton's
interpreter (TRITON_INTERPRET=1) on small shapes.

Its FP8-rows variant (``act_and_mul_fp8_triton``, see ``plugins/fp8_rows.py``)
stores the product quantized per token for the FP8 down projection: one
program per row holds the whole row in registers (up to ``SINGLE_PASS_COLUMNS``),
takes its maximum and stores E4M3 values, so gate and up are read once; a wider
row is walked twice, once for its maximum and once to store, recomputing the
product. Each product is rounded to the model dtype first, so the bytes and the
scale equal what the projection's own quantizer makes of the 16-bit output.
"""

from __future__ import annotations

import math

import torch

from plugins.activation_torch import ACTIVATIONS
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

BLOCK_COLUMNS = 1024
# The FP8-rows variant keeps a whole row in registers up to this width (Llama-3.1-8B's 14,336
# fits at 16,384 over 32 warps, 16 values a thread); a wider row is walked twice, reading it twice.
SINGLE_PASS_COLUMNS = 16384


if triton is not None:
    # tanh-GELU: 0.5 * (1 + tanh(z)) == sigmoid(2z), with z = sqrt(2/pi) * (g + 0.044715 g^3);
    # sigmoid is in every Triton release, tanh is not.
    _TWO_SQRT_2_OVER_PI = tl.constexpr(2.0 * math.sqrt(2.0 / math.pi))

    @triton.jit
    def _gated(x_row, cols, mask, intermediate, GELU_TANH: tl.constexpr):
        """act(gate) * up for the columns ``cols`` of one [gate | up] row, in float32."""
        gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_row + intermediate + cols, mask=mask, other=0.0).to(tl.float32)
        if GELU_TANH:
            inner = _TWO_SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
            act = gate * tl.sigmoid(inner)
        else:  # SiLU
            act = gate * tl.sigmoid(gate)
        return act * up

    @triton.jit
    def _act_and_mul_kernel(
        x_ptr, out_ptr, intermediate, x_row_stride, out_row_stride,
        GELU_TANH: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
    ):
        enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < intermediate
        product = _gated(x_ptr + row * x_row_stride, cols, mask, intermediate, GELU_TANH)
        tl.store(out_ptr + row * out_row_stride + cols, product.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _act_and_mul_fp8_kernel(
        x_ptr, q_ptr, scale_ptr, intermediate, x_row_stride, inv_fp8_max, min_scale,
        GELU_TANH: tl.constexpr, BLOCK: tl.constexpr, SINGLE_PASS: tl.constexpr, PDL: tl.constexpr,
        HAS_DIV_RN: tl.constexpr,
    ):
        enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * x_row_stride
        q_row = q_ptr + row * intermediate
        if SINGLE_PASS:  # the whole row in registers: gate and up are read once
            cols = tl.arange(0, BLOCK)
            mask = cols < intermediate
            product = _gated(x_row, cols, mask, intermediate, GELU_TANH).to(x_ptr.dtype.element_ty).to(tl.float32)
            scale, inv_scale = fp8_row_scale(tl.max(tl.abs(product), axis=0), inv_fp8_max, min_scale, HAS_DIV_RN)
            tl.store(q_row + cols, to_e4m3(product, inv_scale), mask=mask)
        else:  # a row too wide for registers: one walk for its amax, a second to store
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, intermediate, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = cols < intermediate
                product = _gated(x_row, cols, mask, intermediate, GELU_TANH).to(x_ptr.dtype.element_ty)
                amax = tl.maximum(amax, tl.abs(product.to(tl.float32)))
            scale, inv_scale = fp8_row_scale(tl.max(amax, axis=0), inv_fp8_max, min_scale, HAS_DIV_RN)
            for start in range(0, intermediate, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = cols < intermediate
                product = _gated(x_row, cols, mask, intermediate, GELU_TANH).to(x_ptr.dtype.element_ty)
                tl.store(q_row + cols, to_e4m3(product.to(tl.float32), inv_scale), mask=mask)
        tl.store(scale_ptr + row, scale)

    @register_kernel(
        "activation", "triton", device_types=frozenset({"cuda"}),
        description="Triton: act(gate) * up on a fused [gate | up] input, float32 inside",
    )
    def act_and_mul_triton(x: torch.Tensor, activation: str = "silu") -> torch.Tensor:
        """Same contract as ``plugins.activation_torch.act_and_mul``."""
        # x: [..., 2 * intermediate] = [gate | up] -> [..., intermediate]
        rows, intermediate = _gate_up_rows(x, activation)
        out = torch.empty((rows.shape[0], intermediate), dtype=x.dtype, device=x.device)
        if out.numel():
            grid = (rows.shape[0], triton.cdiv(intermediate, BLOCK_COLUMNS))
            _act_and_mul_kernel[grid](
                rows, out, intermediate, rows.stride(0), out.stride(0),
                GELU_TANH=activation == "gelu_tanh", BLOCK=BLOCK_COLUMNS, num_warps=4,
                **pdl_launch_args(x.device),
            )
        return out.view(*x.shape[:-1], intermediate)

    def fp8_launch(intermediate: int) -> tuple[int, bool, int]:
        """(BLOCK, SINGLE_PASS, num_warps) of the FP8-rows variant for rows of ``intermediate`` products."""
        row_block = triton.next_power_of_2(intermediate)
        if row_block <= SINGLE_PASS_COLUMNS:
            # 32 warps at 16,384 columns: in a one-off timing on an H200 (Llama-3.1-8B's rows, bf16),
            # 32.1 us at 1,024 rows and 187.9 at 8,064, against 34.0 and 201.7 with 16 warps.
            return row_block, True, min(32, max(4, row_block // 512))
        return BLOCK_COLUMNS, False, 4

    def _gate_up_rows(x: torch.Tensor, activation: str) -> tuple[torch.Tensor, int]:
        """x [..., 2 * intermediate] checked and viewed as row-major rows; and the intermediate size."""
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        if x.shape[-1] % 2:
            raise ValueError(f"the fused gate/up input needs an even last dimension, got {x.shape[-1]}")
        rows = x.reshape(-1, x.shape[-1])
        return (rows if rows.stride(-1) == 1 else rows.contiguous()), x.shape[-1] // 2

    def act_and_mul_fp8_triton(x: torch.Tensor, activation: str = "silu") -> Fp8Rows:
        """``act_and_mul_triton`` on [tokens, 2 * intermediate] with its rows quantized per token to E4M3."""
        if x.dim() != 2:
            raise ValueError(f"expected [tokens, 2 * intermediate], got shape {tuple(x.shape)}")
        rows, intermediate = _gate_up_rows(x, activation)
        q, scales = fp8_rows_buffers(rows.shape[0], intermediate, x.device)
        if q.numel():
            block, single, warps = fp8_launch(intermediate)
            _act_and_mul_fp8_kernel[(rows.shape[0],)](
                rows, q, scales, intermediate, rows.stride(0), INV_FP8_MAX, MIN_SCALE,
                GELU_TANH=activation == "gelu_tanh", BLOCK=block, SINGLE_PASS=single, HAS_DIV_RN=HAS_DIV_RN_OP,
                num_warps=warps, **pdl_launch_args(x.device),
            )
        return Fp8Rows(q, scales, x.dtype)

    act_and_mul_triton.fp8_rows_variant = act_and_mul_fp8_triton
