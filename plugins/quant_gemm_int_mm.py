"""W8A8 GEMM on integer units: ``torch._int_mm`` (INT8 x INT8 -> INT32), then the scales.

``torch._int_mm`` runs on CUDA (cuBLASLt IMMA) and, in the torch releases this
project runs on (2.11 on the GPU machine, 2.13 on the CPU), on the CPU too
(oneDNN), so the kernel is registered for both. Where a torch build lacks it,
the kernel is simply not registered and the float reference in
quant_gemm_torch.py is what runs.

cuBLAS asks for more than 16 rows and for K and N to be multiples of 8: small
batches (a decode step) are padded with zero rows, and odd K or N is an error
that names the shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plugins.registry import register_kernel

CUDA_MIN_ROWS = 17  # cuBLAS: "self.size(0) needs to be greater than 16"


def int_mm_available() -> bool:
    return hasattr(torch, "_int_mm")


if int_mm_available():

    @register_kernel("gemm_w8a8", "int_mm", description="torch._int_mm INT8 GEMM (INT32 accumulate), scales after")
    def gemm_w8a8_int_mm(
        x_q: torch.Tensor, x_scale: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype,
    ) -> torch.Tensor:
        # x_q: [M, K] int8, x_scale: [M, 1], qweight: [N, K] int8, w_scale: [N] -> [M, N]
        rows = x_q.shape[0]
        if x_q.is_cuda:
            if x_q.shape[1] % 8 or qweight.shape[0] % 8:
                raise ValueError(
                    f"torch._int_mm on CUDA needs K and N multiples of 8, got K={x_q.shape[1]}, N={qweight.shape[0]}"
                )
            if rows < CUDA_MIN_ROWS:
                x_q = F.pad(x_q, (0, 0, 0, CUDA_MIN_ROWS - rows))
        acc = torch._int_mm(x_q, qweight.t())[:rows]  # [M, N] int32; qweight.t() is the column-major B it wants
        return (acc.float() * x_scale * w_scale[None, :]).to(out_dtype)
