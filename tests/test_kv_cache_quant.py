"""KV-cache quantization (FP8 E4M3, INT8): kernels against the torch reference, calibration of the
per-layer scales, engines built and served with a 1-byte cache, the host tier, the perplexity gate.

Kernels run under Triton's interpreter on the CPU (small shapes) and natively
with INFLIGHT_TEST_DEVICE=cuda. Engines are the two-layer random-weight Llama
of conftest (fast) and, once, the default model (the perplexity gate).
"""

from __future__ import annotations

import json

import pytest
import torch

from executor_svc.build_config import BuildConfig, BuildConfigError, QuantConfig
from executor_svc.builder import build_engine
from executor_svc.engine import RuntimeConfig, load_engine
from executor_svc.engine_file import read_manifest, write_manifest
from executor_svc.kv_offload import KVOffload
from executor_svc.quantization.calibration import calibrate
from executor_svc.quantization.forward import PromptForward
from executor_svc.quantization.kv_cache import KVAmax, apply_kv_cache_scales, kv_cache_dtype, kv_cache_record
from kvcache.layout import KVCacheLayout
from plugins.attention_torch import paged_attention
from plugins.kv_cache_quant import FP8_KV_MAX, INT8_KV_MAX, dequantize_kv, quantize_kv
from plugins.rope_torch import rope_and_write_kv
from protos.plan import BlockCopy
from tests.conftest import TEST_DEVICE, tiny_llama_config

triton = pytest.importorskip("triton")
from plugins.attention_triton import paged_attention_triton  # noqa: E402
from plugins.attention_triton_decode import DecodeTiles, decode_attention  # noqa: E402
from plugins.rope_triton import rope_and_write_kv_triton  # noqa: E402
from tests.test_triton_attention import make_step  # noqa: E402
from tests.test_triton_kernels import _rope_case  # noqa: E402

FP8, INT8 = torch.float8_e4m3fn, torch.int8
KV_DTYPES = {"FP8": FP8, "INT8": INT8}
QMAX = {FP8: FP8_KV_MAX, INT8: INT8_KV_MAX}
# The interpreter rounds float32 -> bfloat16 by truncation; bfloat16 is checked on the GPU.
MODEL_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if TEST_DEVICE == "cuda" else [])


def stored_bytes(cache: torch.Tensor) -> torch.Tensor:
    """What a cache holds, comparable with torch.equal (which lacks FP8)."""
    return cache.view(torch.uint8) if cache.dtype == FP8 else cache


def scale_for(x: torch.Tensor, dtype: torch.dtype, headroom: float = 1.0) -> float:
    """amax / qmax; headroom < 1 makes the largest values saturate."""
    return float(x.float().abs().max()) * headroom / QMAX[dtype]


# ----------------------------------------------------------------------------- reference arithmetic


def test_reference_quantization_rounds_to_nearest_even_and_saturates():
    x = torch.tensor([0.5, 1.5, 2.5, -2.5, 300.0, -300.0, 0.26, 1000.0, -1000.0, 17.0, 18.0, 0.001])
    assert quantize_kv(x, 1.0, INT8).tolist() == [0, 2, 2, -2, 127, -127, 0, 127, -127, 17, 18, 0]
    fp8 = quantize_kv(x, 1.0, FP8).float().tolist()
    # E4M3 has 3 mantissa bits: 17 is a tie between 16 and 18 (even: 16), 300 -> 288, +-1000 saturates to +-448,
    # 0.001 is nearer the smallest subnormal (2**-9) than 0.
    assert fp8 == [0.5, 1.5, 2.5, -2.5, 288.0, -288.0, 0.25, 448.0, -448.0, 16.0, 18.0, 0.001953125]
    # The scale divides on the way in and multiplies on the way out.
    y = torch.linspace(-3, 3, 101)
    for dtype, bound in ((FP8, 1 / 16), (INT8, 0.5 / 127)):
        scale = 3.0 / QMAX[dtype]
        error = (dequantize_kv(quantize_kv(y, scale, dtype), scale, torch.float32) - y).abs()
        relative = error / y.abs().clamp(min=1e-6) if dtype == FP8 else error / 3.0
        assert float(relative[y.abs() > 0.05].max()) <= bound + 1e-6


