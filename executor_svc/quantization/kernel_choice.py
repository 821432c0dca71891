"""Choosing the quantized GEMM implementation at build time, like every other layer kind.

An engine uses one quantized GEMM kind (its quant_algo's); its candidates are
timed with ``kernel_selection.choose`` on weights quantized in that format, in
the shape of the model's q/k/v projection. Weight-only kinds are timed on a
decode-sized batch, since saving weight bytes is what they are for; W8A8 and
FP8 on a context-sized one. ``torch._scaled_mm`` needs compute capability 8.9,
which a KernelSpec cannot express: that candidate is dropped on older GPUs
(and a request for it by name is an error, or a recorded fallback).
"""

from __future__ import annotations

import logging

import torch

from executor_svc.build_config import BuildConfig
from executor_svc.engine_file import PluginChoice
from executor_svc.kernel_selection import REFERENCE, BenchArgs, PluginUnavailableError, choose, time_kernel
from executor_svc.model.config import ModelConfig
from executor_svc.quantization.layer_plan import ALGO_FORMATS
from executor_svc.quantization.quantize import (
    quantize_fp8_per_tensor, quantize_fp8_per_token, quantize_int4_groupwise, quantize_int8_per_channel,
    quantize_int8_per_token,
)
from plugins.quant_gemm_scaled_mm import scaled_mm_supported
from plugins.registry import KernelSpec, list_kernels

log = logging.getLogger("inflight.build")

DECODE_KINDS = ("gemm_w8a16", "gemm_w4a16")


def benchmark_tokens(kind: str, build: BuildConfig) -> int:
    if kind in DECODE_KINDS:
        return min(build.max_batch_size, 16)
    return min(build.max_num_tokens, 256)


def quant_benchmark_inputs(
    kind: str, model: ModelConfig, build: BuildConfig, device: torch.device, dtype: torch.dtype
) -> BenchArgs:
    """Arguments of ``kind``'s GEMM on the model's q/k/v projection shape."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    tokens = benchmark_tokens(kind, build)
    out_features = (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
    x = torch.randn(tokens, model.hidden_size, generator=gen).to(device=device, dtype=dtype)
    w = (torch.randn(out_features, model.hidden_size, generator=gen) * model.hidden_size**-0.5).to(device)
    group = build.quant_config.group_size
    if kind == "gemm_w8a16":
        q, scales = quantize_int8_per_channel(w)
        return lambda: (x, q, scales)
    if kind == "gemm_w4a16":
        packed, scales, zeros = quantize_int4_groupwise(w, group)
        pre_quant_scale = torch.ones(model.hidden_size, device=device)
        return lambda: (x, packed, scales, zeros, group, pre_quant_scale)
    if kind == "gemm_w8a8":
        (x_q, x_scale), (q, scales) = quantize_int8_per_token(x), quantize_int8_per_channel(w)
        return lambda: (x_q, x_scale, q, scales, dtype)
    if kind == "gemm_fp8":
        (x_q, x_scale), (q, scale) = quantize_fp8_per_token(x), quantize_fp8_per_tensor(w)
        return lambda: (x_q, x_scale, q, scale, dtype)
    raise ValueError(f"unknown quantized gemm kind {kind!r}")


def _runnable_here(spec: KernelSpec, device: torch.device) -> bool:
    return not (spec.kind == "gemm_fp8" and spec.name == "scaled_mm") or scaled_mm_supported(device)


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
    candidates = [spec for spec in registered if _runnable_here(spec, device)]
    args = quant_benchmark_inputs(kind, model, build, device, dtype)
    dropped = [spec.name for spec in registered if spec not in candidates]
    if requested in dropped:
        why = f"{kind} plugin {requested!r} needs a GPU of compute capability 8.9 or newer (Ada, Hopper)"
        if not build.allow_fallback:
            raise PluginUnavailableError(f"{why}; choose another, use 'auto', or pass --allow-fallback")
        log.warning("FALLBACK: %s; using the %r reference implementation instead", why, REFERENCE)
        reference = next(spec for spec in candidates if spec.name == REFERENCE)
        choice = PluginChoice(REFERENCE, requested, {REFERENCE: time_kernel(reference.fn, args, device)}, True, why)
    else:
        choice = choose(kind, requested, candidates, device, dtype, args, build.allow_fallback)
    choice.benchmark = f"{algo} q/k/v projection, {benchmark_tokens(kind, build)} tokens"
    log.info("%s: %s (%s)", kind, choice.name, ", ".join(f"{n} {t:.0f} us" for n, t in choice.timings_us.items()))
    return {kind: choice}
