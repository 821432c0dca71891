"""Quantized engines of the default model: build with --validate, reload, generate, inspect.

Calibration and held-out sets are tiny here (a few short texts) to keep the
suite fast on a CPU; bench/quant_accuracy.py measures accuracy for real.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from executor_svc.build_config import BuildConfig, BuildConfigError, QuantConfig
from executor_svc.builder import build_engine
from executor_svc.engine import RuntimeConfig, load_engine
from executor_svc.engine_file import WEIGHTS_NAME, read_manifest
from executor_svc.quantization.corpus import encode_texts, held_out_texts
from executor_svc.quantization.forward import PromptForward
from executor_svc.quantization.linear import Fp8Linear, Int4AWQLinear, Int8WeightOnlyLinear, SmoothQuantLinear
from executor_svc.quantization.perplexity import PerplexityGate, perplexity
from inflight.cli import main as cli_main
from plugins.fp8_rows import wants_fp8_rows
from tests.conftest import TEST_DEVICE

GATE = PerplexityGate(max_increase=50.0, num_texts=2, max_tokens=48)  # generous: W4 on 96 tokens is noisy
SQ = "W8A8_SQ_PER_CHANNEL_PER_TOKEN"
# label -> (QuantConfig fields, module class, stored weight tensor, its dtype)
MODES = {
    "W8A16": ({"quant_algo": "W8A16"}, Int8WeightOnlyLinear, "qweight", torch.int8),
    "W4A16_AWQ": ({"quant_algo": "W4A16_AWQ"}, Int4AWQLinear, "qweight", torch.uint8),
    "W4A16_AWQ_FLOAT_ZEROS_G32": ({"quant_algo": "W4A16_AWQ", "zero_point": "float", "group_size": 32}, Int4AWQLinear,
                                  "qweight", torch.uint8),
    "SQ": ({"quant_algo": SQ}, SmoothQuantLinear, "qweight", torch.int8),
    "FP8": ({"quant_algo": "FP8"}, Fp8Linear, "weight", torch.float8_e4m3fn),
    "FP8_STATIC": ({"quant_algo": "FP8", "activation_scheme": "static"}, Fp8Linear, "weight", torch.float8_e4m3fn),
}


def _build_config(**quant_fields) -> BuildConfig:
    quant = QuantConfig(**{"calib_size": 2, "calib_max_tokens": 48, "awq_grid_size": 4, **quant_fields})
    return BuildConfig(
        max_batch_size=4, max_num_tokens=64, max_seq_len=256, tokens_per_block=16, dtype="float32", quant_config=quant,
        plugin_config={"attention": "torch"},
    )


@pytest.fixture(scope="module")
def engines(model_dir, module_tmp_path) -> dict:
    """Each mode built once, lazily: label -> engine folder."""
    root = module_tmp_path
    built: dict = {}

    def get(label: str):
        if label not in built:
            build_engine(model_dir, root / label, _build_config(**MODES[label][0]), device=TEST_DEVICE, progress=False,
                         validation=GATE)
            built[label] = root / label
        return built[label]

    return get


@pytest.mark.parametrize("label", list(MODES))
def test_each_mode_builds_validates_and_reloads_the_same_model(engines, label):
    fields, module_class, tensor, dtype = MODES[label]
    engine_dir = engines(label)
    record = read_manifest(engine_dir).quantization
    report = record.perplexity
    assert report.passed and report.num_texts == 2 and report.num_tokens > 40
    assert 1.0 < report.baseline < 1000 and report.quantized != report.baseline  # quantization changed the model
    assert record.layer("lm_head").algo == "none" and "excluded by 'lm_head'" in record.layer("lm_head").note
    quantized = [layer for layer in record.layers if layer.algo != "none"]
    assert len(quantized) == 4 * 30 and all(layer.algo == fields["quant_algo"] for layer in quantized)
    with safe_open(str(engine_dir / WEIGHTS_NAME), framework="pt") as weights:
        assert weights.get_tensor(f"layers.0.qkv_proj.{tensor}").dtype == dtype
        assert "layers.0.qkv_proj.weight" not in weights.keys() or tensor == "weight"

    engine = load_engine(engine_dir, RuntimeConfig(device=TEST_DEVICE, kv_cache_bytes=32 << 20))
    assert isinstance(engine.model.layers[0].qkv_proj, module_class)
    if module_class is Int4AWQLinear:  # held [groups, N] in memory, as the GEMVs read them best
        assert engine.model.layers[0].qkv_proj.scales.stride(0) == engine.model.layers[0].qkv_proj.zeros.stride(0) == 1
    # The reloaded engine scores the held-out texts exactly as the build's quantized model did.
    ids = encode_texts(engine_dir, held_out_texts(GATE.num_texts)[0], GATE.max_tokens)
    runner = PromptForward.create(engine.model, engine.model_config, GATE.max_tokens, 16, engine.device, engine.dtype)
    assert perplexity(runner, ids, progress=False)[0] == pytest.approx(report.quantized, rel=1e-4)


def test_fp8_projections_taking_quantized_rows_from_the_kernels_before_them_change_no_score(engines, monkeypatch):
    """The norms and activations of an FP8 engine hand its projections their input quantized
    (plugins/fp8_rows.py); scoring held-out text with that hand-over and without it is identical."""
    from executor_svc.model import llama

    engine = load_engine(engines("FP8"), RuntimeConfig(device=TEST_DEVICE, kv_cache_bytes=32 << 20))
    ids = encode_texts(engines("FP8"), held_out_texts(GATE.num_texts)[0], GATE.max_tokens)
    runner = PromptForward.create(engine.model, engine.model_config, GATE.max_tokens, 16, engine.device, engine.dtype)
    handed_over = []

    def recorded(projection, rows: int) -> bool:
        handed_over.append(wants_fp8_rows(projection, rows))
        return handed_over[-1]

    monkeypatch.setattr(llama, "wants_fp8_rows", recorded)
    with_rows = perplexity(runner, ids, progress=False)[0]
    assert handed_over and all(handed_over)  # every projection of a prompt step took quantized rows
    monkeypatch.setattr(llama, "wants_fp8_rows", lambda projection, rows: False)
    assert perplexity(runner, ids, progress=False)[0] == with_rows


def test_quantized_engine_generates_like_the_float_one(engines, engine, tokenizer):
    from bench.quant_common import agreement, greedy_generate

    prompts = [tokenizer.encode("The capital of France is"), tokenizer.encode("def fibonacci(n):")]
    expected = greedy_generate(engine, prompts, 6)
    quantized = load_engine(engines("W8A16"), RuntimeConfig(device=TEST_DEVICE, kv_cache_bytes=32 << 20))
    outputs = greedy_generate(quantized, prompts, 6)
    assert agreement(expected, outputs)["prefix_match_fraction"] >= 0.5  # INT8 weights keep greedy decoding on track


def test_smoothquant_folds_into_norms_and_awq_records_its_search(engines):
    sq = read_manifest(engines("SQ")).quantization
    assert "folded into layers.3.input_layernorm" in sq.layer("layers.3.qkv_proj").note
    assert not sq.layer("layers.3.qkv_proj").pre_quant_scale and sq.layer("layers.3.down_proj").pre_quant_scale
    awq = read_manifest(engines("W4A16_AWQ")).quantization
    assert awq.calibration.num_texts == 2 and awq.calibration.num_tokens > 40
    gate_up = awq.layer("layers.0.gate_up_proj")
    assert "AWQ alpha" in gate_up.note and "clipped" in gate_up.note and gate_up.group_size == 128


def test_float_zeros_in_groups_of_32_keep_the_checkpoints_own_int4_grid(engines):
    """SmolLM2-135M's weights are a dequantized Q4_1 checkpoint (groups of 32 with a float offset):
    float zeros in groups of 32 put every weight back on its grid point, and the model scores as the
    float one does, where AWQ's whole-code zeros in groups of 128 cannot."""
    record = read_manifest(engines("W4A16_AWQ_FLOAT_ZEROS_G32")).quantization
    layer = record.layer("layers.0.gate_up_proj")
    assert layer.weight == "int4 g32 asymmetric, float zeros" and layer.group_size == 32
    # Nothing to gain from AWQ's scales or clipping: the search keeps the grid as it is.
    assert "AWQ alpha 0.00" in layer.note and "clipped to 1.00" in layer.note, layer.note
    integer = read_manifest(engines("W4A16_AWQ")).quantization.perplexity
    assert abs(record.perplexity.increase) < 0.01 * record.perplexity.baseline < abs(integer.increase)