def test_a_16bit_cache_ignores_the_scales():
    x = torch.randn(4, 2, 8)
    assert torch.equal(quantize_kv(x, 0.01, torch.float32), x)
    assert torch.equal(dequantize_kv(x, 0.01, torch.float32), x)


# ----------------------------------------------------------------------------- rope: quantize on write


@pytest.mark.parametrize("kv", ["FP8", "INT8"])
@pytest.mark.parametrize("dtype", MODEL_DTYPES)
@pytest.mark.parametrize("shape", [(5, 4, 2, 16), (6, 6, 2, 32)])
def test_rope_write_quantizes_exactly_like_the_reference(kv, dtype, shape):
    q, k, v, cos, sin, positions, k_cache, v_cache, slots = _rope_case(*shape, dtype, "neox", seed=sum(shape))
    kv_dtype = KV_DTYPES[kv]
    k_cache, v_cache = quantize_kv(k_cache, 0.05, kv_dtype), quantize_kv(v_cache, 0.05, kv_dtype)  # stale data
    # k's scale lets its largest values saturate; v's fits it.
    k_scale, v_scale = scale_for(k, kv_dtype, headroom=0.7), scale_for(v, kv_dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_q = rope_and_write_kv(
        q, k, v, cos, sin, positions, expected_k, expected_v, slots, "neox", k_scale, v_scale
    )
    out_q = rope_and_write_kv_triton(q, k, v, cos, sin, positions, k_cache, v_cache, slots, "neox", k_scale, v_scale)
    assert torch.equal(out_q, expected_q)
    assert k_cache.dtype == kv_dtype and torch.equal(stored_bytes(k_cache), stored_bytes(expected_k))
    assert torch.equal(stored_bytes(v_cache), stored_bytes(expected_v))
    # And what is stored is v itself, to within the format's rounding.
    stored_v = dequantize_kv(v_cache.flatten(0, 1)[slots], v_scale, torch.float32)
    bound = v.float().abs() / 16 + 1e-3 if kv == "FP8" else torch.full_like(v.float(), v_scale / 2 + 1e-6)
    assert bool(((stored_v - v.float()).abs() <= bound).all())


def test_rope_write_to_a_quantized_cache_skips_padding_slots():
    q, k, v, cos, sin, positions, k_cache, v_cache, _ = _rope_case(6, 4, 2, 16, torch.float32, "neox", seed=3)
    k_cache, v_cache = quantize_kv(k_cache, 0.05, FP8), quantize_kv(v_cache, 0.05, FP8)
    slots = torch.tensor([9, -1, 14, 6, -1, 11], device=TEST_DEVICE)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    rope_and_write_kv_triton(q, k, v, cos, sin, positions, k_cache, v_cache, slots, "neox", 0.02, 0.03)
    real = slots >= 0
    rope_and_write_kv(q[real], k[real], v[real], cos, sin, positions[real], expected_k, expected_v, slots[real], "neox",
                      0.02, 0.03)
    assert torch.equal(stored_bytes(k_cache), stored_bytes(expected_k))
    assert torch.equal(stored_bytes(v_cache), stored_bytes(expected_v))


# ----------------------------------------------------------------------------- attention: dequantize on read


def quantized_step(requests, heads, kv_heads, kv_dtype, dtype=torch.float32, seed=0, extra_table_blocks=0):
    """make_step's step with its cache quantized (per-tensor scales from the cache's own maxima)."""
    q, k, v, meta = make_step(requests, heads, kv_heads, 64, 16, dtype=torch.float32, seed=seed,
                              extra_table_blocks=extra_table_blocks)
    k_scale, v_scale = scale_for(k, kv_dtype), scale_for(v, kv_dtype)
    return q.to(dtype), quantize_kv(k, k_scale, kv_dtype), quantize_kv(v, v_scale, kv_dtype), meta, k_scale, v_scale


def assert_close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("kv", ["FP8", "INT8"])
@pytest.mark.parametrize("dtype", MODEL_DTYPES)
def test_decode_attention_over_a_quantized_cache(kv, dtype):
    # Contexts of 1 token, under one block, one block exactly, several blocks; GQA ratio 3.
    q, k, v, meta, k_scale, v_scale = quantized_step([(0, 1), (16, 1), (4, 1), (94, 1)], 6, 2, KV_DTYPES[kv], dtype)
    expected = paged_attention(q.float(), k, v, meta, 0.125, 0, k_scale, v_scale)
    assert_close(paged_attention_triton(q, k, v, meta, 0.125, 0, k_scale, v_scale), expected, dtype)
    # The reference really dequantized: it agrees with attention over the float cache it came from.
    unquantized = paged_attention(q.float(), dequantize_kv(k, k_scale, torch.float32),
                                  dequantize_kv(v, v_scale, torch.float32), meta, 0.125)
    assert torch.equal(expected, unquantized)


@pytest.mark.parametrize("kv", ["FP8", "INT8"])
def test_a_bfloat16_query_past_float16_range_stays_finite_over_a_quantized_cache(kv):
    # The kernel multiplies 1-byte tiles in float16 and clamps a bfloat16 query into float16's range:
    # a query element past 65504 must not become inf (and NaN after the softmax).
    q, k, v, meta, k_scale, v_scale = quantized_step([(16, 1), (94, 1)], 6, 2, KV_DTYPES[kv], torch.bfloat16)
    q[:, 0] *= 1e6  # head 0 only; heads 1-5 keep ordinary values
    out = paged_attention_triton(q, k, v, meta, 0.125, 0, k_scale, v_scale)
    expected = paged_attention(q.float(), k, v, meta, 0.125, 0, k_scale, v_scale)
    assert torch.isfinite(out).all()
    assert_close(out[:, 1:], expected[:, 1:], torch.bfloat16)


@pytest.mark.parametrize("kv", ["FP8", "INT8"])
@pytest.mark.parametrize("window", [0, 24])
def test_decode_attention_split_k_over_a_quantized_cache(kv, window):
    # Many splits, some empty: the V scale is applied before the splits are merged.
    q, k, v, meta, k_scale, v_scale = quantized_step([(0, 1), (20, 1), (150, 1)], 6, 2, KV_DTYPES[kv],
                                                     seed=1, extra_table_blocks=6)
    tiles = DecodeTiles(block_n=16, num_warps=4, num_stages=1, programs_per_sm=64, min_split_tokens=16)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, k, v, meta, 0.125, window, out, tiles, 4, k_scale, v_scale)
    assert_close(out, paged_attention(q, k, v, meta, 0.125, window, k_scale, v_scale), torch.float32)


