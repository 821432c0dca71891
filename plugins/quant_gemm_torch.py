"""Reference quantized GEMMs: dequantize, then an ordinary matmul.

One layer kind per weight/activation format, each ``y = x @ W.T`` with ``W``
stored quantized (layouts in executor_svc/quantization/quantize.py):

* ``gemm_w8a16``  x [M, K] float, INT8 weight [N, K], float32 scales [N]
* ``gemm_w4a16``  x [M, K] float, packed INT4 weight [N, K/2] (uint8, even channel
  in the low nibble), float16 scales and zeros [N, ceil(K / group)], optional
  per-input-channel ``pre_quant_scale`` [K] that multiplies x first (AWQ)
* ``gemm_w8a8``   INT8 x [M, K] with float32 per-token scales [M, 1], INT8 weight
  [N, K] with float32 per-channel scales [N]
* ``gemm_fp8``    FP8 x [M, K] with a float32 scale [M, 1] (per token) or [1]
  (per tensor), FP8 weight [N, K] with a float32 scale [1]; or, with the x
  scale None, x as 16-bit activations (weight-only FP8, what ``Fp8Linear``
  passes at decode sizes to a kernel that declares ``weight_only_rows``)

They run anywhere torch does (the CPU included), and they are what the fast
kernels are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plugins.registry import register_kernel


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """float32 [N, K] from packed INT4 codes [N, K/2] and per-group scales/zeros [N, groups]."""
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(1).float()  # [N, K]
    k = codes.shape[1]
    scale = scales.float().repeat_interleave(group_size, dim=1)[:, :k]
    zero = zeros.float().repeat_interleave(group_size, dim=1)[:, :k]
    return (codes - zero) * scale


@register_kernel("gemm_w8a16", "torch", description="reference: dequantize INT8 per-channel weights, then F.linear")
def gemm_w8a16(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    # x: [M, K], qweight: [N, K] int8, scales: [N] -> [M, N]
    weight = (qweight.float() * scales.float()[:, None]).to(x.dtype)
    return F.linear(x, weight)


@register_kernel("gemm_w4a16", "torch", description="reference: dequantize INT4 group weights, then F.linear")
def gemm_w4a16(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
    pre_quant_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    # x: [M, K], qweight: [N, K/2] uint8, scales/zeros: [N, groups] -> [M, N]
    if pre_quant_scale is not None:
        x = x * pre_quant_scale.to(x.dtype)
    return F.linear(x, dequantize_int4(qweight, scales, zeros, group_size).to(x.dtype))


@register_kernel("gemm_w8a8", "torch", description="reference: INT8 x INT8 as a float32 matmul, then both scales")
def gemm_w8a8(
    x_q: torch.Tensor, x_scale: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype,
) -> torch.Tensor:
    # x_q: [M, K] int8, x_scale: [M, 1], qweight: [N, K] int8, w_scale: [N] -> [M, N]
    # float32 holds every product exactly; the sums round only past 2**24.
    acc = x_q.float() @ qweight.float().t()
    return (acc * x_scale * w_scale[None, :]).to(out_dtype)


@register_kernel("gemm_fp8", "torch", description="reference: dequantize FP8 x and weight, float32 matmul")
def gemm_fp8(
    x_q: torch.Tensor, x_scale: torch.Tensor | None, weight: torch.Tensor, w_scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    # x_q: [M, K] fp8, x_scale: [M, 1] or [1] (None: x_q is unquantized), weight: [N, K] fp8, w_scale: [1] -> [M, N]
    acc = x_q.float() @ weight.float().t()
    return (acc * (w_scale if x_scale is None else x_scale * w_scale)).to(out_dtype)
