"""Decoder layers kept in high precision because calibration says so (``--keep-sensitive-layers``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from executor_svc.build_config import BuildConfig, BuildConfigError, QuantConfig
from executor_svc.builder import build_engine
from executor_svc.engine import RuntimeConfig, load_engine
from executor_svc.engine_file import read_manifest
from executor_svc.model.llama import Linear
from executor_svc.quantization.corpus import calibration_texts, encode_texts
from executor_svc.quantization.forward import PromptForward
from executor_svc.quantization.layer_plan import plan_layers
from executor_svc.quantization.linear import Fp8Linear
from executor_svc.quantization.quantize import dequantize_fp8, quantize_fp8_per_tensor, quantize_fp8_per_token_reference
from executor_svc.quantization.sensitivity import layer_sensitivity, rounded
from inflight.cli import main as cli_main
from tests.conftest import TEST_DEVICE

BUILD_FLAGS = [
    "--device", TEST_DEVICE, "--dtype", "float32", "--max-seq-len", "256", "--max-num-tokens", "64",
    "--max-batch-size", "4", "--tokens-per-block", "16", "--plugin", "attention=torch",
]


def test_rounded_swaps_weights_and_inputs_inside_the_block_and_restores_them():
    linear = torch.nn.Linear(8, 4, bias=False)
    original = linear.weight.data.clone()
    seen = []
    linear.register_forward_hook(lambda _m, args, _out: seen.append(args[0].clone()))  # sees the input as used
    x = torch.randn(3, 8)
    with rounded([linear], lambda w: w * 0, lambda t: t + 1):
        assert torch.equal(linear.weight, torch.zeros_like(original))
        assert torch.equal(linear(x), torch.zeros(3, 4))
    assert torch.equal(seen[0], x + 1)
    assert torch.equal(linear.weight.data, original)
    assert torch.allclose(linear(x), x @ original.T)
    assert not linear._forward_pre_hooks
    assert torch.equal(seen[1], x)


@pytest.fixture(scope="module")
def fp8_sensitivity(engine, model_dir):
    """The suite's shared unquantized engine with an FP8 plan, two short calibration texts, and every layer's measure."""
    quant = QuantConfig("FP8")
    model, config = engine.model, engine.model_config
    runner = PromptForward.create(model, config, 64, 16, engine.device, engine.dtype)
    texts, _ = calibration_texts("", 2)
    token_lists = encode_texts(model_dir, texts, 32)
    plan = plan_layers(model, quant, config.num_layers, "float32")
    kl = layer_sensitivity(runner, model, plan, quant, config.num_layers, token_lists, progress=False)
    return model, runner, token_lists, kl


def test_a_layers_sensitivity_is_the_kl_of_the_model_with_only_that_layer_in_fp8(fp8_sensitivity):
    model, runner, token_lists, kl = fp8_sensitivity
    assert len(kl) == 30 and all(v > 0 for v in kl)
    # The oracle: layer 7 rounded by hand (weights replaced, inputs rounded by a wrapper, not a hook),
    # scored with torch's own KL.
    layer = 7
    linears = [m for name, m in model.named_modules() if isinstance(m, Linear) and name.startswith(f"layers.{layer}.")]
    assert len(linears) == 4
    with torch.inference_mode():
        references = [F.log_softmax(model.compute_logits(runner.hidden_states(ids)), -1) for ids in token_lists]
        saved = [m.weight.data for m in linears]
        for m in linears:
            m.weight.data = dequantize_fp8(*quantize_fp8_per_tensor(m.weight.data)).float()

            def forward(x, m=m):
                q, scales = quantize_fp8_per_token_reference(x)
                return m.kernel((q.float() * scales).to(x.dtype), m.weight)

            m.forward = forward
        try:
            total = sum(
                float(F.kl_div(F.log_softmax(model.compute_logits(runner.hidden_states(ids)), -1), ref,
                               log_target=True, reduction="sum"))
                for ids, ref in zip(token_lists, references)
            )
        finally:
            for m, weight in zip(linears, saved):
                m.weight.data = weight
                del m.forward  # the class's own again
    expected = total / sum(map(len, token_lists))
    assert kl[layer] == pytest.approx(expected, rel=1e-4)


def test_cli_keeps_the_most_sensitive_layers_and_inspect_shows_every_layers_measure(model_dir, tmp_path, capsys):
    out = tmp_path / "fp8"
    status = cli_main([
        "--log-level", "WARNING", "build", "--model", str(model_dir), "--output", str(out), *BUILD_FLAGS,
        "--quant-algo", "FP8", "--calib-size", "2", "--calib-max-tokens", "32", "--keep-sensitive-layers", "2",
    ])
    built = capsys.readouterr().out
    assert status == 0, built
    record = read_manifest(out).quantization
    sensitivity = record.sensitivity
    ranked = sorted(range(30), key=lambda i: -sensitivity.kl[i])
    assert sensitivity.kept == ranked[:2] and sensitivity.num_texts == 2 and sensitivity.num_tokens > 40
    kept_names = [f"layers.{i}." for i in sensitivity.kept]
    for layer in record.layers:
        if layer.name.startswith(tuple(kept_names)):
            assert layer.algo == "none" and layer.note.startswith("kept by sensitivity: rank ")
    assert sum(1 for layer in record.layers if layer.algo == "FP8") == 4 * 28
    assert f"by sensitivity layers.{ranked[0]}, layers.{ranked[1]}" in built and "most sensitive" in built

    engine = load_engine(out, RuntimeConfig(device=TEST_DEVICE, kv_cache_bytes=32 << 20))
    for index, layer in enumerate(engine.model.layers):
        assert isinstance(layer.qkv_proj, Linear if index in sensitivity.kept else Fp8Linear)

    assert cli_main(["inspect", str(out), "--layer-info"]) == 0
    info = capsys.readouterr().out
    assert "layer sensitivity (mean KL divergence" in info
    assert "kept in float32 (rank 1)" in info
    assert f"layers.{ranked[0]}.down_proj" in info and "high precision (kept by sensitivity: rank 1 of 30 layers" in info


def test_sensitive_layers_are_checked(model_dir, tmp_path):
    with pytest.raises(BuildConfigError, match="sensitive_layers must be 0 or more"):
        QuantConfig("FP8", sensitive_layers=-1).validate()
    with pytest.raises(BuildConfigError, match="set a weight quant_algo"):
        QuantConfig(kv_cache_quant_algo="FP8", sensitive_layers=1).validate()
    build = BuildConfig(max_batch_size=4, max_num_tokens=64, max_seq_len=256, tokens_per_block=16, dtype="float32",
                        quant_config=QuantConfig("W8A16", sensitive_layers=2))
    with pytest.raises(BuildConfigError, match="keeping sensitive layers needs calibration"):
        build_engine(model_dir, tmp_path / "dummy", build, device=TEST_DEVICE, load_format="dummy", progress=False)
    build.quant_config.sensitive_layers = 31
    with pytest.raises(BuildConfigError, match="sensitive_layers 31 is more than the model's 30 layers"):
        build_engine(model_dir, tmp_path / "many", build, device=TEST_DEVICE, progress=False)
    assert not (tmp_path / "dummy").exists() and not (tmp_path / "many").exists()
