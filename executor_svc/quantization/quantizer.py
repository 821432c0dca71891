"""The module swap: quantize a loaded model (build), or rebuild its quantized modules (load).

Build: every Linear the plan quantizes is replaced by its quantized module,
with the scales calibration found (AWQ search, SmoothQuant factors folded into
the norm in front, static FP8 input scales) and, with GPTQ, the weights rounded
against each layer's calibration inputs. Load: the per-layer records in
``engine.json`` say which empty module goes where, and the engine's weights
file fills them; an engine of random weights (``--load-format dummy``) is
quantized at load instead, with unit AWQ/SmoothQuant scales since there is no
calibration to find better ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from executor_svc.build_config import QuantConfig
from executor_svc.quantization.awq import search_awq_clip, search_awq_scale
from executor_svc.quantization.calibration import CalibrationStats, LayerStats
from executor_svc.quantization.gptq import ColumnGrid, gptq_round
from executor_svc.quantization.layer_plan import replace_module
from executor_svc.quantization.linear import (
    Fp8Linear, Int4AWQLinear, Int8WeightOnlyLinear, SmoothQuantLinear, WeightRounding,
)
from executor_svc.quantization.quantize import FP8_MAX
from executor_svc.quantization.records import LayerQuant
from executor_svc.quantization.smoothquant import fold_into_norm, norm_in_front, smoothing_factors
from plugins.registry import get_kernel

if TYPE_CHECKING:
    from executor_svc.engine_file import EngineManifest

Kernel = Callable[..., torch.Tensor]


def _add_note(layer: LayerQuant, note: str) -> None:
    layer.note = f"{layer.note}; {note}" if layer.note else note


def _rounding(
    layer: LayerQuant, config: QuantConfig, stats: LayerStats | None, input_scale: torch.Tensor | None = None
) -> WeightRounding | None:
    """GPTQ rounding for this layer when the build asks for it (None: round to nearest).

    ``input_scale``: the weight is quantized with its input channels multiplied
    by it (AWQ, SmoothQuant), so the inputs it sees are divided by it and the
    Hessian of those inputs is ``H / (s s^T)``.
    """
    if config.weight_rounding != "gptq" or stats is None or stats.hessian is None:
        return None
    hessian = stats.hessian
    if input_scale is not None:
        s = input_scale.float()
        hessian = hessian / s[:, None] / s[None, :]

    def rounding(weight: torch.Tensor, grid: ColumnGrid) -> torch.Tensor:
        found = gptq_round(weight, hessian, grid, config.gptq_damp)
        _add_note(layer, f"GPTQ: output error {found.error_ratio:.3g}x round-to-nearest's")
        return found.weight

    return rounding


def _awq_module(
    layer: LayerQuant, weight: torch.Tensor, kernel: Kernel, config: QuantConfig, stats: LayerStats | None
) -> Int4AWQLinear:
    float_zeros = config.zero_point == "float"
    if stats is None:
        layer.note = "unit AWQ scales (no calibration)"
        return Int4AWQLinear.from_float(weight, kernel, layer.group_size, float_zeros=float_zeros)
    samples = stats.sample_matrix()
    found = search_awq_scale(samples, weight, stats.channel_absmean, layer.group_size, config.awq_grid_size, float_zeros)
    scaled = weight.float() * found.scale[None, :]
    clip = search_awq_clip(samples / found.scale[None, :], scaled, layer.group_size, max(1, config.awq_grid_size // 2),
                           float_zeros=float_zeros)
    ratio = found.error / found.plain_error if found.plain_error > 0 else 1.0
    layer.note = (
        f"AWQ alpha {found.alpha:.2f}: output error {ratio:.2f}x round-to-nearest's; "
        f"group ranges clipped to {clip.mean():.2f} on average"
    )
    rounding = _rounding(layer, config, stats, found.scale)
    return Int4AWQLinear.from_float(weight, kernel, layer.group_size, found.scale, clip, rounding, float_zeros)


def _smoothquant_module(
    model: nn.Module, layer: LayerQuant, weight: torch.Tensor, kernel: Kernel, config: QuantConfig, architecture: str,
    stats: LayerStats | None,
) -> SmoothQuantLinear:
    if stats is None:
        layer.note = "no smoothing (no calibration)"
        return SmoothQuantLinear.from_float(weight, kernel)
    alpha = config.smoothquant_alpha
    factors = smoothing_factors(stats.channel_absmax, weight, alpha)
    norm = norm_in_front(architecture, layer.name)
    if norm is not None:
        fold_into_norm(model.get_submodule(norm), factors)
        layer.note = f"SmoothQuant alpha {alpha}: factors folded into {norm}"
        rounding = _rounding(layer, config, stats, factors)
        return SmoothQuantLinear.from_float(weight.float() * factors[None, :], kernel, rounding=rounding)
    layer.pre_quant_scale = True
    layer.note = f"SmoothQuant alpha {alpha}: factors applied to the input"
    rounding = _rounding(layer, config, stats, factors)
    return SmoothQuantLinear.from_float(weight, kernel, smoothing=factors, rounding=rounding)


def _fp8_module(
    layer: LayerQuant, weight: torch.Tensor, kernel: Kernel, config: QuantConfig, stats: LayerStats | None
) -> Fp8Linear:
    if not layer.static_input_scale:
        return Fp8Linear.from_float(weight, kernel, rounding=_rounding(layer, config, stats))
    if stats is None:
        raise ValueError(f"{layer.name}: static FP8 activation scales need calibration")
    layer.note = f"calibrated input max |x| {stats.tensor_absmax:.3g}"
    input_scale = torch.tensor(max(stats.tensor_absmax, 1e-6) / FP8_MAX)
    return Fp8Linear.from_float(weight, kernel, input_scale, _rounding(layer, config, stats))


def _quantize_layer(
    model: nn.Module, layer: LayerQuant, weight: torch.Tensor, kernel: Kernel, config: QuantConfig,
    architecture: str, stats: LayerStats | None,
) -> nn.Module:
    """The quantized module for one Linear; fills in ``layer.note`` / ``layer.pre_quant_scale``."""
    if layer.algo == "W8A16":
        return Int8WeightOnlyLinear.from_float(weight, kernel, _rounding(layer, config, stats))
    if layer.algo == "W4A16_AWQ":
        return _awq_module(layer, weight, kernel, config, stats)
    if layer.algo == "W8A8_SQ_PER_CHANNEL_PER_TOKEN":
        return _smoothquant_module(model, layer, weight, kernel, config, architecture, stats)
    if layer.algo == "FP8":
        return _fp8_module(layer, weight, kernel, config, stats)
    raise ValueError(f"{layer.name}: unknown quant_algo {layer.algo!r}")


@torch.no_grad()
def quantize_model(
    model: nn.Module, layers: list[LayerQuant], config: QuantConfig, architecture: str, kernels: dict[str, Kernel],
    stats: CalibrationStats | None = None,
) -> None:
    """Replace each planned Linear of ``model`` by its quantized module (in place, one layer at a time)."""
    for layer in layers:
        if layer.algo == "none":
            continue
        weight = model.get_submodule(layer.name).weight.detach()
        layer_stats = stats.layers.get(layer.name) if stats is not None else None
        module = _quantize_layer(model, layer, weight, kernels[layer.kind], config, architecture, layer_stats)
        replace_module(model, layer.name, module)  # the float weight is freed with the old module


def empty_quantized_module(layer: LayerQuant, kernel: Kernel) -> nn.Module:
    """A quantized module of ``layer``'s shape and format with uninitialised buffers, for loading."""
    if layer.algo == "W8A16":
        return Int8WeightOnlyLinear(layer.in_features, layer.out_features, kernel)
    if layer.algo == "W4A16_AWQ":
        return Int4AWQLinear(layer.in_features, layer.out_features, kernel, layer.group_size)
    if layer.algo == "W8A8_SQ_PER_CHANNEL_PER_TOKEN":
        return SmoothQuantLinear(layer.in_features, layer.out_features, kernel, layer.pre_quant_scale)
    if layer.algo == "FP8":
        return Fp8Linear(layer.in_features, layer.out_features, kernel, layer.static_input_scale)
    raise ValueError(f"{layer.name}: unknown quant_algo {layer.algo!r}")