@pytest.mark.parametrize("kv", ["FP8", "INT8"])
@pytest.mark.parametrize("dtype", MODEL_DTYPES)
def test_context_attention_over_a_quantized_cache(kv, dtype):
    # Whole prompts, a chunk after cached tokens and generation rows in one packed step.
    requests = [(0, 37), (32, 45), (20, 1), (5, 1)]
    q, k, v, meta, k_scale, v_scale = quantized_step(requests, 8, 2, KV_DTYPES[kv], dtype, seed=3)
    expected = paged_attention(q.float(), k, v, meta, 0.125, 0, k_scale, v_scale)
    assert_close(paged_attention_triton(q, k, v, meta, 0.125, 0, k_scale, v_scale), expected, dtype)
    windowed = paged_attention(q.float(), k, v, meta, 0.125, 16, k_scale, v_scale)
    assert_close(paged_attention_triton(q, k, v, meta, 0.125, 16, k_scale, v_scale), windowed, dtype)


def test_quantized_cache_attention_stays_close_to_the_unquantized_one():
    q, k, v, meta = make_step([(0, 40), (60, 1)], 6, 2, 64, 16, seed=5)
    exact = paged_attention(q, k, v, meta, 0.125)
    # Relative error of the output: E4M3 keeps 3 mantissa bits, INT8 a uniform grid of amax / 127.
    for kv_dtype, bound in ((FP8, 0.05), (INT8, 0.02)):
        k_scale, v_scale = scale_for(k, kv_dtype), scale_for(v, kv_dtype)
        out = paged_attention(q, quantize_kv(k, k_scale, kv_dtype), quantize_kv(v, v_scale, kv_dtype), meta, 0.125, 0,
                              k_scale, v_scale)
        assert float((out - exact).norm() / exact.norm()) < bound


