"""FP8 GEMM on Hopper/Ada tensor cores: ``torch._scaled_mm`` (E4M3 x E4M3, fast accumulation).

Registered for CUDA only; ``torch._scaled_mm`` also needs compute capability
8.9 or newer, which the builder checks before timing it (see
``scaled_mm_supported``). Scales: per-tensor activations (static) use the
tensor-wise recipe; per-token activations use the row-wise recipe, which wants
a [1, N] weight scale and, below the newest cuBLAS, a bfloat16 output, so the
result is produced in bfloat16 and cast when the engine runs another dtype.

Accumulation uses the tensor cores' fast mode (``use_fast_accum``), which
promotes partial sums to float32 less often than the exact mode. vLLM's CUTLASS
FP8 kernels, TensorRT-LLM and fbgemm run FP8 this way too; it shortens an FP8
GEMM by several percent, and the build's perplexity gate (``inflight build
--validate``) measures what it costs in accuracy on the engine's own weights.
"""

from __future__ import annotations

import weakref

import torch

from plugins.registry import register_kernel

MIN_COMPUTE_CAPABILITY = (8, 9)
FAST_ACCUMULATION = True  # see the module docstring


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
            x_q, weight.t(), scale_a=x_scale.reshape(()), scale_b=w_scale.reshape(()), out_dtype=out_dtype,
            use_fast_accum=FAST_ACCUMULATION,
        )
    scale_b = _column_scales(w_scale, weight.shape[0])
    out = torch._scaled_mm(
        x_q, weight.t(), scale_a=x_scale.contiguous(), scale_b=scale_b, out_dtype=torch.bfloat16,
        use_fast_accum=FAST_ACCUMULATION,
    )
    return out if out_dtype == torch.bfloat16 else out.to(out_dtype)


# Row-wise scaling wants the weight's one scale repeated per output column, contiguous: a copy
# kernel per projection per step if made on every call (a quarter of a decode step's kernels).
# So it is made once per weight scale and kept while that scale lives. An in-place change to the
# scale shows in its version counter; inference-mode tensors have none, and the engine writes
# scales only while building and loading, before any forward reads them.
_COLUMN_SCALES: dict[int, tuple[weakref.ref, int | None, torch.Tensor]] = {}


def _column_scales(w_scale: torch.Tensor, columns: int) -> torch.Tensor:
    """``w_scale`` ([1]) as a contiguous [1, columns] row, made once per scale tensor."""
    key = id(w_scale)
    version = None if w_scale.is_inference() else w_scale._version
    cached = _COLUMN_SCALES.get(key)
    if cached is not None:
        ref, cached_version, scales = cached
        if ref() is w_scale and cached_version == version and scales.shape[1] == columns:
            return scales
    scales = w_scale.reshape(1, 1).expand(1, columns).contiguous()
    forget = lambda _, key=key: _COLUMN_SCALES.pop(key, None)  # noqa: E731  (the scale is gone)
    _COLUMN_SCALES[key] = (weakref.ref(w_scale, forget), version, scales)
    return scales
