"""``inflight build`` and ``inflight inspect``."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

from executor_svc.build_config import PLUGIN_KINDS, QUANT_PLUGIN_KINDS, ZERO_POINTS, BuildConfig, QuantConfig
from executor_svc.engine_file import EngineManifest, EngineMismatchError, is_engine_dir, read_manifest
from executor_svc.quantization.records import KVCacheQuant, LayerSensitivity

QUANT_DEFAULTS = QuantConfig()


def add_quant_build_flags(p: argparse.ArgumentParser) -> None:
    """Quantization settings beyond --quant-algo, and the perplexity gate (``inflight build`` only)."""
    from executor_svc.quantization.perplexity import PerplexityGate

    gate = PerplexityGate()
    g = p.add_argument_group(
        "quantization (--quant-algo W8A16 | W4A16_AWQ | W8A8_SQ_PER_CHANNEL_PER_TOKEN | FP8, "
        "--kv-cache-quant-algo FP8 | INT8)"
    )
    g.add_argument(
        "--calib-data", default="", metavar="FILE", help="calibration texts, one per line (default: stdlib docstrings)"
    )
    g.add_argument("--calib-size", type=int, default=QUANT_DEFAULTS.calib_size, help="calibration texts")
    g.add_argument("--calib-max-tokens", type=int, default=QUANT_DEFAULTS.calib_max_tokens, help="tokens per text")
    g.add_argument("--group-size", type=int, default=QUANT_DEFAULTS.group_size, help="input channels per INT4 scale")
    g.add_argument(
        "--zero-point", default=QUANT_DEFAULTS.zero_point, choices=ZERO_POINTS,
        help="INT4 zero points: whole codes (AWQ's format) or floats (each group's grid spans its own min..max, "
        "as llama.cpp's Q4_1 stores it)",
    )
    g.add_argument("--awq-grid-size", type=int, default=QUANT_DEFAULTS.awq_grid_size, help="AWQ: alpha values tried")
    g.add_argument("--smoothquant-alpha", type=float, default=QUANT_DEFAULTS.smoothquant_alpha, help="SQ strength")
    g.add_argument(
        "--weight-rounding", default=QUANT_DEFAULTS.weight_rounding, choices=["nearest", "gptq"],
        help="how weights take their grid points: nearest, or GPTQ (error-compensating, calibrated; slower build)",
    )
    g.add_argument("--gptq-damp", type=float, default=QUANT_DEFAULTS.gptq_damp, help="GPTQ: Hessian damping")
    g.add_argument(
        "--gptq-one-pass", action="store_true",
        help="GPTQ: calibrate every layer on the unquantized model in one pass, instead of layer after quantized "
        "layer (faster build, all layers' Hessians held at once)",
    )
    g.add_argument(
        "--activation-scheme", default=QUANT_DEFAULTS.activation_scheme, choices=["dynamic", "static"],
        help="FP8 activation scales: per token at run time, or one per tensor from calibration",
    )
    g.add_argument(
        "--exclude-modules", default=",".join(QUANT_DEFAULTS.exclude_modules), metavar="PATTERNS",
        help="comma-separated Linear names kept in high precision (fnmatch: 'layers.0.*', '*.down_proj'; "
        "'first_layer', 'last_layer')",
    )
    g.add_argument(
        "--keep-sensitive-layers", type=int, default=QUANT_DEFAULTS.sensitive_layers, metavar="N",
        help="keep the N decoder layers whose quantization moves the model's next-token distributions most on "
        "calibration texts in high precision (one forward pass per layer at build; inspect --layer-info shows each "
        "layer's measure)",
    )
    g.add_argument("--validate", action="store_true", help="perplexity before/after quantization, on held-out text")
    g.add_argument("--max-ppl-increase", type=float, default=gate.max_increase, help="fail the build past this rise")
    g.add_argument("--validate-size", type=int, default=gate.num_texts, help="held-out texts scored by --validate")
    g.add_argument("--validate-max-tokens", type=int, default=gate.max_tokens, help="tokens kept per held-out text")


def quant_build_from_args(args: argparse.Namespace, build: BuildConfig) -> BuildConfig:
    """``build`` with the quantization flags of ``inflight build`` filled in."""
    quant = dataclasses.replace(
        build.quant_config, calib_data=args.calib_data, calib_size=args.calib_size,
        calib_max_tokens=args.calib_max_tokens, group_size=args.group_size, zero_point=args.zero_point,
        awq_grid_size=args.awq_grid_size,
        smoothquant_alpha=args.smoothquant_alpha, activation_scheme=args.activation_scheme,
        weight_rounding=args.weight_rounding, gptq_damp=args.gptq_damp, gptq_sequential=not args.gptq_one_pass,
        exclude_modules=[p.strip() for p in args.exclude_modules.split(",") if p.strip()],
        sensitive_layers=args.keep_sensitive_layers,
    )
    return dataclasses.replace(build, quant_config=quant)


def run_build(args: argparse.Namespace) -> int:
    """Exit status 0 built, 2 bad settings, 1 the perplexity gate failed (nothing written)."""
    from executor_svc.build_config import BuildConfigError
    from executor_svc.builder import build_engine
    from executor_svc.kernel_selection import PluginUnavailableError
    from executor_svc.quantization.perplexity import AccuracyGateError, PerplexityGate
    from inflight.engines import build_config_from_args
    from inflight.model_store import resolve_model

    if is_engine_dir(Path(args.model)):
        print(f"inflight build: {args.model} is already an engine; give the checkpoint it was built from", file=sys.stderr)
        return 2
    gate = None
    if args.validate:
        gate = PerplexityGate(args.max_ppl_increase, args.validate_size, args.validate_max_tokens)
    try:
        build = quant_build_from_args(args, build_config_from_args(args))
        checkpoint = resolve_model(args.model)
        manifest = build_engine(checkpoint, Path(args.output), build, args.device, args.load_format, validation=gate)
    except (BuildConfigError, PluginUnavailableError) as exc:
        print(f"inflight build: {exc}", file=sys.stderr)
        return 2
    except AccuracyGateError as exc:
        print(f"inflight build: accuracy gate failed, no engine written: {exc}", file=sys.stderr)
        return 1
    print(format_summary(manifest, Path(args.output)))
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    if args.engine_dir is None and not args.plugins:
        print("inflight inspect: give an engine folder, or --plugins", file=sys.stderr)
        return 2
    if args.plugins:
        print(format_plugins())
    if args.engine_dir is not None:
        try:
            manifest = read_manifest(Path(args.engine_dir))
        except (FileNotFoundError, EngineMismatchError) as exc:
            print(f"inflight inspect: {exc}", file=sys.stderr)
            return 2
        print(format_summary(manifest, Path(args.engine_dir)))
        if args.layer_info:
            print(format_layer_info(manifest))
    return 0


def format_summary(manifest: EngineManifest, engine_dir: Path) -> str:
    b = manifest.build_config
    lines = [
        f"engine      {engine_dir}",
        f"model       {manifest.model.name} ({manifest.model.architecture}, {manifest.model.num_layers} layers, "
        f"hidden {manifest.model.hidden_size}, {manifest.model.num_heads}/{manifest.model.num_kv_heads} heads)",
        f"built for   {manifest.device.describe()}, {manifest.dtype}, in {manifest.build_seconds:.1f} s",
        f"limits      max_batch_size={b.max_batch_size} max_num_tokens={b.max_num_tokens} "
        f"max_seq_len={manifest.max_seq_len} tokens_per_block={b.tokens_per_block}",
        _quant_line(manifest),
        f"weights     {'random (dummy)' if manifest.load_format == 'dummy' else 'from ' + manifest.source}",
        "kernels     " + ", ".join(f"{k}={c.name}{' (FALLBACK)' if c.fallback else ''}" for k, c in manifest.plugins.items()),
    ]
    record = manifest.quantization
    if record is not None and record.kv_cache is not None:
        lines.append(_kv_cache_line(record.kv_cache))
    if record is not None and record.calibration is not None:
        c = record.calibration
        lines.append(f"calibration {c.num_texts} texts, {c.num_tokens} tokens of {c.corpus}, {c.seconds:.1f} s")
    if record is not None and record.sensitivity is not None:
        lines.append(_sensitivity_line(record.sensitivity))
    if record is not None and record.perplexity is not None:
        p = record.perplexity
        verdict = "passed" if p.passed else "FAILED"
        what = manifest.build_config.quant_config.describe()
        lines.append(
            f"perplexity  {p.baseline:.3f} unquantized -> {p.quantized:.3f} {what} "
            f"({p.increase:+.3f}, limit +{p.max_increase}, {verdict}) on {p.num_texts} texts, {p.num_tokens} tokens of "
            f"{p.corpus}"
        )
    return "\n".join(lines)


def _kv_cache_line(kv: KVCacheQuant) -> str:
    """The 1-byte KV cache: format, the range of the per-layer scales, where they came from."""
    def span(scales: list[float]) -> str:
        return f"{min(scales):.3g}..{max(scales):.3g}"

    return (
        f"kv cache    {kv.algo} ({kv.dtype}), per-layer scales k {span(kv.k_scales)}, v {span(kv.v_scales)} "
        f"({kv.num_layers} layers; {kv.source})"
    )


def _quant_line(manifest: EngineManifest) -> str:
    q = manifest.build_config.quant_config
    record = manifest.quantization
    if record is None or q.quant_algo == "none":
        return f"quant       {q.quant_algo} (kv cache: {q.kv_cache_quant_algo})"
    quantized = sum(1 for layer in record.layers if layer.algo != "none")
    kept = list(q.exclude_modules)
    if record.sensitivity is not None and record.sensitivity.kept:
        kept.append("by sensitivity " + ", ".join(f"layers.{i}" for i in record.sensitivity.kept))
    return (
        f"quant       {q.quant_algo} [{'|'.join(record.quant_mode_flags)}]: {quantized} of {len(record.layers)} Linear "
        f"layers quantized ({q.weight_rounding} rounding), kept in {manifest.dtype}: "
        f"{', '.join(kept) or 'none'} (kv cache: {q.kv_cache_quant_algo})"
    )


def _sensitivity_line(s: LayerSensitivity) -> str:
    """The measured layer sensitivities: the most sensitive layers and the spread."""
    ranked = sorted(range(len(s.kl)), key=lambda i: -s.kl[i])
    top = ", ".join(f"{i}: {s.kl[i]:.2e}" for i in ranked[:5])
    return (
        f"sensitivity KL per token with one layer quantized, over {s.num_texts} texts, {s.num_tokens} tokens: "
        f"most sensitive {top}; median {sorted(s.kl)[len(s.kl) // 2]:.2e}"
    )


def _layer_rows(manifest: EngineManifest) -> list[tuple[str, str, str]]:
    """(layer name, kind, note) for every layer of the engine's model.

    The model is instantiated on the meta device (no memory, no weights) and
    walked, so every architecture reports its own structure.
    """
    from torch import nn

    from executor_svc.model.llama import Linear, RMSNorm
    from executor_svc.model.registry import architecture_for
    from plugins.kernels import Kernels

    kernels = Kernels.reference(torch.device("cpu"), torch.float32)  # handles only; nothing runs
    with torch.device("meta"):
        model = architecture_for(manifest.model).model_class(manifest.model, max_positions=8, kernels=kernels)
    rows: list[tuple[str, str, str]] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding):
            rows.append((name, "", ""))
        elif isinstance(module, RMSNorm):
            rows.append((name, "rmsnorm", "1 + weight" if module.weight_offset else ""))
        elif isinstance(module, Linear):
            rows.append((name, "gemm", "x".join(map(str, module.weight.shape))))
        elif hasattr(module, "qkv_proj"):  # a decoder layer: its function-valued kinds
            window = getattr(module, "sliding_window", 0)
            rows.append((f"{name}.rope", "rope", ""))
            rows.append((f"{name}.attention", "attention", f"sliding window {window}" if window else ""))
            rows.append((f"{name}.act_and_mul", "activation", ""))
    return rows


def format_layer_info(manifest: EngineManifest) -> str:
    lines = ["", "layers"]
    kv_cache = manifest.quantization.kv_cache if manifest.quantization is not None else None
    for layer, kind, note in _layer_rows(manifest):
        if not kind:
            lines.append(f"  {layer:<40} [Embedding] torch ({manifest.dtype})")
            continue
        quant = manifest.quantization.layer(layer) if manifest.quantization is not None else None
        if quant is not None:
            kind, note = _quant_layer_row(quant, manifest.dtype, note)
        if kind in ("attention", "rope") and kv_cache is not None:
            note = ", ".join(filter(None, [note, _kv_cache_note(kv_cache, layer)]))
        choice = manifest.plugins[kind]
        fallback = f", FALLBACK from {choice.requested}" if choice.fallback else ""
        if quant is not None and quant.algo != "none":
            lines.append(f"  {layer:<40} [Plugin] {kind} ({choice.name}, {note}{fallback})")
            continue
        extra = f", {note}" if note else ""
        lines.append(f"  {layer:<40} [Plugin] {kind} ({choice.name}, {manifest.dtype}{extra}{fallback})")
    sensitivity = manifest.quantization.sensitivity if manifest.quantization is not None else None
    if sensitivity is not None:
        lines += ["", f"layer sensitivity ({sensitivity.metric}; {sensitivity.num_texts} texts, "
                      f"{sensitivity.num_tokens} tokens)"]
        for index, kl in enumerate(sensitivity.kl):
            kept = f"  kept in {manifest.dtype} (rank {sensitivity.kept.index(index) + 1})" if index in sensitivity.kept else ""
            lines.append(f"  layers.{index:<33} {kl:.3e}{kept}")
    lines += ["", f"kernel selection on {manifest.device.describe()} (median of 7 timed calls)"]
    for kind, choice in manifest.plugins.items():
        timings = ", ".join(f"{name} {us:.1f} us" for name, us in sorted(choice.timings_us.items(), key=lambda kv: kv[1]))
        lines.append(f"  {kind:<11} requested {choice.requested:<6} chose {choice.name:<8} [{timings}] on {choice.benchmark}")
        if choice.fallback:
            lines.append(f"  {'':<11} FALLBACK: {choice.note}")
    return "\n".join(lines)


def _kv_cache_note(kv: KVCacheQuant, row_name: str) -> str:
    """'kv cache float8_e4m3fn k_scale .. v_scale ..' for the rope / attention row of decoder layer N."""
    index = int(row_name.split(".")[1])  # "layers.N.attention"
    return f"kv cache {kv.dtype} k_scale {kv.k_scales[index]:.4g} v_scale {kv.v_scales[index]:.4g}"


def _quant_layer_row(quant, dtype: str, shape: str) -> tuple[str, str]:
    """(plugin kind, description) of one Linear of a quantized engine."""
    if quant.algo == "none":
        return "gemm", f"{shape}, high precision" + (f" ({quant.note})" if quant.note else "")
    parts = [quant.algo, f"weights {quant.weight}", f"activations {quant.activation}", shape]
    if quant.pre_quant_scale:
        parts.append("per-channel input scale")
    if quant.note:
        parts.append(quant.note)
    return quant.kind, ", ".join(parts)


def format_plugins() -> str:
    from plugins import list_kernels

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    lines = [f"registered plugins (this machine: {device.type})"]
    for kind in PLUGIN_KINDS + QUANT_PLUGIN_KINDS:
        for spec in (s for s in list_kernels() if s.kind == kind):
            runnable = [str(d).removeprefix("torch.") for d in sorted(spec.dtypes, key=str) if spec.supports(device, d)]
            status = f"runs here ({', '.join(runnable)})" if runnable else f"not here (needs {', '.join(sorted(spec.device_types))})"
            lines.append(f"  {kind:<11} {spec.name:<10} {status:<40} {spec.description}")
    return "\n".join(lines)
