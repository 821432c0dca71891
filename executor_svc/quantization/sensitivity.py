"""Which decoder layers stay in high precision because calibration says so.

``QuantConfig.sensitive_layers = N`` (``inflight build --keep-sensitive-layers N``)
measures, on calibration texts, how much each decoder layer's quantization moves
the model's next-token distributions, and keeps the N layers that move them most
in the engine's dtype (what TensorRT Model Optimizer's auto-quantize search does,
in a simpler form: whole decoder layers, one at a time, a fixed count).

A layer's sensitivity is the mean KL divergence, in nats per predicted token,
from the unquantized model's distribution to the one of the model whose only
quantized Linears are that layer's planned ones. Those are rounded to their format
in place, round to nearest (the format's own scales, no AWQ search, no GPTQ):
weights for every format, and the inputs too for the formats that quantize
activations (per-token, as the dynamic schemes do at run time). Rounding to
nearest overstates what AWQ or GPTQ will lose, but layer against layer it ranks
where the format hurts, which is all the choice needs. It costs one forward pass
over the texts per decoder layer plus one for the reference.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from executor_svc.build_config import QuantConfig
from executor_svc.quantization.forward import PromptForward
from executor_svc.quantization.layer_plan import high_precision_layer
from executor_svc.quantization.perplexity import logit_chunks
from executor_svc.quantization.quantize import (
    dequantize_fp8, dequantize_int8_per_channel, fake_quantize_int4, quantize_fp8_per_tensor,
    quantize_fp8_per_token_reference, quantize_int8_per_channel, quantize_int8_per_token,
)
from executor_svc.quantization.records import LayerQuant, LayerSensitivity

log = logging.getLogger("inflight.build")

SENSITIVITY_TEXTS = 8  # calibration texts scored per layer: ranking layers needs far fewer than calibrating them

Rounding = Callable[[torch.Tensor], torch.Tensor]


def format_rounding(config: QuantConfig) -> tuple[Rounding, Rounding | None]:
    """(weight rounding, input rounding or None) to nearest in ``config``'s format, in the tensor's dtype."""
    algo = config.quant_algo
    if algo == "W8A16":
        return _int8_weight, None
    if algo == "W4A16_AWQ":
        group, float_zeros = config.group_size, config.zero_point == "float"
        return (lambda w: fake_quantize_int4(w, group, float_zeros=float_zeros).to(w.dtype)), None
    if algo == "W8A8_SQ_PER_CHANNEL_PER_TOKEN":
        return _int8_weight, _int8_tokens
    if algo == "FP8":
        return round_fp8_weight, round_fp8_tokens
    raise ValueError(f"no weight format to measure sensitivity for quant_algo {algo!r}")


def _int8_weight(w: torch.Tensor) -> torch.Tensor:
    return dequantize_int8_per_channel(*quantize_int8_per_channel(w)).to(w.dtype)


def _int8_tokens(x: torch.Tensor) -> torch.Tensor:
    q, scales = quantize_int8_per_token(x)
    return (q.float() * scales).to(x.dtype)


def round_fp8_weight(w: torch.Tensor) -> torch.Tensor:
    """``w`` through E4M3 with one scale per tensor and back, in its dtype."""
    return dequantize_fp8(*quantize_fp8_per_tensor(w)).to(w.dtype)


def round_fp8_tokens(x: torch.Tensor) -> torch.Tensor:
    """``x`` [tokens, in] through E4M3 with one scale per token and back, in its dtype."""
    q, scales = quantize_fp8_per_token_reference(x)
    return (q.float() * scales).to(x.dtype)


@contextmanager
def rounded(modules: list[nn.Module], weight: Rounding, inputs: Rounding | None) -> Iterator[None]:
    """``modules`` (Linears) compute with rounded weights (and inputs) inside the block; restored after."""
    originals = [m.weight.data for m in modules]
    hooks = []
    try:
        for m in modules:
            m.weight.data = weight(m.weight.data)
            if inputs is not None:
                hooks.append(m.register_forward_pre_hook(lambda _m, args: (inputs(args[0]), *args[1:])))
        yield
    finally:
        for m, original in zip(modules, originals):
            m.weight.data = original
        for hook in hooks:
            hook.remove()


def _planned_in_layer(plan: list[LayerQuant], index: int) -> list[int]:
    """Positions in ``plan`` of decoder layer ``index``'s Linears that are planned to be quantized."""
    prefix = f"layers.{index}."
    return [i for i, layer in enumerate(plan) if layer.algo != "none" and layer.name.startswith(prefix)]