# ----------------------------------------------------------------------------- calibration of the scales


def test_kv_amax_reads_what_the_prompts_wrote():
    cache = torch.zeros(3, 2, 4, 4, 2, 8)  # [layers, 2, blocks, tokens_per_block, kv_heads, D]
    cache.flatten(2, 3)[:, :, :5] = torch.randn(3, 2, 5, 2, 8)
    cache.flatten(2, 3)[1, 1, 2, 0, 3] = -7.0  # layer 1's values
    cache.flatten(2, 3)[2, 0, 9] = 100.0  # past the prompt: not counted
    amax = KVAmax(3, torch.device("cpu"))
    amax.update(cache, 5)
    assert amax.amax[1, 1] == 7.0 and amax.amax[2, 0] < 100
    record = kv_cache_record("INT8", amax.amax, "test")
    assert record.dtype == "int8" and record.v_scales[1] == pytest.approx(7.0 / 127)
    with pytest.raises(ValueError, match="16-bit cache"):
        amax.update(cache.to(FP8), 5)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-kv")
    (folder / "config.json").write_text(json.dumps(tiny_llama_config(49152, 512)))
    return folder


def _tiny_model(folder):
    from executor_svc.model.config import ModelConfig
    from executor_svc.model.registry import build_model
    from executor_svc.model.weights import init_dummy_weights

    config = ModelConfig.from_folder(folder)
    model = build_model(config, 256, {}, torch.device(TEST_DEVICE), torch.float32)
    init_dummy_weights(model)
    return model, config


@pytest.mark.parametrize("kv", ["FP8", "INT8"])
def test_calibrated_scales_map_the_largest_key_and_value_to_the_format_maximum(tiny_folder, kv):
    model, config = _tiny_model(tiny_folder)
    device = torch.device(TEST_DEVICE)
    texts = [[(7 * i + j) % 1000 for i in range(40)] for j in range(3)]
    runner = PromptForward.create(model, config, 64, 16, device, torch.float32)
    stats = calibrate(runner, {}, texts, progress=False, kv_cache=True)
    per_text = [calibrate(runner, {}, [ids], progress=False, kv_cache=True).kv_amax for ids in texts]
    assert torch.equal(stats.kv_amax, torch.stack(per_text).amax(0)) and bool((stats.kv_amax > 0).all())
    record = kv_cache_record(kv, stats.kv_amax, "test")
    assert record.k_scales == pytest.approx((stats.kv_amax[:, 0] / QMAX[KV_DTYPES[kv]]).tolist())
    # Written through a quantized cache with those scales, layer 0's largest key and value land on the
    # format's largest value; later layers see inputs changed a little by the quantized layers before them.
    apply_kv_cache_scales(model, record)
    quantized = PromptForward.create(model, config, 64, 16, device, torch.float32, KV_DTYPES[kv])
    peaks = torch.zeros(config.num_layers, 2)
    for ids in texts:
        quantized.hidden_states(ids)
        written = quantized.kv_cache.flatten(2, 3)[:, :, :40].float()  # [layers, 2, tokens, kv_heads, D]
        peaks = torch.maximum(peaks, written.abs().amax(dim=(2, 3, 4)).cpu())
    qmax = QMAX[KV_DTYPES[kv]]
    assert torch.equal(peaks[0], torch.full_like(peaks[0], qmax))
    assert bool((peaks >= 0.9 * qmax).all()) and bool((peaks <= qmax).all())


# ----------------------------------------------------------------------------- engines with a 1-byte cache


def _tiny_build(kv: str, dtype: str = "float32") -> BuildConfig:
    return BuildConfig(max_batch_size=8, max_num_tokens=256, max_seq_len=256, tokens_per_block=16, dtype=dtype,
                       quant_config=QuantConfig(kv_cache_quant_algo=kv, calib_size=4, calib_max_tokens=64))


