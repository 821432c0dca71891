"""``inflight build`` and ``inflight inspect``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from executor_svc.build_config import PLUGIN_KINDS
from executor_svc.engine_file import EngineManifest, EngineMismatchError, is_engine_dir, read_manifest


def run_build(args: argparse.Namespace) -> int:
    from executor_svc.build_config import BuildConfigError
    from executor_svc.builder import build_engine
    from executor_svc.kernel_selection import PluginUnavailableError
    from inflight.engines import build_config_from_args
    from inflight.model_store import resolve_model

    if is_engine_dir(Path(args.model)):
        print(f"inflight build: {args.model} is already an engine; give the checkpoint it was built from", file=sys.stderr)
        return 2
    try:
        manifest = build_engine(
            resolve_model(args.model), Path(args.output), build_config_from_args(args), args.device, args.load_format
        )
    except (BuildConfigError, PluginUnavailableError) as exc:
        print(f"inflight build: {exc}", file=sys.stderr)
        return 2
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
        f"quant       {b.quant_config.quant_algo} (kv cache: {b.quant_config.kv_cache_quant_algo})",
        f"weights     {'random (dummy)' if manifest.load_format == 'dummy' else 'from ' + manifest.source}",
        "kernels     " + ", ".join(f"{k}={c.name}{' (FALLBACK)' if c.fallback else ''}" for k, c in manifest.plugins.items()),
    ]
    return "\n".join(lines)


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
    for layer, kind, note in _layer_rows(manifest):
        if not kind:
            lines.append(f"  {layer:<40} [Embedding] torch ({manifest.dtype})")
            continue
        choice = manifest.plugins[kind]
        fallback = f", FALLBACK from {choice.requested}" if choice.fallback else ""
        extra = f", {note}" if note else ""
        lines.append(f"  {layer:<40} [Plugin] {kind} ({choice.name}, {manifest.dtype}{extra}{fallback})")
    lines += ["", f"kernel selection on {manifest.device.describe()} (median of 7 timed calls)"]
    for kind, choice in manifest.plugins.items():
        timings = ", ".join(f"{name} {us:.1f} us" for name, us in sorted(choice.timings_us.items(), key=lambda kv: kv[1]))
        lines.append(f"  {kind:<11} requested {choice.requested:<6} chose {choice.name:<8} [{timings}] on {choice.benchmark}")
        if choice.fallback:
            lines.append(f"  {'':<11} FALLBACK: {choice.note}")
    return "\n".join(lines)


def format_plugins() -> str:
    from plugins import list_kernels

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    lines = [f"registered plugins (this machine: {device.type})"]
    for kind in PLUGIN_KINDS:
        for spec in (s for s in list_kernels() if s.kind == kind):
            runnable = [str(d).removeprefix("torch.") for d in sorted(spec.dtypes, key=str) if spec.supports(device, d)]
            status = f"runs here ({', '.join(runnable)})" if runnable else f"not here (needs {', '.join(sorted(spec.device_types))})"
            lines.append(f"  {kind:<11} {spec.name:<10} {status:<40} {spec.description}")
    return "\n".join(lines)
