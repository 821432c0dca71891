"""QuantMode bits and the quantization settings BuildConfig accepts or rejects."""

from __future__ import annotations

import pytest

from executor_svc.build_config import BuildConfig, BuildConfigError, QuantConfig
from executor_svc.quantization.quant_mode import QUANT_ALGOS, QuantMode, QuantModeError, quant_mode_of

Q = QuantMode


def test_each_algorithm_maps_to_a_valid_mode():
    expected = {
        "none": Q(0),
        "W8A16": Q.INT8_WEIGHTS | Q.PER_CHANNEL,
        "W4A16_AWQ": Q.INT4_WEIGHTS | Q.PER_GROUP | Q.AWQ,
        "W8A8_SQ_PER_CHANNEL_PER_TOKEN": Q.INT8_WEIGHTS | Q.ACTIVATIONS | Q.PER_CHANNEL | Q.PER_TOKEN | Q.SMOOTHQUANT,
        "FP8": Q.FP8_WEIGHTS | Q.ACTIVATIONS | Q.PER_TOKEN,
    }
    for algo, mode in expected.items():
        assert quant_mode_of(algo) == mode
        mode.validate()
        BuildConfig(quant_config=QuantConfig(algo)).validate()
    assert set(expected) == set(QUANT_ALGOS)
    assert quant_mode_of("FP8", activation_scheme="static") == Q.FP8_WEIGHTS | Q.ACTIVATIONS  # no per-token bit


def test_every_weight_format_combines_with_each_kv_cache_format():
    for algo in QUANT_ALGOS:
        for kv in ("INT8", "FP8"):
            quant = QuantConfig(algo, kv_cache_quant_algo=kv)
            BuildConfig(quant_config=quant).validate()
            assert quant.quant_mode.has_kv_cache_quant and quant.describe().endswith(f"{kv} KV cache")


def test_derived_properties():
    assert quant_mode_of("W8A16").is_weight_only and quant_mode_of("W4A16_AWQ").is_weight_only
    assert not quant_mode_of("FP8").is_weight_only and not quant_mode_of("none").is_weight_only
    assert not quant_mode_of("none").quantizes_weights
    assert quant_mode_of("none", "INT8").has_kv_cache_quant and quant_mode_of("none", "FP8") == Q.FP8_KV_CACHE
    assert quant_mode_of("W4A16_AWQ").describe() == "INT4_WEIGHTS|PER_GROUP|AWQ"


@pytest.mark.parametrize("mode, message", [
    (Q.INT4_WEIGHTS | Q.INT8_WEIGHTS | Q.PER_GROUP, "one weight format"),
    (Q.INT8_KV_CACHE | Q.FP8_KV_CACHE, "one KV-cache format"),
    (Q.ACTIVATIONS, "needs quantized weights"),
    (Q.INT4_WEIGHTS | Q.PER_GROUP | Q.ACTIVATIONS, "W4A8"),
    (Q.FP8_WEIGHTS, "FP8 weight-only"),
    (Q.INT8_WEIGHTS | Q.PER_CHANNEL | Q.PER_TOKEN, "per-token scales apply to quantized activations"),
    (Q.INT8_WEIGHTS | Q.PER_CHANNEL | Q.PER_GROUP, "per-group scales are implemented for INT4"),
    (Q.INT4_WEIGHTS, "INT4 weights need per-group scales"),
    (Q.INT8_WEIGHTS, "INT8 weights need per-channel scales"),
    (Q.INT8_WEIGHTS | Q.PER_CHANNEL | Q.ACTIVATIONS | Q.SMOOTHQUANT, "INT8 activations need per-token scales"),
    (Q.INT8_WEIGHTS | Q.PER_CHANNEL | Q.AWQ, "AWQ applies to INT4 weight-only"),
    (Q.INT4_WEIGHTS | Q.PER_GROUP | Q.SMOOTHQUANT, "SmoothQuant applies to W8A8"),
    (Q.INT8_WEIGHTS | Q.PER_CHANNEL | Q.ACTIVATIONS | Q.PER_TOKEN, "W8A8 without SmoothQuant"),
])
def test_invalid_combinations_are_rejected(mode, message):
    with pytest.raises(QuantModeError, match=message):
        mode.validate()


@pytest.mark.parametrize("quant, message", [
    (QuantConfig("W3A16"), "quant_algo 'W3A16' is not supported"),
    (QuantConfig(kv_cache_quant_algo="fp8"), "kv_cache_quant_algo 'fp8' is not supported"),
    (QuantConfig("W4A8", kv_cache_quant_algo="FP8"), "quant_algo 'W4A8' is not supported"),
    (QuantConfig(kv_cache_quant_algo="INT4"), "kv_cache_quant_algo 'INT4' is not supported"),
    (QuantConfig("W8A16", activation_scheme="static"), "'static' applies to FP8 only; 'W8A16' quantizes no"),
    (QuantConfig("W8A8_SQ_PER_CHANNEL_PER_TOKEN", activation_scheme="static"), "per-token activation scales"),
    (QuantConfig("FP8", activation_scheme="weekly"), "activation_scheme 'weekly'"),
    (QuantConfig("W4A16_AWQ", group_size=100), "group_size must be one of"),
    (QuantConfig("W4A16_AWQ", zero_point="half"), "zero_point 'half' is not one of"),
    (QuantConfig("W8A16", zero_point="float"), "applies to INT4 groups"),
    (QuantConfig("W8A8_SQ_PER_CHANNEL_PER_TOKEN", smoothquant_alpha=1.5), "smoothquant_alpha"),
    (QuantConfig("W4A16_AWQ", calib_size=0), "calib_size must be positive"),
    (QuantConfig("W4A16_AWQ", exclude_modules=[""]), "exclude_modules"),
    (QuantConfig("W8A16", weight_rounding="stochastic"), "weight_rounding 'stochastic' is not one of"),
    (QuantConfig(kv_cache_quant_algo="FP8", weight_rounding="gptq"), "'gptq' rounds quantized weights"),
    (QuantConfig("FP8", weight_rounding="gptq", gptq_damp=0.0), "gptq_damp must be in"),
])
def test_build_config_rejects_bad_quant_settings(quant, message):
    with pytest.raises(BuildConfigError, match=message):
        BuildConfig(quant_config=quant).validate()


def test_quant_config_round_trips_through_the_build_config_dict():
    build = BuildConfig(quant_config=QuantConfig("W4A16_AWQ", group_size=64, zero_point="float", exclude_modules=["lm_head", "layers.0.*"]))
    again = BuildConfig.from_dict(build.to_dict())
    assert again.quant_config == build.quant_config
    assert again.quant_config.quant_mode == Q.INT4_WEIGHTS | Q.PER_GROUP | Q.AWQ


def test_quantized_gemm_kinds_are_accepted_plugin_names():
    BuildConfig(plugin_config={"gemm_w4a16": "torch", "gemm_fp8": "auto"}).validate()
