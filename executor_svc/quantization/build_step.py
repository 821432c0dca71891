"""The quantization step of ``inflight build``: plan, calibrate, quantize, validate.

Runs on the loaded unquantized model (in the engine's dtype), in place:

1. plan: which Linear gets what (exclude_modules keeps some in high precision, and
   sensitive_layers the decoder layers that calibration texts show lose most;
   ``sensitivity.py``);
2. with ``--validate``: the unquantized model's perplexity on held-out texts;
3. calibrate (AWQ, SmoothQuant, static FP8, GPTQ, and an FP8 / INT8 KV cache): run
   the model over calibration texts and record each planned layer's input
   statistics, and each decoder layer's largest key and value: the KV-cache scales;
4. swap the planned layers for quantized modules (GPTQ, by default: steps 3 and 4
   one decoder layer at a time, each calibrated on the quantized layers before it;
   ``sequential.py``);
5. with ``--validate``: the quantized model's perplexity on the same texts,
   through a quantized KV cache when there is one, and the gate: an increase
   past ``max_increase`` fails the build.

An engine of random weights (``--load-format dummy``) is quantized at load,
but its KV-cache scales are found here: the weights the engine will load with
(drawn from a fixed seed) are drawn now and calibrated on random token ids.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from torch import nn

from executor_svc.build_config import BuildConfig, BuildConfigError
from executor_svc.model.config import ModelConfig
from executor_svc.model.weights import init_dummy_weights
from executor_svc.quantization.calibration import calibrate
from executor_svc.quantization.corpus import calibration_texts, encode_texts, held_out_texts
from executor_svc.quantization.forward import PromptForward
from executor_svc.quantization.kv_cache import (
    apply_kv_cache_scales, kv_cache_dtype, kv_cache_record, random_token_lists,
)
from executor_svc.quantization.layer_plan import plan_layers
from executor_svc.quantization.perplexity import AccuracyGateError, PerplexityGate, perplexity
from executor_svc.quantization.quant_mode import QuantMode
from executor_svc.quantization.quantizer import quantize_model, quantized_kernels
from executor_svc.quantization.records import CalibrationReport, PerplexityReport, QuantizationRecord
from executor_svc.quantization.sensitivity import SENSITIVITY_TEXTS, keep_sensitive_layers
from executor_svc.quantization.sequential import quantize_sequentially

log = logging.getLogger("inflight.build")

AWQ_SAMPLE_ROWS = 512  # input rows per layer the AWQ search replays


def quantize_for_build(
    model: nn.Module, checkpoint: Path, model_config: ModelConfig, build: BuildConfig, max_seq_len: int,
    plugin_names: dict[str, str], device: torch.device, dtype: torch.dtype, dtype_name: str, real_weights: bool,
    validation: PerplexityGate | None = None, progress: bool = True,
) -> QuantizationRecord | None:
    """Quantize ``model`` in place as ``build.quant_config`` says; the record for engine.json.

    ``plugin_names``: kind -> the implementation chosen for it. Without
    ``real_weights`` (a dummy engine) only the plan and the KV-cache scales are
    made: the weights are quantized at load, after its random weights are
    drawn. None when there is nothing to record (no quantization, no
    validation). Raises AccuracyGateError when the validated perplexity
    increase is too large.
    """
    config = build.quant_config
    mode = config.quant_mode
    if not mode.quantizes_weights and not mode.has_kv_cache_quant and validation is None:
        return None
    record = QuantizationRecord(config.quant_algo, config.kv_cache_quant_algo, int(mode), mode.flag_names())
    record.layers = plan_layers(model, config, model_config.num_layers, dtype_name)
    if not real_weights:
        for layer in record.layers:
            layer.note = layer.note or ("random weights, quantized at load" if layer.algo != "none" else "")
        if mode.has_kv_cache_quant:
            _calibrate_random_kv_cache(model, record, model_config, build, max_seq_len, device, dtype, progress)
        return record
    max_tokens = min(max_seq_len, max(config.calib_max_tokens, validation.max_tokens if validation else 0))
    runner = PromptForward.create(model, model_config, max_tokens, build.tokens_per_block, device, dtype)
    if config.sensitive_layers:  # before anything is planned from the layer records
        if config.sensitive_layers > model_config.num_layers:
            raise BuildConfigError(
                f"sensitive_layers {config.sensitive_layers} is more than the model's {model_config.num_layers} layers"
            )
        texts, _ = calibration_texts(config.calib_data, min(config.calib_size, SENSITIVITY_TEXTS))
        token_lists = encode_texts(checkpoint, texts, min(config.calib_max_tokens, max_seq_len))
        record.sensitivity = keep_sensitive_layers(
            runner, model, record.layers, config, model_config.num_layers, token_lists, dtype_name, progress
        )
    kernels = quantized_kernels(record.layers, plugin_names, device, dtype)
    planned = {layer.name: model.get_submodule(layer.name) for layer in record.layers if layer.algo != "none"}

    held_out, baseline, num_tokens = [], 0.0, 0
    if validation is not None:  # scored before anything is quantized (GPTQ's sequential order quantizes as it goes)
        texts, held_out_corpus = held_out_texts(validation.num_texts)
        held_out = encode_texts(checkpoint, texts, min(validation.max_tokens, max_seq_len))
        baseline, num_tokens = perplexity(runner, held_out, "perplexity (unquantized)", progress)

    stats = None
    calibrate_weights = bool(planned) and config.needs_calibration
    sequential = calibrate_weights and config.weight_rounding == "gptq" and config.gptq_sequential
    if calibrate_weights or mode.has_kv_cache_quant:
        started = time.perf_counter()
        texts, corpus = calibration_texts(config.calib_data, config.calib_size)
        token_lists = encode_texts(checkpoint, texts, min(config.calib_max_tokens, max_seq_len))
        samples = AWQ_SAMPLE_ROWS if QuantMode.AWQ in mode else 0
        hooked = planned if calibrate_weights and not sequential else {}
        if hooked or mode.has_kv_cache_quant:
            stats = calibrate(
                runner, hooked, token_lists, samples, progress, kv_cache=mode.has_kv_cache_quant,
                hessians=config.weight_rounding == "gptq",
            )
            if stats.kv_amax is not None:
                source = f"max |k| after RoPE and |v| over {stats.num_texts} texts of {corpus}"
                record.kv_cache = kv_cache_record(config.kv_cache_quant_algo, stats.kv_amax, source)
        num_calib_tokens = sum(map(len, token_lists))
        widest = max((m.weight.shape[1] for m in planned.values()), default=0) if calibrate_weights else 0
        if config.weight_rounding == "gptq" and num_calib_tokens < 4 * widest:
            # X^T X of fewer rows than channels is singular: GPTQ then fits the calibration rows
            # almost exactly, and its error on them says little about other text.
            log.warning(
                "GPTQ sees %d calibration tokens for layers of up to %d input channels; several times more "
                "tokens generalise better (--calib-size, --calib-max-tokens)", num_calib_tokens, widest,
            )
        if sequential:
            quantize_sequentially(
                runner, model, record.layers, config, model_config.architecture, kernels, token_lists, samples,
                progress,
            )
        seconds = round(time.perf_counter() - started, 2)
        record.calibration = CalibrationReport(corpus, len(token_lists), num_calib_tokens, seconds)
        log.info("calibrated on %d texts, %d tokens of %s", len(token_lists), num_calib_tokens, corpus)

    if not sequential:
        quantize_model(model, record.layers, config, model_config.architecture, kernels, stats)
    del stats  # the AWQ samples and GPTQ Hessians are the largest things calibration keeps
    if validation is None:
        return record
    quantized = baseline
    if planned or record.kv_cache is not None:
        if record.kv_cache is not None:  # score through the engine's own cache: quantized on write, read back
            apply_kv_cache_scales(model, record.kv_cache)
            kv_dtype = kv_cache_dtype(config.kv_cache_quant_algo, dtype)
            runner = PromptForward.create(
                model, model_config, max_tokens, build.tokens_per_block, device, dtype, kv_dtype
            )
        quantized = perplexity(runner, held_out, f"perplexity ({config.describe()})", progress)[0]
    record.perplexity = PerplexityReport(
        held_out_corpus, len(held_out), num_tokens, baseline, quantized, validation.max_increase
    )
    suggest_gptq = mode.quantizes_weights and config.weight_rounding != "gptq"
    _check_gate(record.perplexity, config.describe(), suggest_gptq)
    return record


def _calibrate_random_kv_cache(
    model: nn.Module, record: QuantizationRecord, model_config: ModelConfig, build: BuildConfig, max_seq_len: int,
    device: torch.device, dtype: torch.dtype, progress: bool,
) -> None:
    """KV-cache scales of a dummy engine: its load-time random weights, over random token ids."""
    config = build.quant_config
    started = time.perf_counter()
    init_dummy_weights(model)  # the same seed as load: these are the weights the engine will run
    length = min(config.calib_max_tokens, max_seq_len)
    token_lists = random_token_lists(model_config.vocab_size, config.calib_size, length)
    runner = PromptForward.create(model, model_config, length, build.tokens_per_block, device, dtype)
    stats = calibrate(runner, {}, token_lists, progress=progress, kv_cache=True)
    corpus = "random token ids (random weights)"
    record.calibration = CalibrationReport(
        corpus, stats.num_texts, stats.num_tokens, round(time.perf_counter() - started, 2)
    )
    record.kv_cache = kv_cache_record(
        config.kv_cache_quant_algo, stats.kv_amax, f"max |k| after RoPE and |v| over {stats.num_texts} {corpus}"
    )


def _check_gate(report: PerplexityReport, what: str, suggest_gptq: bool) -> None:
    log.info(
        "perplexity %.3f -> %.3f (%+.3f, limit %+.3f)", report.baseline, report.quantized, report.increase,
        report.max_increase,
    )
    if not report.passed:
        gptq = "round with GPTQ (--weight-rounding gptq), " if suggest_gptq else ""
        raise AccuracyGateError(
            f"{what} raises perplexity from {report.baseline:.3f} to {report.quantized:.3f} "
            f"(+{report.increase:.3f}) on {report.num_texts} held-out texts, more than the allowed "
            f"{report.max_increase}; {gptq}keep the layers calibration finds most sensitive in high precision "
            "(--keep-sensitive-layers N) or name them (--exclude-modules), calibrate on "
            "more or closer text (--calib-data, --calib-size), choose a gentler algorithm, or raise --max-ppl-increase"
        )
