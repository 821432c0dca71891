"""KV-cache quantization (``--kv-cache-quant-algo FP8 | INT8``): cache dtype, per-layer scales.

The paged KV cache holds 1-byte values, half the bytes of a 16-bit cache, so a
given memory budget holds twice the tokens. Each decoder layer has one float32
scale for its keys and one for its values (TensorRT-LLM's
``kv_cache_scaling_factor``): ``scale = max |x| / 448`` (FP8 E4M3) or
``/ 127`` (INT8), the maxima measured at build time over the calibration texts
on post-RoPE keys and on values, exactly what the cache would hold. The rope
kernel quantizes as it writes, attention dequantizes as it reads
(``plugins/kv_cache_quant.py``).

The scales are recorded in ``engine.json`` (``quantization.kv_cache``) and set
on the model's decoder layers when the engine loads.
"""

from __future__ import annotations

import torch
from torch import nn

from executor_svc.quantization.records import KVCacheQuant
from plugins.kv_cache_quant import is_quantized_kv, kv_quant_max

# kv_cache_quant_algo -> the dtype the cache stores; "none" keeps the engine's dtype.
KV_CACHE_DTYPES: dict[str, torch.dtype] = {"FP8": torch.float8_e4m3fn, "INT8": torch.int8}
# A layer whose keys or values never leave zero still gets a usable scale.
MIN_AMAX = 1e-6


def kv_cache_dtype(kv_cache_quant_algo: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of an engine's KV cache: 1-byte for a quantized cache, else the model's."""
    if kv_cache_quant_algo == "none":
        return model_dtype
    try:
        return KV_CACHE_DTYPES[kv_cache_quant_algo]
    except KeyError:
        choices = ["none", *KV_CACHE_DTYPES]
        raise ValueError(f"kv_cache_quant_algo {kv_cache_quant_algo!r} is not supported; choose one of {choices}") from None


def kv_cache_record(kv_cache_quant_algo: str, amax: torch.Tensor, source: str) -> KVCacheQuant:
    """The record of a quantized cache from ``amax`` [layers, 2] (max |k|, max |v| per layer)."""
    dtype = KV_CACHE_DTYPES[kv_cache_quant_algo]
    scales = amax.float().clamp(min=MIN_AMAX).cpu() / kv_quant_max(dtype)  # [layers, 2]
    return KVCacheQuant(
        kv_cache_quant_algo, str(dtype).removeprefix("torch."), scales[:, 0].tolist(), scales[:, 1].tolist(), source
    )


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The layers that own KV-cache scales (``k_scale`` / ``v_scale``), in cache order."""
    return [layer for layer in model.layers if hasattr(layer, "k_scale")]


def apply_kv_cache_scales(model: nn.Module, record: KVCacheQuant | None) -> None:
    """Give each decoder layer its scales (``None``: back to 1.0, what a 16-bit cache ignores)."""
    layers = decoder_layers(model)
    if record is None:
        for layer in layers:
            layer.k_scale, layer.v_scale = 1.0, 1.0
        return
    if record.num_layers != len(layers) or len(record.v_scales) != len(layers):
        raise ValueError(
            f"the KV-cache record has scales for {record.num_layers} layers, the model has {len(layers)}; "
            "rebuild the engine"
        )
    for layer, k_scale, v_scale in zip(layers, record.k_scales, record.v_scales):
        layer.k_scale, layer.v_scale = float(k_scale), float(v_scale)


class KVAmax:
    """Running per-layer maxima of |k| and |v| over prompts written to a 16-bit cache."""

    def __init__(self, num_layers: int, device: torch.device) -> None:
        self.amax = torch.zeros(num_layers, 2, device=device)  # [layers, (k, v)], float32

    def update(self, kv_cache: torch.Tensor, num_tokens: int) -> None:
        """Fold in the first ``num_tokens`` slots of ``kv_cache``, where a prompt was just written.

        kv_cache: [layers, 2, blocks, tokens_per_block, kv_heads, D], 16-bit,
        the prompt's blocks 0.. in order (slot = position), as PromptForward writes it.
        """
        if is_quantized_kv(kv_cache.dtype):
            raise ValueError("KV maxima are measured on a 16-bit cache, before any quantization")
        written = kv_cache.flatten(2, 3)[:, :, :num_tokens]  # [layers, 2, tokens, kv_heads, D]
        self.amax = torch.maximum(self.amax, written.abs().amax(dim=(2, 3, 4)).float())


def random_token_lists(vocab_size: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    """Calibration input for random weights (a dummy engine): random ids, as meaningful as any text there."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(vocab_size, (count, max(2, length)), generator=generator).tolist()
