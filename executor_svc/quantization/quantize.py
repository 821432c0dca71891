"""Quantize / dequantize primitives: pure functions on tensors.

Weight formats (``weight``: ``[out, in]``, the Linear layout):

* INT8 per output channel, symmetric: ``w ~ q * scale[out]``, q in [-127, 127].
* INT4 per group of ``group_size`` input channels, asymmetric (as in the AWQ
  paper): ``w ~ (q - zero) * scale``, q in [0, 15], two values per byte (even
  input channel in the low nibble). A last group shorter than ``group_size``
  (hidden 576 with groups of 128) is allowed. The zero is a whole code (AWQ's
  format: the grid holds 0 exactly) or, with ``float_zeros``, any float16 (the
  grid spans the group's own min..max, as llama.cpp's Q4_1 and HQQ store it).
  The kernels read both alike: they only ever compute ``zero * scale``.
* FP8 E4M3 with one scale per tensor: ``w ~ fp8 * scale``.

Activations: INT8 or FP8 with one scale per token (dynamic), or FP8 with one
static scale per tensor. Scales are float32 except the INT4 group scales and
zeros, which are float16 (as AWQ and TensorRT-LLM store them): there is one
pair per 128 weights, and at 32 bits they would add a quarter to the bytes a
decode step reads.
"""

from __future__ import annotations

import torch

INT8_MAX = 127.0
INT4_MAX = 15.0
try:
    from plugins.quant_activation_triton import quantize_fp8_per_token_triton
except ImportError:  # no triton: the torch reference runs everywhere
    quantize_fp8_per_token_triton = None

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
INV_FP8_MAX = float(torch.tensor(1.0 / FP8_MAX, dtype=torch.float32))  # 1/448 as float32 rounds it
GROUP_SCALE_DTYPE = torch.float16
# Scales never drop below this, so an all-zero row or group quantizes to zeros
# instead of dividing by zero (and stays a normal float16).
MIN_SCALE = 1e-5
# Float INT4 zeros stay within this (float16 reaches 65504): a group whose values are all far
# from 0 on a narrow range gets a coarser grid rather than an infinite zero.
FLOAT_ZERO_LIMIT = 16384.0


# The per-value rounding of each weight format, in one place: the quantizers below, the error
# searches (AWQ) and GPTQ's grids all round through these. Inputs are float32 (or float64)
# values and scales that broadcast against them.