@pytest.mark.parametrize("algo", ["FP8", "W4A16_AWQ"])
def test_gptq_build_records_the_output_error_it_saved_and_reloads_the_same_model(model_dir, tmp_path, algo):
    # GPTQ on the first decoder layer only: its Python loop over channels is the slow part of a CPU build.
    exclude = ["embed_tokens", "lm_head", "layers.[1-9]*"]
    config = _build_config(quant_algo=algo, weight_rounding="gptq", exclude_modules=exclude)
    build_engine(model_dir, tmp_path / algo, config, device=TEST_DEVICE, progress=False, validation=GATE)
    record = read_manifest(tmp_path / algo).quantization
    quantized = [layer for layer in record.layers if layer.algo != "none"]
    assert [layer.name for layer in quantized] == [f"layers.0.{p}" for p in ("qkv_proj", "o_proj", "gate_up_proj",
                                                                               "down_proj")]
    ratios = [float(layer.note.split("GPTQ: output error ")[1].split("x")[0]) for layer in quantized]
    assert all(ratio < 1.0 for ratio in ratios), [layer.note for layer in quantized]
    if algo == "W4A16_AWQ":  # GPTQ rounds on AWQ's scaled and clipped grid
        assert "AWQ alpha" in record.layer("layers.0.gate_up_proj").note
    engine = load_engine(tmp_path / algo, RuntimeConfig(device=TEST_DEVICE, kv_cache_bytes=32 << 20))
    ids = encode_texts(tmp_path / algo, held_out_texts(GATE.num_texts)[0], GATE.max_tokens)
    runner = PromptForward.create(engine.model, engine.model_config, GATE.max_tokens, 16, engine.device, engine.dtype)
    assert perplexity(runner, ids, progress=False)[0] == pytest.approx(record.perplexity.quantized, rel=1e-4)


