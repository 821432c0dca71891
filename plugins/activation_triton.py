"""Triton gated activations, SwiGLU and GeGLU: act(gate) * up in one pass.

The input is the fused gate/up projection ``[tokens, 2 * intermediate]``
(gate half first). The reference splits it and runs the activation and the
product as separate kernels, rounding to the model dtype in between; this
reads each half once, computes in float32 and rounds once when it stores.
The grid is (tokens, column blocks), from shapes only, so it is CUDA-graph
safe. Registered for CUDA; tests also run it on the CPU through Triton's
interpreter (TRITON_INTERPRET=1) on small shapes.
"""

from __future__ import annotations

import math

import torch

from plugins.activation_torch import ACTIVATIONS
from plugins.pdl import enter, pdl_launch_args
from plugins.registry import register_kernel

try:
    import triton
    import triton.language as tl
except ImportError:  # no triton: the kernel is simply not registered
    triton = None

BLOCK_COLUMNS = 1024


if triton is not None:
    # tanh-GELU: 0.5 * (1 + tanh(z)) == sigmoid(2z), with z = sqrt(2/pi) * (g + 0.044715 g^3);
    # sigmoid is in every Triton release, tanh is not.
    _TWO_SQRT_2_OVER_PI = tl.constexpr(2.0 * math.sqrt(2.0 / math.pi))

    @triton.jit
    def _act_and_mul_kernel(
        x_ptr, out_ptr, intermediate, x_row_stride, out_row_stride,
        GELU_TANH: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
    ):
        enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < intermediate
        gate = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * x_row_stride + intermediate + cols, mask=mask, other=0.0).to(tl.float32)
        if GELU_TANH:
            inner = _TWO_SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
            act = gate * tl.sigmoid(inner)
        else:  # SiLU
            act = gate * tl.sigmoid(gate)
        tl.store(out_ptr + row * out_row_stride + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)

    @register_kernel(
        "activation", "triton", device_types=frozenset({"cuda"}),
        description="Triton: act(gate) * up on a fused [gate | up] input, float32 inside",
    )
    def act_and_mul_triton(x: torch.Tensor, activation: str = "silu") -> torch.Tensor:
        """Same contract as ``plugins.activation_torch.act_and_mul``."""
        # x: [..., 2 * intermediate] = [gate | up] -> [..., intermediate]
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        if x.shape[-1] % 2:
            raise ValueError(f"the fused gate/up input needs an even last dimension, got {x.shape[-1]}")
        intermediate = x.shape[-1] // 2
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty((rows.shape[0], intermediate), dtype=x.dtype, device=x.device)
        if out.numel():
            grid = (rows.shape[0], triton.cdiv(intermediate, BLOCK_COLUMNS))
            _act_and_mul_kernel[grid](
                rows, out, intermediate, rows.stride(0), out.stride(0),
                GELU_TANH=activation == "gelu_tanh", BLOCK=BLOCK_COLUMNS, num_warps=4,
                **pdl_launch_args(x.device),
            )
        return out.view(*x.shape[:-1], intermediate)
