"""GPTQ's sequential order: calibrate and quantize one decoder layer at a time.

A one-pass build records every layer's inputs from the unquantized model. The
GPTQ paper instead quantizes layer after layer, each one calibrated on the
outputs of the layers before it as they will run, already quantized, so each
layer's rounding also absorbs what the earlier layers' rounding changed. Here
each decoder layer's planned Linears are calibrated in a pass that stops after
that layer (``calibrate(stop_after=...)``), then quantized at once; Linears
outside the decoder layers (an LM head not kept in high precision) come last,
after a whole forward. Only one layer's statistics exist at a time: for
Llama-3.1-8B about 1 GiB of Hessians instead of about 31 GiB for all layers.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn
from tqdm import tqdm

from executor_svc.build_config import QuantConfig
from executor_svc.quantization.calibration import calibrate
from executor_svc.quantization.forward import PromptForward
from executor_svc.quantization.quantizer import quantize_model
from executor_svc.quantization.records import LayerQuant

_DECODER_LAYER = re.compile(r"^(layers\.\d+)\.")


def decoder_layer_groups(layers: list[LayerQuant]) -> list[tuple[str, list[LayerQuant]]]:
    """The quantized ``layers`` grouped by decoder layer ("layers.N"), in model order; Linears outside
    the decoder layers form a last group named ""."""
    groups: dict[str, list[LayerQuant]] = {}
    for layer in layers:
        if layer.algo == "none":
            continue
        match = _DECODER_LAYER.match(layer.name)
        groups.setdefault(match.group(1) if match else "", []).append(layer)
    outside = groups.pop("", None)
    ordered = sorted(groups.items(), key=lambda item: int(item[0].split(".")[1]))
    return ordered + ([("", outside)] if outside else [])


@torch.no_grad()
def quantize_sequentially(
    runner: PromptForward, model: nn.Module, layers: list[LayerQuant], config: QuantConfig, architecture: str,
    kernels: dict[str, Callable[..., torch.Tensor]], token_lists: list[list[int]], max_samples: int,
    progress: bool = True,
) -> None:
    """Calibrate and quantize ``model``'s planned Linears one decoder layer at a time (in place)."""
    groups = decoder_layer_groups(layers)
    for prefix, group in tqdm(groups, desc="calibrate + GPTQ", unit="layer", disable=not progress, leave=False):
        modules = {layer.name: model.get_submodule(layer.name) for layer in group}
        stop_after = model.get_submodule(prefix) if prefix else None
        stats = calibrate(
            runner, modules, token_lists, max_samples, progress=False, hessians=True, stop_after=stop_after
        )
        quantize_model(model, group, config, architecture, kernels, stats)
        del stats  # this layer's Hessians, before the next layer's are summed