@pytest.fixture(scope="module")
def tiny_engines(tiny_folder):
    """kv algo -> a dummy engine folder of the tiny Llama (built once)."""
    built = {}

    def get(kv: str, dtype: str = "float32"):
        key = (kv, dtype)
        if key not in built:
            built[key] = tiny_folder / f"engine-{kv}-{dtype}"
            build_engine(tiny_folder, built[key], _tiny_build(kv, dtype), device=TEST_DEVICE, load_format="dummy",
                         progress=False)
        return built[key]

    return get


@pytest.mark.parametrize("kv", ["FP8", "INT8"])
def test_engine_with_quantized_kv_cache_generates_like_the_16bit_one(tiny_engines, kv):
    from bench.quant_common import agreement, greedy_generate

    manifest = read_manifest(tiny_engines(kv))
    record = manifest.quantization.kv_cache
    assert record.algo == kv and record.num_layers == 2 and "random token ids" in record.source
    assert all(s > 0 for s in record.k_scales + record.v_scales)
    runtime = RuntimeConfig(device=TEST_DEVICE, kv_cache_bytes=8 << 20)
    plain, quantized = load_engine(tiny_engines("none"), runtime), load_engine(tiny_engines(kv), runtime)
    assert quantized.kv_cache.dtype == KV_DTYPES[kv] and quantized.layout.dtype == KV_DTYPES[kv]
    assert [layer.k_scale for layer in quantized.model.layers] == record.k_scales
    assert quantized.kv_offload.host_cache is None and plain.model.layers[0].k_scale == 1.0
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(49152, (12 + 9 * p,), generator=generator).tolist() for p in range(4)]
    # Served: a context step, then decode steps that read the 1-byte cache back.
    expected, outputs = greedy_generate(plain, prompts, 8), greedy_generate(quantized, prompts, 8)
    assert [len(o) for o in outputs] == [8] * 4 and agreement(expected, outputs)["prefix_match_fraction"] > 0
    # A random model's next-token logits are nearly flat (top-2 gaps of ~0.1 for a spread of 1), so a
    # free-running continuation drifts at the first near-tie; fed the same tokens, the choices agree.
    sequences = [p + e for p, e in zip(prompts, expected)]
    same = torch.cat([a == b for a, b in zip(_next_tokens(plain, sequences), _next_tokens(quantized, sequences))])
    assert float(same.float().mean()) >= 0.75  # measured: 0.85-0.92 for FP8, 0.94-0.99 for INT8


def _next_tokens(engine, sequences: list[list[int]]) -> list[torch.Tensor]:
    """The engine's greedy choice after every position of each sequence, through its own KV-cache format."""
    runner = PromptForward.create(engine.model, engine.model_config, 64, engine.tokens_per_block, engine.device,
                                  engine.dtype, engine.layout.dtype)
    with torch.inference_mode():
        return [engine.model.compute_logits(runner.hidden_states(ids)).argmax(-1) for ids in sequences]


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("kv", ["FP8", "INT8"])
def test_captured_decode_steps_replay_over_a_quantized_cache(tiny_engines, kv):
    from bench.quant_common import agreement, greedy_generate

    graphed = load_engine(tiny_engines(kv), RuntimeConfig(device=TEST_DEVICE, kv_cache_bytes=8 << 20))
    eager = load_engine(tiny_engines(kv), RuntimeConfig(device=TEST_DEVICE, kv_cache_bytes=8 << 20, cuda_graphs=False))
    assert graphed.decode_graphs is not None and eager.decode_graphs is None
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(49152, (10 + 7 * p,), generator=generator).tolist() for p in range(4)]
    # The same kernels and scales, replayed: only the split of the keys may differ (float32 rounding).
    assert agreement(greedy_generate(eager, prompts, 8), greedy_generate(graphed, prompts, 8))[
        "prefix_match_fraction"] >= 0.9