def test_sequential_gptq_calibrates_each_layer_on_the_quantized_layers_before_it(model_dir, tmp_path, monkeypatch):
    from executor_svc.quantization import sequential

    exclude = ["embed_tokens", "lm_head", "layers.[2-9]*", "layers.1[0-9]*"]  # decoder layers 0 and 1
    passes = []
    real_calibrate = sequential.calibrate

    def spy(runner, modules, *args, stop_after=None, **kwargs):
        first = runner.model.get_submodule("layers.0.qkv_proj")
        passes.append((sorted(modules), stop_after is runner.model.get_submodule(sorted(modules)[0].rsplit(".", 1)[0]),
                       isinstance(first, Fp8Linear)))
        return real_calibrate(runner, modules, *args, stop_after=stop_after, **kwargs)

    monkeypatch.setattr(sequential, "calibrate", spy)
    weights = {}
    for label, one_pass in (("sequential", False), ("one_pass", True)):
        config = _build_config(quant_algo="FP8", weight_rounding="gptq", exclude_modules=exclude,
                               gptq_sequential=not one_pass)
        build_engine(model_dir, tmp_path / label, config, device=TEST_DEVICE, progress=False)
        with safe_open(str(tmp_path / label / WEIGHTS_NAME), "pt") as f:
            weights[label] = {name: f.get_tensor(f"layers.{name}.weight").float()
                              for name in ("0.qkv_proj", "1.qkv_proj", "1.down_proj")}
    # one pass per decoder layer, each stopped after its layer; layer 1's after layer 0 was quantized
    names = [f"layers.{i}.{p}" for i in (0, 1) for p in ("down_proj", "gate_up_proj", "o_proj", "qkv_proj")]
    assert passes == [(names[:4], True, False), (names[4:], True, True)]
    # layer 0 sees the same (unquantized) inputs either way; layer 1 sees layer 0's rounding only in order
    assert torch.equal(weights["sequential"]["0.qkv_proj"], weights["one_pass"]["0.qkv_proj"])
    for name in ("1.qkv_proj", "1.down_proj"):
        assert not torch.equal(weights["sequential"][name], weights["one_pass"][name])


def test_gptq_on_random_weights_is_rejected(model_dir, tmp_path):
    config = _build_config(quant_algo="FP8", weight_rounding="gptq")
    with pytest.raises(BuildConfigError, match="GPTQ rounding needs calibration"):
        build_engine(model_dir, tmp_path / "dummy", config, device=TEST_DEVICE, load_format="dummy", progress=False)
    assert not (tmp_path / "dummy").exists()


