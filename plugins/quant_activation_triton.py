"""Per-token FP8 quantization of activations in one Triton kernel.

FP8 GEMMs with dynamic activation scales (``torch._scaled_mm``'s row-wise
recipe) need, for every token row x: scale = max|x| / 448 and x * (1 / scale)
saturated to E4M3. In torch that is a float32 copy, an absolute value, a row
maximum, a division, a clamp and a cast: six kernels and a float32 tensor
the size of x, before each of a layer's GEMMs. Here one program per row reads
the row twice (the second read comes from L2) and writes only the 1-byte
values and the scale.

The arithmetic is the reference's (``quantize_fp8_per_token`` in
``executor_svc/quantization/quantize.py``): the scale as a product with
float32 1/448, an IEEE division for its reciprocal, a float32 product,
saturation, and rounding to nearest even done in float32 so that the final
conversion is exact; the bytes and scales equal the reference's on every
device. CUDA-graph safe: the grid comes from shapes only.
Tests run it on the CPU through Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    from plugins.rope_triton import round_to_e4m3
except ImportError:  # no triton: the kernel is not defined and callers use the torch reference
    triton = None

MIN_SCALE = 1e-8  # an all-zero row still gets a usable scale
INV_FP8_MAX = 1.0 / 448.0  # passed as float32: the reference's factor (executor_svc.quantization.quantize)


if triton is not None:
    HAS_DIV_RN_OP = hasattr(tl.math, "div_rn")  # older Triton: fdiv with IEEE rounding

    @triton.jit
    def fp8_row_scale(amax, inv_fp8_max, min_scale, HAS_DIV_RN: tl.constexpr):
        """(scale, 1 / scale) of a row whose largest magnitude is ``amax``, as the reference computes them."""
        scale = tl.maximum(amax * inv_fp8_max, min_scale)
        # A correctly rounded reciprocal, as torch's: a plain float32 / need not be.
        if HAS_DIV_RN:
            inv_scale = tl.math.div_rn(1.0, scale)
        else:
            inv_scale = tl.fdiv(1.0, scale, ieee_rounding=True)
        return scale, inv_scale

    @triton.jit
    def to_e4m3(x, inv_scale):
        """float32 ``x`` times ``inv_scale``, saturated and rounded to nearest even on E4M3's grid."""
        y = tl.minimum(tl.maximum(x * inv_scale, -448.0), 448.0)
        return round_to_e4m3(y).to(tl.float8e4nv)

    @triton.jit
    def _fp8_per_token_kernel(
        x_ptr, q_ptr, scale_ptr, n_cols, x_stride, inv_fp8_max, min_scale, BLOCK: tl.constexpr, HAS_DIV_RN: tl.constexpr,
    ):
        row = tl.program_id(0)
        x_row = x_ptr + row.to(tl.int64) * x_stride
        q_row = q_ptr + row.to(tl.int64) * n_cols
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale, inv_scale = fp8_row_scale(tl.max(amax, axis=0), inv_fp8_max, min_scale, HAS_DIV_RN)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(q_row + cols, to_e4m3(x, inv_scale), mask=mask)
        tl.store(scale_ptr + row, scale)

    def fp8_rows_buffers(rows: int, cols: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Empty (E4M3 values [rows, cols], float32 scales [rows, 1]) for a kernel to fill."""
        return (torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=device),
                torch.empty((rows, 1), dtype=torch.float32, device=device))

    def quantize_fp8_per_token_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [tokens, in] (16- or 32-bit) -> (float8_e4m3fn [tokens, in], float32 scales [tokens, 1])."""
        if x.dim() != 2 or x.stride(1) != 1:
            raise ValueError(f"expected a 2-D row-major activation, got shape {tuple(x.shape)} strides {x.stride()}")
        rows, cols = x.shape
        q, scales = fp8_rows_buffers(rows, cols, x.device)
        if rows:
            block = min(2048, triton.next_power_of_2(max(cols, 16)))
            _fp8_per_token_kernel[(rows,)](
                x, q, scales, cols, x.stride(0), INV_FP8_MAX, MIN_SCALE, BLOCK=block, HAS_DIV_RN=HAS_DIV_RN_OP,
                num_warps=4 if block <= 1024 else 8,
            )
        return q, scales
