"""Which Linear gets what: exclude patterns, per-layer records, module replacement."""

from __future__ import annotations

import logging
from fnmatch import fnmatchcase

from torch import nn

from executor_svc.build_config import QuantConfig
from executor_svc.model.llama import Linear
from executor_svc.quantization.quant_mode import QuantMode
from executor_svc.quantization.records import LayerQuant

log = logging.getLogger("inflight.build")

FP8_NAME = "float8_e4m3fn"
# quant_algo -> (plugin kind, weight format, activation format); "{dtype}" is the engine dtype.
ALGO_FORMATS = {
    "W8A16": ("gemm_w8a16", "int8 per-channel", "{dtype}"),
    "W4A16_AWQ": ("gemm_w4a16", "int4 g{group} asymmetric, {zero} zeros", "{dtype}"),
    "W8A8_SQ_PER_CHANNEL_PER_TOKEN": ("gemm_w8a8", "int8 per-channel", "int8 per-token dynamic"),
    "FP8": ("gemm_fp8", f"{FP8_NAME} per-tensor", FP8_NAME + " {fp8_activations}"),
}


def linear_modules(model: nn.Module) -> list[tuple[str, Linear]]:
    """The model's (not yet quantized) Linear modules, in module order."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, Linear)]


def expand_patterns(patterns: list[str], num_layers: int) -> list[str]:
    """``first_layer`` / ``last_layer`` -> the matching ``layers.N`` prefix."""
    aliases = {"first_layer": "layers.0", "last_layer": f"layers.{num_layers - 1}"}
    return [aliases.get(p, p) for p in patterns]


def matching_pattern(name: str, patterns: list[str]) -> str | None:
    """The first pattern that excludes ``name``: an fnmatch pattern, or a module path prefix."""
    for pattern in patterns:
        if fnmatchcase(name, pattern) or name.startswith(pattern + "."):
            return pattern
    return None


def high_precision_layer(name: str, in_features: int, out_features: int, dtype_name: str, note: str = "") -> LayerQuant:
    """The record of a Linear kept in the engine's dtype; ``note`` says why."""
    return LayerQuant(name, "none", in_features, out_features, "gemm", dtype_name, dtype_name, note=note)


def plan_layers(model: nn.Module, config: QuantConfig, num_layers: int, dtype_name: str) -> list[LayerQuant]:
    """A record per Linear: the algorithm it will get, or why it stays in high precision."""
    patterns = expand_patterns(config.exclude_modules, num_layers)
    module_names = [name for name, _ in model.named_modules()]
    for pattern in patterns:
        if not any(matching_pattern(name, [pattern]) for name in module_names):
            log.warning("exclude_modules pattern %r matches no module of the model", pattern)
    mode = config.quant_mode
    plan = []
    for name, linear in linear_modules(model):
        out_features, in_features = linear.weight.shape
        excluded_by = matching_pattern(name, patterns)
        if not mode.quantizes_weights or excluded_by is not None:
            note = f"excluded by {excluded_by!r}" if excluded_by is not None else ""
            plan.append(high_precision_layer(name, in_features, out_features, dtype_name, note))
            continue
        kind, weight, activation = ALGO_FORMATS[config.quant_algo]
        static = QuantMode.FP8_WEIGHTS in mode and config.activation_scheme == "static"
        fp8_activations = "per-tensor static" if static else "per-token dynamic"
        plan.append(LayerQuant(
            name, config.quant_algo, in_features, out_features, kind,
            weight=weight.format(group=config.group_size, zero=config.zero_point),
            activation=activation.format(dtype=dtype_name, fp8_activations=fp8_activations),
            group_size=config.group_size if QuantMode.PER_GROUP in mode else 0,
            pre_quant_scale=QuantMode.AWQ in mode, static_input_scale=static,
        ))
    return plan


def replace_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)