def test_cli_build_validate_then_inspect_shows_each_layer(model_dir, tmp_path, capsys):
    out = tmp_path / "w8"
    status = cli_main([
        "--log-level", "WARNING", "build", "--model", str(model_dir), "--output", str(out), "--device", TEST_DEVICE,
        "--dtype", "float32", "--max-seq-len", "256", "--max-num-tokens", "64", "--max-batch-size", "4",
        "--tokens-per-block", "16", "--plugin", "attention=torch", "--quant-algo", "W8A16",
        "--exclude-modules", "embed_tokens,lm_head,last_layer", "--validate", "--validate-size", "1",
        "--validate-max-tokens", "48", "--max-ppl-increase", "5",
    ])
    built = capsys.readouterr().out
    assert status == 0 and "perplexity" in built and "passed" in built and "116 of 121 Linear layers quantized" in built
    assert cli_main(["inspect", str(out), "--layer-info"]) == 0
    info = capsys.readouterr().out
    assert "layers.0.qkv_proj" in info and "[Plugin] gemm_w8a16 (torch, W8A16, weights int8 per-channel" in info
    assert "layers.29.down_proj" in info and "high precision (excluded by 'layers.29')" in info
    assert "[Plugin] gemm (torch, float32, 49152x576, high precision (excluded by 'lm_head'))" in info
    assert "gemm_w8a16  requested auto" in info


def test_cli_gate_fails_the_build_and_writes_nothing(model_dir, tmp_path, capsys):
    out = tmp_path / "w4"
    status = cli_main([
        "--log-level", "WARNING", "build", "--model", str(model_dir), "--output", str(out), "--device", TEST_DEVICE,
        "--dtype", "float32", "--max-seq-len", "256", "--max-num-tokens", "64", "--max-batch-size", "4",
        "--tokens-per-block", "16", "--plugin", "attention=torch", "--quant-algo", "W4A16_AWQ", "--calib-size", "1",
        "--awq-grid-size", "2",
        "--calib-max-tokens", "32", "--validate", "--validate-size", "1", "--validate-max-tokens", "48",
        "--max-ppl-increase", "0.0",
    ])
    err = capsys.readouterr().err
    assert status == 1 and "accuracy gate failed" in err and "W4A16_AWQ raises perplexity" in err
    assert "round with GPTQ (--weight-rounding gptq)" in err  # what to try first, since this build rounded to nearest
    assert "(--keep-sensitive-layers N)" in err
    assert not out.exists()


def test_cli_rejects_an_unknown_kv_cache_format(model_dir, tmp_path, capsys):
    out = tmp_path / "kv"
    status = cli_main(["build", "--model", str(model_dir), "--output", str(out), "--kv-cache-quant-algo", "FP4"])
    err = capsys.readouterr().err
    assert status == 2 and "kv_cache_quant_algo 'FP4' is not supported; choose one of ['none', 'INT8', 'FP8']" in err
    assert not out.exists()


def test_dummy_engine_is_quantized_at_load(model_dir, tmp_path):
    manifest = build_engine(model_dir, tmp_path / "dummy", _build_config(quant_algo="W4A16_AWQ"), device=TEST_DEVICE,
                            load_format="dummy", progress=False)
    assert manifest.quantization.layer("layers.0.o_proj").note == "random weights, quantized at load"
    engine = load_engine(tmp_path / "dummy", RuntimeConfig(device=TEST_DEVICE, kv_cache_bytes=32 << 20))
    layer = engine.model.layers[0].o_proj
    assert isinstance(layer, Int4AWQLinear)
    assert torch.equal(layer.pre_quant_scale, torch.ones_like(layer.pre_quant_scale))
    assert layer.qweight.unique().numel() > 8  # random weights were quantized, not left empty


def test_speed_benchmark_smoke(tmp_path):
    import json

    from bench.quant_speed import main as speed_main

    out = tmp_path / "speed.json"
    assert speed_main([
        "--shape", "tiny", "--device", TEST_DEVICE, "--modes", "bf16,W4A16_AWQ", "--prompt-len", "8",
        "--decode-tokens", "3", "--warmup-tokens", "1", "--max-seq-len", "128", "--kv-cache-gb", "0.02",
        "--work-dir", str(tmp_path / "work"), "--output", str(out),
    ]) == 0
    result = json.loads(out.read_text())
    assert result["command"] and result["device"]["device"] == TEST_DEVICE and result["shape"] == "tiny"
    awq = result["modes"]["W4A16_AWQ"]
    assert awq["decode_ms_per_token"]["p50"] > 0 and "gemm_w4a16" in awq["gemm_kernels"]
    assert awq["model_bytes_gib"] < result["modes"]["bf16"]["model_bytes_gib"]  # INT4 weights are smaller
