"""Activation rows handed to an FP8 GEMM already quantized, and who asks for them.

An FP8 projection with dynamic per-token scales quantizes its input before its
GEMM: one more kernel per projection, reading the 16-bit rows that the kernel
before it (an RMSNorm, a gated activation) has just written. When that kernel
can store E4M3 values and row scales itself, the rows make one trip through
memory instead of two, at 1 byte a value instead of 2, and the quantization
kernel disappears.

The contract:

- A projection that would quantize ``rows`` rows dynamically says so through
  ``wants_fp8_rows(rows)`` (``executor_svc.quantization.linear.Fp8Linear``) and
  accepts an ``Fp8Rows`` in place of its 16-bit input.
- A norm or activation kernel plugin may carry a variant that returns
  ``Fp8Rows`` as its attribute ``fp8_rows_variant``; where it has none, the
  model quantizes the kernel's output with the projection's own quantizer.
  Either way the bytes and scales are those the projection would have made.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Fp8Rows:
    """Rows quantized per token to E4M3: ``values * scales`` approximates the 16-bit rows."""

    values: torch.Tensor  # [rows, cols] float8_e4m3fn
    scales: torch.Tensor  # [rows, 1] float32
    dtype: torch.dtype  # the rows' 16-bit dtype: the GEMM's output dtype


def wants_fp8_rows(projection: object, rows: int) -> bool:
    """Whether ``projection`` would quantize an input of ``rows`` rows per token to FP8 itself."""
    wants: Callable[[int], bool] | None = getattr(projection, "wants_fp8_rows", None)
    return wants is not None and wants(rows)


def fp8_rows_variant(kernel: Callable, dtype: torch.dtype) -> Callable | None:
    """The variant of a norm or activation kernel that stores ``Fp8Rows`` of ``dtype`` rows, if it has one.

    Only 16-bit rows are handed over by a variant. On an H200 the fused RMSNorm given
    float32 rows stored, now and then, E4M3 bytes other than those of quantizing the
    plain kernel's output (a float32 rounding difference inside the compiled kernel, not
    located further), which moved a float32 FP8 engine's perplexity. With 16-bit rows,
    rounded to 16 bits before they are quantized, neither the GPU tests nor scoring a
    bfloat16 FP8 engine both ways found a difference. Float32 FP8 engines (reference
    checks) take the projection's own quantizer instead.
    """
    if dtype not in (torch.float16, torch.bfloat16):
        return None
    return getattr(kernel, "fp8_rows_variant", None)
