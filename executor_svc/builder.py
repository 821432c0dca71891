"""``inflight build``: turn a checkpoint into an engine folder for one device.

The chain TensorRT-LLM users know: read the model definition, prepare the
graph (fused q/k/v and gate/up projections, tied embeddings resolved, weights
cast to the engine's dtype), choose an implementation per layer kind by
timing the candidates on the target device, quantize (calibrating first when
the algorithm needs it, and checking perplexity with ``--validate``), then
serialize everything the runtime needs. Engines built from a checkpoint on the
fly are cached (``executor_svc.engine_cache``), so ``inflight serve`` builds once.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_model
from tqdm import tqdm

from executor_svc.build_config import BuildConfig, BuildConfigError
from executor_svc.engine_file import (
    WEIGHTS_NAME, DeviceSignature, EngineManifest, copy_tokenizer_files, is_engine_dir, library_versions, write_manifest,
)
from executor_svc.kernel_selection import apply_tactics, select_plugins
from executor_svc.model.config import ModelConfig
from executor_svc.engine import DTYPES, resolve_device
from executor_svc.model.registry import architecture_for, build_model
from executor_svc.quantization.build_step import quantize_for_build
from executor_svc.quantization.kernel_choice import select_quant_plugins
from executor_svc.quantization.perplexity import PerplexityGate

log = logging.getLogger("inflight.build")


def resolve_dtype(name: str, device: torch.device) -> str:
    if name == "auto":
        return "bfloat16" if device.type == "cuda" else "float32"
    return name


def build_engine(
    checkpoint: Path, output_dir: Path, build: BuildConfig, device: str = "auto", load_format: str = "auto",
    progress: bool = True, validation: PerplexityGate | None = None,
) -> EngineManifest:
    """Build ``checkpoint`` (a Hugging Face folder) into ``output_dir`` for ``device``.

    ``validation``: score perplexity before and after quantization on held-out
    text and raise AccuracyGateError (writing nothing) when it rises too much.
    """
    started = time.perf_counter()
    build.validate()
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    _check_quantization_request(build, load_format, validation)
    target = resolve_device(device)
    dtype_name = resolve_dtype(build.dtype, target)
    dtype = DTYPES[dtype_name]
    model_config = ModelConfig.from_folder(checkpoint)
    max_seq_len = build.max_seq_len or model_config.max_position_embeddings
    if output_dir.exists() and any(output_dir.iterdir()) and not is_engine_dir(output_dir):
        raise FileExistsError(f"{output_dir} exists and is not an engine folder; refusing to overwrite it")

    steps = ["choose kernels", "load weights", "quantize", "write engine"]
    with tqdm(total=len(steps), desc="inflight build", unit="step", disable=not progress) as bar:
        bar.set_postfix_str(steps[0])
        plugins = select_plugins(model_config, build, target, dtype)
        plugins.update(select_quant_plugins(model_config, build, target, dtype))
        apply_tactics(plugins)
        bar.update()
        bar.set_postfix_str(steps[1])
        model = build_model(model_config, max_seq_len, {k: c.name for k, c in plugins.items()}, target, dtype)
        if load_format == "auto":
            architecture_for(model_config).load_checkpoint(model, checkpoint)
        bar.update()
        bar.set_postfix_str(steps[2])
        quantization = quantize_for_build(
            model, checkpoint, model_config, build, max_seq_len, {k: c.name for k, c in plugins.items()}, target,
            dtype, dtype_name, real_weights=load_format == "auto", validation=validation, progress=progress,
        )
        bar.update()
        bar.set_postfix_str(steps[3])
        manifest = EngineManifest(
            model=model_config, build_config=build, device=DeviceSignature.of(target), plugins=plugins,
            dtype=dtype_name, max_seq_len=max_seq_len, load_format=load_format, source=str(checkpoint),
            versions=library_versions(), quantization=quantization,
        )
        output_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.", dir=output_dir.parent))
        try:
            if load_format == "auto":  # dummy engines re-draw their random weights at load
                save_model(model, str(staging / WEIGHTS_NAME))
            copy_tokenizer_files(checkpoint, staging)
            manifest.build_seconds = round(time.perf_counter() - started, 2)
            write_manifest(staging, manifest)
            if output_dir.exists():
                shutil.rmtree(output_dir)
            staging.rename(output_dir)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        bar.update()
    log.info("built %s for %s in %.1f s -> %s", model_config.name, manifest.device.describe(), manifest.build_seconds, output_dir)
    return manifest


def _check_quantization_request(build: BuildConfig, load_format: str, validation: PerplexityGate | None) -> None:
    """What BuildConfig.validate cannot see: the weights' format and the --validate settings."""
    if validation is not None and (validation.num_texts <= 0 or validation.max_tokens < 2):
        raise BuildConfigError(
            f"--validate needs at least one held-out text of 2+ tokens, got {validation.num_texts} texts "
            f"of {validation.max_tokens} tokens"
        )
    if load_format == "dummy" and validation is not None:
        raise BuildConfigError("--validate measures perplexity, which random weights (--load-format dummy) lack")
    if load_format == "dummy" and build.quant_config.activation_scheme == "static":
        raise BuildConfigError("static FP8 activation scales need calibration, which random weights cannot give")
    if load_format == "dummy" and build.quant_config.weight_rounding == "gptq":
        raise BuildConfigError("GPTQ rounding needs calibration, which random weights cannot give")
    if load_format == "dummy" and build.quant_config.sensitive_layers:
        raise BuildConfigError("keeping sensitive layers needs calibration, which random weights cannot give")