@torch.inference_mode()
def _log_probs(runner: PromptForward, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float32 next-token log-probabilities of ``runner.model``."""
    hidden = runner.hidden_states(ids)
    return torch.cat([F.log_softmax(logits, dim=-1) for _, logits in logit_chunks(runner.model, hidden)])


@torch.inference_mode()
def mean_kl(runner: PromptForward, token_lists: list[list[int]], references: list[torch.Tensor]) -> float:
    """Mean KL(reference || model) per token over ``token_lists``, nats."""
    total, count = 0.0, 0
    for ids, ref in zip(token_lists, references):
        got = _log_probs(runner, ids)
        total += float((ref.exp() * (ref - got)).sum())
        count += ref.shape[0]
    return total / count


def layer_sensitivity(
    runner: PromptForward, model: nn.Module, plan: list[LayerQuant], config: QuantConfig, num_layers: int,
    token_lists: list[list[int]], progress: bool = True,
) -> list[float]:
    """Each decoder layer's sensitivity (mean KL, nats per token) with its planned Linears rounded alone."""
    weight, inputs = format_rounding(config)
    references = [_log_probs(runner, ids) for ids in token_lists]
    kl = []
    for index in tqdm(range(num_layers), desc="layer sensitivity", unit="layer", disable=not progress, leave=False):
        modules = [model.get_submodule(plan[i].name) for i in _planned_in_layer(plan, index)]
        if not modules:  # nothing of this layer is quantized: quantizing it changes nothing
            kl.append(0.0)
            continue
        with rounded(modules, weight, inputs):
            kl.append(mean_kl(runner, token_lists, references))
    return kl


def keep_sensitive_layers(
    runner: PromptForward, model: nn.Module, plan: list[LayerQuant], config: QuantConfig, num_layers: int,
    token_lists: list[list[int]], dtype_name: str, progress: bool = True,
) -> LayerSensitivity:
    """Measure every decoder layer and take the ``config.sensitive_layers`` most sensitive out of ``plan``
    (their Linears become high-precision entries, in place); what was measured and kept."""
    kl = layer_sensitivity(runner, model, plan, config, num_layers, token_lists, progress)
    ranked = sorted(range(num_layers), key=lambda i: -kl[i])
    kept = [i for i in ranked[: config.sensitive_layers] if kl[i] > 0.0]
    for rank, index in enumerate(kept, start=1):
        for position in _planned_in_layer(plan, index):
            layer = plan[position]
            plan[position] = high_precision_layer(
                layer.name, layer.in_features, layer.out_features, dtype_name,
                f"kept by sensitivity: rank {rank} of {num_layers} layers, KL {kl[index]:.2e}",
            )
    num_tokens = sum(len(ids) for ids in token_lists)
    log.info("layer sensitivity (%s, KL nats/token): kept layers %s; most sensitive %s", config.quant_algo, kept,
             ", ".join(f"{i}: {kl[i]:.2e}" for i in ranked[:5]))
    return LayerSensitivity(
        metric=f"mean KL divergence of next-token distributions from the unquantized model's, nats per token, "
        f"with one decoder layer's Linears rounded to nearest in {config.quant_algo}",
        num_texts=len(token_lists), num_tokens=num_tokens, kl=[float(f"{v:.4g}") for v in kl], kept=kept,
    )
