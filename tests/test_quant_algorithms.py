"""The algorithms behind the modes: SmoothQuant folding, the AWQ search, which layers get quantized."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from executor_svc.build_config import QuantConfig
from executor_svc.model.config import ModelConfig
from executor_svc.model.llama import LlamaForCausalLM, RMSNorm
from executor_svc.quantization.awq import search_awq_scale
from executor_svc.quantization.layer_plan import plan_layers
from executor_svc.quantization.quantize import fake_quantize_int4
from executor_svc.quantization.smoothquant import fold_into_norm, norm_in_front, smoothing_factors
from plugins.kernels import Kernels

CPU = torch.device("cpu")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_smoothquant_folding_keeps_the_float_function_and_flattens_activations():
    kernels = Kernels.reference(CPU, torch.float32)
    x = torch.randn(16, 64, generator=_gen(0))
    for offset in (0.0, 1.0):  # Llama norms scale by weight, Gemma's by 1 + weight
        norm = RMSNorm(64, 1e-6, kernels, weight_offset=offset)
        with torch.no_grad():
            norm.weight.copy_(torch.rand(64, generator=_gen(1)) + 0.5 - offset)
            norm.weight[5] *= 30  # an outlier channel, as LLM activations have
        w = torch.randn(32, 64, generator=_gen(2)) * 0.1
        h = norm(x)[0]
        expected = F.linear(h, w)
        s = smoothing_factors(h.abs().amax(dim=0), w, alpha=0.5)
        fold_into_norm(norm, s)
        h_smooth = norm(x)[0]
        torch.testing.assert_close(F.linear(h_smooth, w * s[None, :]), expected, rtol=1e-4, atol=1e-4)
        ratio = lambda t: (t.abs().amax(dim=0).max() / t.abs().amax(dim=0).median()).item()  # noqa: E731
        assert ratio(h_smooth) < ratio(h) / 3  # the outlier channel no longer dominates per-token scales


def test_smoothquant_folds_only_where_a_norm_feeds_the_layer_alone():
    assert norm_in_front("LlamaForCausalLM", "layers.4.qkv_proj") == "layers.4.input_layernorm"
    assert norm_in_front("LlamaForCausalLM", "layers.4.gate_up_proj") == "layers.4.post_attention_layernorm"
    assert norm_in_front("LlamaForCausalLM", "layers.4.o_proj") is None
    assert norm_in_front("LlamaForCausalLM", "lm_head") is None
    assert norm_in_front("Gemma3ForCausalLM", "layers.4.qkv_proj") is None  # 1 + weight norms: kept in the module


def test_awq_search_beats_round_to_nearest_on_salient_channels():
    x = torch.randn(256, 256, generator=_gen(3))
    x[:, :4] *= 40  # four salient input channels
    w = torch.randn(128, 256, generator=_gen(4)) * 0.05
    found = search_awq_scale(x, w, x.abs().mean(dim=0), group_size=128, grid_size=10)
    assert found.alpha > 0 and found.error < 0.8 * found.plain_error
    # The error it reports is the layer's output error with the scale applied.
    s = found.scale
    dq = fake_quantize_int4(w * s[None, :], 128) / s[None, :]
    assert abs(((x @ dq.t() - x @ w.t()).pow(2).mean()).item() - found.error) < 1e-3 * found.error


def _tiny_llama() -> LlamaForCausalLM:
    config = ModelConfig(
        name="tiny", architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
        num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=None, max_position_embeddings=64, tie_word_embeddings=True,
    )
    with torch.device("meta"):
        return LlamaForCausalLM(config, 64, Kernels.reference(CPU, torch.float32))


def test_layer_plan_follows_exclude_patterns():
    model = _tiny_llama()
    plan = {layer.name: layer for layer in plan_layers(model, QuantConfig("W8A16"), 3, "bfloat16")}
    assert len(plan) == 3 * 4 + 1 and plan["lm_head"].algo == "none" and plan["layers.0.qkv_proj"].algo == "W8A16"
    custom = QuantConfig("W4A16_AWQ", exclude_modules=["first_layer", "last_layer", "*.down_proj"])
    plan = {layer.name: layer for layer in plan_layers(model, custom, 3, "bfloat16")}
    quantized = sorted(name for name, layer in plan.items() if layer.algo != "none")
    assert quantized == ["layers.1.gate_up_proj", "layers.1.o_proj", "layers.1.qkv_proj", "lm_head"]
    assert plan["layers.2.o_proj"].note == "excluded by 'layers.2'"
    assert plan["layers.1.down_proj"].note == "excluded by '*.down_proj'"
    assert plan["layers.1.qkv_proj"].kind == "gemm_w4a16" and plan["layers.1.qkv_proj"].weight == "int4 g128 asymmetric, integer zeros"
    assert all(layer.algo == "none" for layer in plan_layers(model, QuantConfig(), 3, "bfloat16"))