def round_int8(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Symmetric INT8 codes -127..127 of ``values / scales`` (nearest), in the values' float dtype."""
    return torch.round(values / scales).clamp_(-INT8_MAX, INT8_MAX)


def round_int4(values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """Asymmetric INT4 codes 0..15 of ``values / scales + zeros`` (nearest, saturating), in the values' float dtype.

    ``zeros`` may be whole codes or any float.
    """
    return torch.round(values / scales + zeros).clamp_(0, INT4_MAX)


def round_fp8(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 values of ``values / scale`` (nearest, saturating at +-448)."""
    return (values / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def int8_channel_scales(weight: torch.Tensor) -> torch.Tensor:
    """float32 [out]: each output channel's largest |w| maps to 127."""
    return (weight.float().abs().amax(dim=1) / INT8_MAX).clamp(min=MIN_SCALE)


def quantize_int8_per_channel(
    weight: torch.Tensor, scales: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (int8 [out, in], float32 scales [out]); ``scales`` default to ``int8_channel_scales``."""
    w = weight.float()
    scales = int8_channel_scales(w) if scales is None else scales.float()
    return round_int8(w, scales[:, None]).to(torch.int8), scales


def dequantize_int8_per_channel(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return q.float() * scales.float()[:, None]


def num_groups(in_features: int, group_size: int) -> int:
    return -(-in_features // group_size)


def _group_extrema(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, min) of each group of input channels, [out, groups] float32; a short last group is its own."""
    w = weight.float()
    full = w.shape[1] // group_size * group_size
    head = w[:, :full].reshape(w.shape[0], -1, group_size)
    maxes, mins = [head.amax(dim=2)], [head.amin(dim=2)]
    if full < w.shape[1]:
        maxes.append(w[:, full:].amax(dim=1, keepdim=True))
        mins.append(w[:, full:].amin(dim=1, keepdim=True))
    return torch.cat(maxes, dim=1), torch.cat(mins, dim=1)


def group_values_per_channel(group_values: torch.Tensor, group_size: int, in_features: int) -> torch.Tensor:
    """[out, groups] -> [out, in]: each group's value repeated over its channels."""
    return group_values.float().repeat_interleave(group_size, dim=1)[:, :in_features]


def int4_group_params(
    weight: torch.Tensor, group_size: int, clip: torch.Tensor | None = None, float_zeros: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric INT4 (scales, zeros) per group, both [out, groups] in float16.

    Integer zeros (the default) are whole codes 0..15: the range is stretched to
    hold 0, which the grid then holds exactly. ``float_zeros``: the grid spans
    each group's own min..max, 16 levels with no stretch; the zero is any float.
    ``clip`` ([out, groups], in (0, 1]) shrinks each group's range (towards 0,
    or towards the range's middle with float zeros): the few weights past it
    saturate, and all the others get a finer grid.
    """
    w_max, w_min = _group_extrema(weight, group_size)
    if float_zeros:
        if clip is not None:
            middle, half = (w_max + w_min) / 2, (w_max - w_min) / 2 * clip
            w_max, w_min = middle + half, middle - half
        # A narrow range far from 0 would put the zero (-min / scale) past float16's range:
        # a scale of at least 1/FLOAT_ZERO_LIMIT of the group's largest |w| keeps it within.
        magnitude = torch.maximum(w_max.abs(), w_min.abs()) / FLOAT_ZERO_LIMIT
        scales = torch.maximum((w_max - w_min) / INT4_MAX, magnitude).clamp(min=MIN_SCALE).to(GROUP_SCALE_DTYPE)
        return scales, (-w_min / scales.float()).to(GROUP_SCALE_DTYPE)
    w_max, w_min = w_max.clamp(min=0.0), w_min.clamp(max=0.0)  # the range always holds 0, so zero is exact
    if clip is not None:
        w_max, w_min = w_max * clip, w_min * clip
    scales = ((w_max - w_min) / INT4_MAX).clamp(min=MIN_SCALE).to(GROUP_SCALE_DTYPE)
    zeros = torch.round(-w_min / scales.float()).clamp(0, INT4_MAX).to(GROUP_SCALE_DTYPE)
    return scales, zeros


def int4_codes(weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """INT4 codes 0..15 of ``weight`` under given group (scales, zeros): uint8 [out, in]."""
    in_features = weight.shape[1]
    scale = group_values_per_channel(scales, group_size, in_features)
    zero = group_values_per_channel(zeros, group_size, in_features)
    return round_int4(weight.float(), scale, zero).to(torch.uint8)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [out, in] (in even) -> bytes [out, in / 2]: even channel low nibble, odd channel high."""
    if codes.shape[1] % 2:
        raise ValueError(f"INT4 packing needs an even number of input channels, got {codes.shape[1]}")
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """bytes [out, in / 2] -> uint8 codes [out, in]."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(1)


def quantize_int4_groupwise(
    weight: torch.Tensor, group_size: int, clip: torch.Tensor | None = None,
    params: tuple[torch.Tensor, torch.Tensor] | None = None, float_zeros: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (packed uint8 [out, in / 2], scales [out, groups], zeros [out, groups]).

    ``params``: (scales, zeros) to use instead of ``int4_group_params(weight, group_size, clip, float_zeros)``.
    """
    scales, zeros = int4_group_params(weight, group_size, clip, float_zeros) if params is None else params
    return pack_int4(int4_codes(weight, scales, zeros, group_size)), scales, zeros


def dequantize_int4_groupwise(
    packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """The float32 weight [out, in] that packed INT4 codes stand for."""
    codes = unpack_int4(packed).float()
    in_features = codes.shape[1]
    zero = group_values_per_channel(zeros, group_size, in_features)
    return (codes - zero) * group_values_per_channel(scales, group_size, in_features)


def fake_quantize_int4(
    weight: torch.Tensor, group_size: int, clip: torch.Tensor | None = None, float_zeros: bool = False
) -> torch.Tensor:
    """Quantize-dequantize round trip in float32 (for searches that only need the error)."""
    scales, zeros = int4_group_params(weight, group_size, clip, float_zeros)
    in_features = weight.shape[1]
    scale = group_values_per_channel(scales, group_size, in_features)
    zero = group_values_per_channel(zeros, group_size, in_features)
    return (round_int4(weight.float(), scale, zero) - zero).mul_(scale)


def fp8_tensor_scale(weight: torch.Tensor) -> torch.Tensor:
    """float32 [1]: the weight's largest |w| maps to 448."""
    return (weight.float().abs().amax() / FP8_MAX).clamp(min=MIN_SCALE).reshape(1)


def quantize_fp8_per_tensor(
    weight: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (float8_e4m3fn [out, in], float32 scale [1]); ``scale`` defaults to ``fp8_tensor_scale``."""
    w = weight.float()
    scale = fp8_tensor_scale(w) if scale is None else scale.float().reshape(1)
    return round_fp8(w, scale), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float()


# -- activations (on the hot path of the quantized Linear modules) -------------------


def quantize_int8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [tokens, in] -> (int8 [tokens, in], float32 scales [tokens, 1])."""
    x32 = x.float()
    scales = (x32.abs().amax(dim=1, keepdim=True) / INT8_MAX).clamp(min=1e-8)
    return round_int8(x32, scales).to(torch.int8), scales


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [tokens, in] -> (float8_e4m3fn [tokens, in], float32 scales [tokens, 1]).

    On a GPU one fused Triton kernel computes the same bytes and scales as the
    reference (``plugins/quant_activation_triton.py``): it runs before every FP8
    GEMM of a context or large-batch step, where six torch kernels cost more than
    the GEMM's savings.
    """
    if x.is_cuda and quantize_fp8_per_token_triton is not None:
        return quantize_fp8_per_token_triton(x if x.stride(-1) == 1 else x.contiguous())
    return quantize_fp8_per_token_reference(x)


def quantize_fp8_per_token_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_fp8_per_token`` in torch, rounded the same way on every device: the scale is a
    product with float32 1/448 (torch's CUDA kernels turn a division by a scalar into that
    product, its CPU kernels divide), and its reciprocal is divided in float64 and rounded to
    float32, which is the correctly rounded float32 quotient (torch's float32 reciprocal on
    the GPU need not be)."""
    x32 = x.float()
    scales = (x32.abs().amax(dim=1, keepdim=True) * INV_FP8_MAX).clamp(min=1e-8)
    inv_scales = (1.0 / scales.double()).float()
    return (x32 * inv_scales).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scales


def quantize_fp8_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [tokens, in] -> float8_e4m3fn with a calibrated per-tensor ``scale`` [1]; outliers saturate."""
    return round_fp8(x.float(), scale)
