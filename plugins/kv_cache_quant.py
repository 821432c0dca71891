"""The 1-byte KV cache formats: FP8 E4M3 and INT8, one scale per layer for K and one for V.

A quantized cache stores ``q = quantize(x * (1 / scale))`` and attention reads
``x ~ q * scale``:

* FP8 (``torch.float8_e4m3fn``): saturate to +-448, round to nearest even;
* INT8 (``torch.int8``): round half to even, clamp to +-127.

The scale is applied as a multiplication by its float32 reciprocal rather than
a division, so that the torch reference and the Triton kernels (where a
float32 ``/`` compiles to an approximate division) store the same bytes.

Scales are Python floats fixed per layer when an engine loads: kernels take
them as scalar arguments, which a captured CUDA graph keeps. A 16-bit cache
ignores them. These are the reference functions; the Triton kernels
implement the same arithmetic and are tested against them bit for bit.
"""

from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
INT8_KV_DTYPE = torch.int8
FP8_KV_MAX = 448.0  # largest finite E4M3 value
INT8_KV_MAX = 127.0  # symmetric: -128 is never stored
QUANTIZED_KV_DTYPES = (FP8_KV_DTYPE, INT8_KV_DTYPE)
# What the Triton kernels get as their KV_QUANT constexpr.
KV_16BIT, KV_FP8, KV_INT8 = 0, 1, 2


def is_quantized_kv(dtype: torch.dtype) -> bool:
    """Whether a cache of ``dtype`` holds scaled 1-byte values."""
    return dtype in QUANTIZED_KV_DTYPES


def kv_quant_code(dtype: torch.dtype) -> int:
    """KV_16BIT, KV_FP8 or KV_INT8 for a cache of ``dtype``."""
    if dtype == FP8_KV_DTYPE:
        return KV_FP8
    if dtype == INT8_KV_DTYPE:
        return KV_INT8
    return KV_16BIT


def kv_quant_max(dtype: torch.dtype) -> float:
    """The largest magnitude a quantized cache of ``dtype`` stores: scale = max |x| / this."""
    if dtype == FP8_KV_DTYPE:
        return FP8_KV_MAX
    if dtype == INT8_KV_DTYPE:
        return INT8_KV_MAX
    raise ValueError(f"{dtype} is not a quantized KV-cache dtype; those are {QUANTIZED_KV_DTYPES}")


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x (keys or values, any float dtype) as a cache of ``dtype`` stores it."""
    if not is_quantized_kv(dtype):
        return x.to(dtype)
    y = x.float() * (1.0 / scale)  # float32 product with the float32-rounded reciprocal
    if dtype == FP8_KV_DTYPE:
        return y.clamp(-FP8_KV_MAX, FP8_KV_MAX).to(dtype)
    return torch.round(y).clamp(-INT8_KV_MAX, INT8_KV_MAX).to(dtype)


def dequantize_kv(stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache contents as ``dtype`` values: ``stored * scale`` in float32 for a quantized cache, else a cast."""
    if not is_quantized_kv(stored.dtype):
        return stored.to(dtype)
    return (stored.float() * scale).to(dtype)


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """A view that indexing ops accept: FP8 as uint8 (index_copy_ and friends lack FP8 kernels), others as is."""
    return cache.view(torch.uint8) if cache.dtype == FP8_KV_DTYPE else cache


def from_bytes(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Undo ``as_bytes`` for a tensor gathered from a cache of ``dtype``."""
    return data.view(dtype) if dtype == FP8_KV_DTYPE else data


def check_kv_cache_support(dtype: torch.dtype, device: torch.device) -> None:
    """Refuse an FP8 cache where Triton cannot convert E4M3 (CUDA compute capability below 8.9)."""
    if dtype == FP8_KV_DTYPE and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(
            f"an FP8 KV cache needs compute capability 8.9+ for the Triton kernels, this GPU has {major}.{minor}; "
            "build with --kv-cache-quant-algo INT8, or the torch rope and attention plugins"
        )