def test_a_byte_budget_holds_twice_the_blocks_of_a_16bit_cache(tiny_engines):
    budget = 4 << 20
    runtime = RuntimeConfig(device=TEST_DEVICE, kv_cache_bytes=budget)
    bf16 = load_engine(tiny_engines("none", "bfloat16"), runtime)
    for kv in ("FP8", "INT8"):
        quantized = load_engine(tiny_engines(kv, "bfloat16"), runtime)
        assert quantized.layout.bytes_per_block * 2 == bf16.layout.bytes_per_block
        # num_kv_blocks = budget // bytes_per_block - 1 (the scratch block)
        assert quantized.num_kv_blocks + 1 == 2 * (bf16.num_kv_blocks + 1)
        assert quantized.kv_cache.element_size() * quantized.kv_cache.numel() <= budget


def test_host_tier_round_trips_an_fp8_cache():
    layout = KVCacheLayout(3, 2, 8, 4, FP8)
    assert KVOffload.blocks_for_budget(layout, 1 << 16) == 2 * KVOffload.blocks_for_budget(
        KVCacheLayout(3, 2, 8, 4, torch.bfloat16), 1 << 16)
    # [layers, 2, blocks, tokens_per_block, kv_heads, D]; on a GPU the host tier is pinned and copies on a side stream
    cache = quantize_kv(torch.randn(3, 2, 5, 4, 2, 8, device=TEST_DEVICE), 0.02, FP8)
    original = cache.clone()
    offload = KVOffload(cache, num_device_blocks=5, num_host_blocks=3, max_blocks_per_copy=2)
    assert offload.host_cache.dtype == FP8
    offload.copy_blocks([BlockCopy(3, 0), BlockCopy(1, 2), BlockCopy(4, 1)], [])
    cache.view(torch.uint8)[:, :, [1, 3, 4]] = 0
    offload.copy_blocks([], [BlockCopy(0, 2), BlockCopy(2, 0), BlockCopy(1, 1)])
    for block, source in ((0, 1), (2, 3), (1, 4)):
        assert torch.equal(stored_bytes(cache[:, :, block]), stored_bytes(original[:, :, source]))


def test_engine_with_host_tier_keeps_the_cache_dtype(tiny_engines):
    engine = load_engine(tiny_engines("FP8"), RuntimeConfig(device=TEST_DEVICE, kv_cache_bytes=4 << 20,
                                                            host_cache_bytes=1 << 20))
    assert engine.kv_offload.host_cache.dtype == FP8
    assert engine.kv_offload.num_host_blocks == (1 << 20) // engine.layout.bytes_per_block


# ----------------------------------------------------------------------------- settings that stay refused


@pytest.mark.parametrize("quant, message", [
    (QuantConfig(kv_cache_quant_algo="INT4"), "kv_cache_quant_algo 'INT4' is not supported"),
    (QuantConfig(kv_cache_quant_algo="fp8"), r"choose one of \['none', 'INT8', 'FP8'\]"),
    (QuantConfig("W3A16", kv_cache_quant_algo="FP8"), "quant_algo 'W3A16' is not supported"),
])
def test_invalid_kv_cache_settings_are_rejected(quant, message):
    with pytest.raises(BuildConfigError, match=message):
        BuildConfig(quant_config=quant).validate()


def test_kv_cache_dtype_names_the_choices():
    assert kv_cache_dtype("none", torch.bfloat16) == torch.bfloat16 and kv_cache_dtype("INT8", torch.float32) == INT8
    with pytest.raises(ValueError, match="not supported"):
        kv_cache_dtype("INT4", torch.float32)


def test_random_weights_cannot_be_validated(tiny_folder, tmp_path):
    from executor_svc.quantization.perplexity import PerplexityGate

    with pytest.raises(BuildConfigError, match="--validate measures perplexity"):
        build_engine(tiny_folder, tmp_path / "e", _tiny_build("FP8"), device=TEST_DEVICE, load_format="dummy",
                     progress=False, validation=PerplexityGate())


def test_an_engine_without_its_scales_is_refused_at_load(tiny_engines, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_engines("FP8"), broken)
    manifest = read_manifest(broken)
    manifest.quantization.kv_cache = None
    write_manifest(broken, manifest)
    with pytest.raises(ValueError, match="records no FP8 KV-cache scales; rebuild it"):
        load_engine(broken, RuntimeConfig(device=TEST_DEVICE, kv_cache_bytes=4 << 20))


