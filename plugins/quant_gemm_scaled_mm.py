"""FP8 GEMM on Hopper/Ada tensor cores: ``torch._scaled_mm`` (E4M3 x E4M3, float32 accumulate).

Registered for CUDA only; ``torch._scaled_mm`` also needs compute capability
8.9 or newer, which the builder checks before timing it (see
``scaled_mm_supported``). Scales: per-tensor activations (static) use the
tensor-wise recipe; per-token activations use the row-wise recipe, which wants
a [1, N] weight scale and, below the newest cuBLAS, a bfloat16 output, so the
result is produced in bfloat16 and cast when the engine runs another dtype.
"""

from __future__ import annotations

import torch

from plugins.registry import register_kernel

MIN_COMPUTE_CAPABILITY = (8, 9)


def scaled_mm_supported(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` can run FP8 on ``device``."""
    if device.type != "cuda" or not torch.cuda.is_available() or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= MIN_COMPUTE_CAPABILITY


@register_kernel(
    "gemm_fp8", "scaled_mm", device_types=frozenset({"cuda"}),
    description="torch._scaled_mm FP8 GEMM (compute capability >= 8.9)",
)
def gemm_fp8_scaled_mm(
    x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype,
) -> torch.Tensor:
    # x_q: [M, K] fp8, x_scale: [M, 1] or [1], weight: [N, K] fp8, w_scale: [1] -> [M, N]
    if x_q.shape[1] % 16 or weight.shape[0] % 16:
        raise ValueError(f"torch._scaled_mm needs K and N multiples of 16, got K={x_q.shape[1]}, N={weight.shape[0]}")
    if x_scale.numel() == 1:  # tensor-wise: any output dtype
        return torch._scaled_mm(
            x_q, weight.t(), scale_a=x_scale.reshape(()), scale_b=w_scale.reshape(()), out_dtype=out_dtype
        )
    scale_b = w_scale.reshape(1, 1).expand(1, weight.shape[0]).contiguous()  # row-wise wants one scale per column
    out = torch._scaled_mm(x_q, weight.t(), scale_a=x_scale.contiguous(), scale_b=scale_b, out_dtype=torch.bfloat16)
    return out if out_dtype == torch.bfloat16 else out.to(out_dtype)
