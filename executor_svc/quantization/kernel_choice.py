"""Choosing the quantized GEMM implementation at build time, like every other layer kind.

An engine uses one quantized GEMM kind (its quant_algo's); its candidates are
timed with ``kernel_selection.choose`` in the shape of the model's q/k/v
projection, each as the quantized Linear module runs it (so FP8's timing
includes the activation quantization a candidate needs, and leaves it out
for one that takes 16-bit activations at decode sizes). Weight-only kinds and
FP8 are timed on decode steps, one at batch 1 and one at the largest decode
batch (at most 16 rows), summed: saving weight bytes is what they are for,
and the small-M kernels change strategy between the two. W8A8 is timed on a
context-sized batch. ``torch._scaled_mm`` needs compute capability 8.9,
which a KernelSpec cannot express: that candidate (and the Triton FP8 one,
whose E4M3 conversions need the same) is dropped on older GPUs (and a
request for it by name is an error, or a recorded fallback).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from executor_svc.build_config import BuildConfig
from executor_svc.engine_file import PluginChoice
from executor_svc.kernel_selection import (
    REFERENCE, BenchArgs, PluginUnavailableError, choose, record_tactics, time_kernel, tune_tactics,
)
from executor_svc.model.config import ModelConfig
from executor_svc.quantization.layer_plan import ALGO_FORMATS
from executor_svc.quantization.linear import Fp8Linear, Int4AWQLinear, Int8WeightOnlyLinear, Kernel, SmoothQuantLinear
from plugins.quant_gemm_scaled_mm import scaled_mm_supported
from plugins.registry import KernelSpec, list_kernels

log = logging.getLogger("inflight.build")

DECODE_KINDS = ("gemm_w8a16", "gemm_w4a16", "gemm_fp8")
FP8_KINDS = ("gemm_fp8",)  # candidates other than the reference need compute capability 8.9


def benchmark_tokens(kind: str, build: BuildConfig) -> tuple[int, ...]:
    """Rows of the timed calls, one call each (their times are summed)."""
    if kind in DECODE_KINDS:
        return tuple(sorted({1, min(build.max_batch_size, 16)}))
    return (min(build.max_num_tokens, 256),)


def quantized_layer(kind: str, weight: torch.Tensor, kernel: Kernel, group_size: int) -> nn.Module:
    """The quantized Linear of ``kind`` holding ``weight``, calling ``kernel`` (unit AWQ/SmoothQuant scales)."""
    if kind == "gemm_w8a16":
        return Int8WeightOnlyLinear.from_float(weight, kernel)
    if kind == "gemm_w4a16":
        return Int4AWQLinear.from_float(weight, kernel, group_size)
    if kind == "gemm_w8a8":
        return SmoothQuantLinear.from_float(weight, kernel)
    if kind == "gemm_fp8":
        return Fp8Linear.from_float(weight, kernel)
    raise ValueError(f"unknown quantized gemm kind {kind!r}")


def quant_benchmark_inputs(
    kind: str, model: ModelConfig, build: BuildConfig, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, BenchArgs]:
    """(the q/k/v projection's float weight, the inputs of the timed calls: one x per ``benchmark_tokens``)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    out_features = (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
    inputs = tuple(
        torch.randn(tokens, model.hidden_size, generator=gen).to(device=device, dtype=dtype)
        for tokens in benchmark_tokens(kind, build)
    )
    weight = (torch.randn(out_features, model.hidden_size, generator=gen) * model.hidden_size**-0.5).to(device)
    return weight, lambda: inputs


def as_layer_calls(spec: KernelSpec, weight: torch.Tensor, group_size: int) -> KernelSpec:
    """``spec`` whose ``fn`` runs the quantized layer built on ``spec.fn`` once per input it is given."""
    layer = quantized_layer(spec.kind, weight, spec.fn, group_size)

    def calls(*inputs: torch.Tensor) -> list[torch.Tensor]:
        return [layer(x) for x in inputs]

    return dataclasses.replace(spec, fn=calls)


def _runnable_here(spec: KernelSpec, device: torch.device) -> bool:
    return spec.kind not in FP8_KINDS or spec.name == REFERENCE or scaled_mm_supported(device)


def select_quant_plugins(
    model: ModelConfig, build: BuildConfig, device: torch.device, dtype: torch.dtype
) -> dict[str, PluginChoice]:
    """kind -> choice for the quantized GEMM kind the build's quant_algo uses ({} when unquantized)."""
    algo = build.quant_config.quant_algo
    if algo not in ALGO_FORMATS:
        return {}
    kind = ALGO_FORMATS[algo][0]
    requested = build.plugin_for(kind)
    registered = [spec for spec in list_kernels() if spec.kind == kind]
    runnable = [spec for spec in registered if _runnable_here(spec, device)]
    weight, args = quant_benchmark_inputs(kind, model, build, device, dtype)
    group = build.quant_config.group_size
    candidates = [as_layer_calls(spec, weight, group) if spec.supports(device, dtype) else spec for spec in runnable]
    dropped = [spec.name for spec in registered if spec not in runnable]
    if requested in dropped:
        why = f"{kind} plugin {requested!r} needs a GPU of compute capability 8.9 or newer (Ada, Hopper)"
        if not build.allow_fallback:
            raise PluginUnavailableError(f"{why}; choose another, use 'auto', or pass --allow-fallback")
        log.warning("FALLBACK: %s; using the %r reference implementation instead", why, REFERENCE)
        reference = next(spec for spec in candidates if spec.name == REFERENCE)
        choice = PluginChoice(REFERENCE, requested, {REFERENCE: time_kernel(reference.fn, args, device)}, True, why)
    else:
        tactics = tune_tactics(kind, requested, runnable, model, device, dtype,
                               **({"group_size": group} if kind == "gemm_w4a16" else {}))
        choice = choose(kind, requested, candidates, device, dtype, args, build.allow_fallback)
        record_tactics(choice, tactics)
    tokens = " + ".join(map(str, benchmark_tokens(kind, build)))
    choice.benchmark = f"{algo} q/k/v projection layer, {tokens} tokens"
    log.info("%s: %s (%s)", kind, choice.name, ", ".join(f"{n} {t:.0f} us" for n, t in choice.timings_us.items()))
    return {kind: choice}