# ----------------------------------------------------------------------------- the default model: the gate, inspect


def test_cli_build_validates_through_the_quantized_cache_and_inspect_shows_the_scales(
    model_dir, engine, tokenizer, tmp_path, capsys,
):
    from bench.quant_common import agreement, greedy_generate
    from executor_svc.quantization.corpus import encode_texts, held_out_texts
    from executor_svc.quantization.perplexity import perplexity
    from inflight.cli import main as cli_main

    out = tmp_path / "kv-fp8"
    status = cli_main([
        "--log-level", "WARNING", "build", "--model", str(model_dir), "--output", str(out), "--device", TEST_DEVICE,
        "--dtype", "float32", "--max-seq-len", "256", "--max-num-tokens", "64", "--max-batch-size", "4",
        "--tokens-per-block", "16", "--plugin", "attention=torch", "--kv-cache-quant-algo", "FP8",
        "--calib-size", "2", "--calib-max-tokens", "48", "--validate", "--validate-size", "2",
        "--validate-max-tokens", "48", "--max-ppl-increase", "5",
    ])
    built = capsys.readouterr().out
    assert status == 0, built
    record = read_manifest(out).quantization
    assert record.quant_algo == "none" and all(layer.algo == "none" for layer in record.layers)
    assert record.kv_cache.num_layers == 30 and record.calibration.num_texts == 2
    report = record.perplexity
    assert report.passed and report.quantized != report.baseline  # measured through the FP8 cache
    assert "kv cache    FP8 (float8_e4m3fn)" in built and "perplexity" in built

    fp8 = load_engine(out, RuntimeConfig(device=TEST_DEVICE, kv_cache_bytes=32 << 20))
    ids = encode_texts(out, held_out_texts(2)[0], 48)
    runner = PromptForward.create(fp8.model, fp8.model_config, 48, 16, fp8.device, fp8.dtype, fp8.layout.dtype)
    assert perplexity(runner, ids, progress=False)[0] == pytest.approx(report.quantized, rel=1e-4)
    # Real weights: greedy decoding through the FP8 cache stays on the 16-bit engine's track.
    prompts = [tokenizer.encode("The capital of France is"), tokenizer.encode("def fibonacci(n):")]
    same = agreement(greedy_generate(engine, prompts, 6), greedy_generate(fp8, prompts, 6))
    assert same["prefix_match_fraction"] >= 0.5

    assert cli_main(["inspect", str(out), "--layer-info"]) == 0
    info = capsys.readouterr().out
    assert "kv cache    FP8 (float8_e4m3fn), per-layer scales" in info
    scale = record.kv_cache.k_scales[0]
    assert "layers.0.attention" in info and f"k_scale {scale:.4g}" in info


def test_speed_benchmark_reports_the_kv_pool_capacity(tmp_path):
    from bench.quant_speed import main as speed_main

    out = tmp_path / "speed.json"
    assert speed_main([
        "--shape", "tiny", "--device", TEST_DEVICE, "--modes", "bf16,FP8_KV", "--prompt-len", "8", "--batch-size", "2",
        "--decode-tokens", "2", "--warmup-tokens", "1", "--max-seq-len", "128", "--kv-cache-gb", "0.02",
        "--work-dir", str(tmp_path / "work"), "--output", str(out),
    ]) == 0
    result = json.loads(out.read_text())
    capacity, modes = result["kv_capacity"], result["modes"]
    unquantized = next(iter(capacity.values()))
    for name in ("float8_e4m3fn", "int8"):  # a quarter of float32's bytes on the CPU, half of bfloat16's on a GPU
        ratio = unquantized["bytes_per_token"] // capacity[name]["bytes_per_token"]
        assert capacity[name]["tokens"] >= ratio * unquantized["tokens"]
    assert modes["FP8_KV"]["kv_cache_dtype"] == "float8_e4m3fn" and modes["FP8_KV"]["decode_ms_per_token"]["p50"] > 0
    assert modes["FP8_KV"]["kv_pool_tokens"] == capacity["float8_e4m3fn"]["tokens"]
    assert modes["bf16"]["kv_pool_tokens"] == unquantized["tokens"]