def quantized_kernels(
    layers: list[LayerQuant], plugin_names: dict[str, str], device: torch.device, dtype: torch.dtype
) -> dict[str, Kernel]:
    """kind -> the chosen GEMM function, for the kinds ``layers`` use."""
    kinds = {layer.kind for layer in layers if layer.algo != "none"}
    return {kind: get_kernel(kind, plugin_names.get(kind, "torch"), device, dtype).fn for kind in kinds}


def prepare_quantized_engine(
    model: nn.Module, manifest: EngineManifest, device: torch.device, dtype: torch.dtype, random_weights: bool,
) -> None:
    """Give ``model`` the engine's quantized modules before its weights are loaded (or drawn).

    random_weights: the model already holds random float weights (a dummy
    engine); quantize them now. Otherwise install empty modules that the
    engine's weights file fills. No-op for an unquantized engine.
    """
    record = manifest.quantization
    if record is None or all(layer.algo == "none" for layer in record.layers):
        return
    kernels = quantized_kernels(record.layers, {k: c.name for k, c in manifest.plugins.items()}, device, dtype)
    if random_weights:
        layers = [dataclasses.replace(layer) for layer in record.layers]  # notes change; the manifest's do not
        quantize_model(model, layers, manifest.build_config.quant_config, manifest.model.architecture, kernels)
        return
    with torch.device(device):
        for layer in record.layers:
            if layer.algo != "none":
                replace_module(model, layer.name, empty_quantized_module(layer, kernels[layer.kind]))
