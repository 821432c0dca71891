"""Small-M (decode) quantized GEMM kernels against their torch references.

plugins/quant_gemm_decode.py: GEMV (FMA) and 16-row tl.dot kernels for
INT8, INT4 AWQ and FP8 weights, with and without split-K, on odd shapes
(N and K not multiples of the tiles, short last INT4 groups, K that cannot
be read as words). Under Triton's CPU interpreter in float32 and float16
(its bfloat16 arithmetic is wrong, so bfloat16 runs only on a GPU:
INFLIGHT_TEST_DEVICE=cuda, which also adds Llama-sized shapes and a CUDA
graph capture).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from executor_svc.quantization import quantize as qz
from executor_svc.quantization.linear import Fp8Linear, weight_only_rows
from plugins.quant_gemm_decode_config import (
    FMA_MAX_ROWS, MAX_SPLIT, MIN_SPLIT_STEPS, PROGRAMS_PER_SM, DecodeConfig, decode_config, resolve_split,
    split_k_for,
)
from plugins.quant_gemm_torch import gemm_fp8, gemm_w4a16, gemm_w8a16
from plugins.registry import get_kernel
from tests.conftest import TEST_DEVICE

decode = pytest.importorskip("plugins.quant_gemm_decode")

DEVICE = torch.device(TEST_DEVICE)
ON_GPU = TEST_DEVICE == "cuda"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-3}


def _gemv(block_n: int, block_k: int, split_k: int) -> DecodeConfig:
    return DecodeConfig(fma=True, block_n=block_n, block_k=block_k, split_k=split_k)


def _dot(block_n: int, block_k: int, split_k: int) -> DecodeConfig:
    return DecodeConfig(fma=False, block_n=block_n, block_k=block_k, split_k=split_k)


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(DEVICE)


def _close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == expected.shape and out.dtype == expected.dtype
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(out.float(), expected.float(), atol=TOL[dtype] * scale, rtol=TOL[dtype])


def _operands(rows: int, k: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return _randn(rows, k, seed=rows * 1000 + k).to(dtype), _randn(n, k, seed=n, scale=k**-0.5)


# (rows, K, N, config); None: decode_config's choice. A gemv config on a K that does
# not split into int32 words runs the tl.dot kernel instead.
W8_CASES = [
    (1, 200, 40, _gemv(16, 128, 1)),
    (3, 200, 40, _gemv(16, 64, 3)),  # 4 steps over 3 splits: two splits of 2 steps
    (3, 136, 33, _dot(16, 64, 2)),
    (16, 200, 40, _dot(32, 128, 1)),
    (1, 202, 24, _gemv(16, 128, 2)),  # K % 4: not words
    (1, 256, 48, None), (3, 256, 48, None), (16, 256, 48, None),
]
# (rows, K, N, group, AWQ scale, config)
W4_CASES = [
    (1, 576, 40, 128, True, _gemv(16, 256, 1)),  # two groups a step, a short last group
    (3, 192, 33, 32, False, _gemv(16, 64, 2)),
    (2, 136, 24, 64, True, _gemv(16, 128, 2)),  # a last group of 8 channels
    (3, 576, 40, 128, True, _dot(16, 128, 2)),
    (16, 192, 40, 64, False, _dot(32, 32, 3)),
    (1, 102, 24, 32, True, _gemv(16, 128, 1)),  # K % 8: not words
    (2, 576, 40, 128, True, DecodeConfig(fma=True, block_n=16, block_k=256, split_k=2, num_stages=1)),  # no prefetch
    # per-load sums of four words: a short last group over 3 splits; groups of 32 at three rows (one run a group)
    (1, 712, 40, 128, True, DecodeConfig(fma=True, block_n=16, block_k=128, split_k=3, num_stages=2, thread_k=32)),
    (3, 192, 33, 32, False, DecodeConfig(fma=True, block_n=16, block_k=64, split_k=1, num_stages=1, thread_k=32)),
    # a short last group over 2 splits at two rows; three rows, small groups, per-load sums
    (2, 712, 40, 128, True, DecodeConfig(fma=True, block_n=16, block_k=256, split_k=2)),
    (3, 136, 24, 64, True, DecodeConfig(fma=True, block_n=16, block_k=128, split_k=1, thread_k=32)),
    (1, 256, 48, 128, True, None), (3, 256, 48, 128, True, None), (16, 256, 48, 128, False, None),
]
FP8_CASES = [
    (1, 200, 40, _gemv(16, 128, 1)),
    # products summed per thread in runs of 16 channels: masked last step over 3 splits; two rows, prefetch
    (1, 712, 40, DecodeConfig(fma=True, block_n=16, block_k=128, split_k=3, num_stages=1, thread_k=16)),
    (2, 256, 24, DecodeConfig(fma=True, block_n=32, block_k=64, split_k=1, num_stages=2, thread_k=16)),
    (3, 130, 33, _gemv(16, 64, 2)),
    (3, 130, 40, _dot(16, 64, 2)),
    (16, 200, 24, _dot(32, 128, 1)),
    (1, 256, 48, None), (3, 256, 48, None), (16, 256, 48, None),
]
if ON_GPU:  # Llama-3.1-8B's o projection, at batch 1 and 16
    W8_CASES += [(1, 4096, 4096, None), (16, 4096, 4096, None)]
    W4_CASES += [(1, 4096, 4096, 128, True, None), (16, 4096, 4096, 128, True, None)]
    FP8_CASES += [(1, 4096, 4096, None), (16, 4096, 4096, None)]


def _case_id(case: tuple) -> str:
    config = case[-1]
    mode = "auto" if config is None else f"{'gemv' if config.fma else 'dot'}{config.block_n}x{config.block_k}s{config.split_k}"
    if config is not None and config.thread_k:
        mode += f"t{config.thread_k}"
    return "-".join(map(str, case[:-1])) + "-" + mode


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", W8_CASES, ids=_case_id)
def test_w8a16_decode_matches_reference(case, dtype):
    rows, k, n, config = case
    x, w = _operands(rows, k, n, dtype)
    q, scales = qz.quantize_int8_per_channel(w)
    _close(decode.w8a16_decode(x, q, scales, config), gemm_w8a16(x, q, scales), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", W4_CASES, ids=_case_id)
def test_w4a16_decode_matches_reference(case, dtype):
    rows, k, n, group, with_scale, config = case
    x, w = _operands(rows, k, n, dtype)
    packed, scales, zeros = qz.quantize_int4_groupwise(w, group)
    pqs = (torch.rand(k, generator=torch.Generator().manual_seed(k)) + 0.5).to(DEVICE) if with_scale else None
    out = decode.w4a16_decode(x, packed, scales, zeros, group, pqs, config)
    _close(out, gemm_w4a16(x, packed, scales, zeros, group, pqs), dtype)


@pytest.mark.parametrize("case", [W4_CASES[1], W4_CASES[4], W4_CASES[5], W4_CASES[9]], ids=_case_id)
def test_w4a16_decode_reads_float_zeros_and_scales_stored_by_group(case):
    """Float zeros (``--zero-point float``) and scales and zeros stored [groups, N] (read transposed)."""
    rows, k, n, group, with_scale, config = case
    x, w = _operands(rows, k, n, torch.float16)
    packed, scales, zeros = qz.quantize_int4_groupwise(w, group, float_zeros=True)
    assert not torch.equal(zeros, zeros.round())
    expected = gemm_w4a16(x, packed, scales, zeros, group)
    by_group = scales.t().contiguous().t(), zeros.t().contiguous().t()
    assert by_group[0].stride(0) == 1
    _close(decode.w4a16_decode(x, packed, *by_group, group, None, config), expected, torch.float16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", FP8_CASES, ids=_case_id)
def test_fp8_weight_only_decode_matches_reference(case, dtype):
    rows, k, n, config = case
    x, w = _operands(rows, k, n, dtype)
    weight, w_scale = qz.quantize_fp8_per_tensor(w)
    out = decode.fp8_weight_only_decode(x, weight, w_scale, dtype, config)
    _close(out, gemm_fp8(x, None, weight, w_scale, dtype), dtype)


def _int4_operands(rows: int, k: int, n: int) -> tuple[torch.Tensor, tuple]:
    x, w = _operands(rows, k, n, torch.float32)
    pqs = (torch.rand(k, generator=torch.Generator().manual_seed(k)) + 0.5).to(DEVICE)
    return x, (*qz.quantize_int4_groupwise(w, 128), 128, pqs)


@pytest.mark.parametrize("group_size", [128, 32])
def test_int4_dequantization_is_the_references_weight_exactly(group_size):
    """The prompt-step path's 16-bit weight: the reference's float32 dequantization bit for bit (odd N, K
    off the tile, a short last group), AWQ's input scale folded in, scales laid out either way."""
    from plugins.quant_gemm_torch import dequantize_int4
    from plugins.quant_gemm_triton import dequantize_int4_triton

    n, k = 40, 200
    _, w = _operands(1, k, n, torch.float32)
    packed, scales, zeros = qz.quantize_int4_groupwise(w, group_size)
    pqs = (torch.rand(k, generator=torch.Generator().manual_seed(1)) + 0.5).to(DEVICE)
    expected = dequantize_int4(packed, scales, zeros, group_size)
    by_group = scales.t().contiguous().t(), zeros.t().contiguous().t()
    for s, z in ((scales, zeros), by_group):
        assert torch.equal(dequantize_int4_triton(packed, s, z, group_size, k, None, torch.float32), expected)
        assert torch.equal(dequantize_int4_triton(packed, s, z, group_size, k, pqs, torch.float32), expected * pqs)
    with pytest.raises(ValueError, match="share one layout"):
        dequantize_int4_triton(packed, by_group[0], zeros, group_size, k, None, torch.float32)


def test_int8_dequantization_is_the_references_weight_exactly():
    from plugins.quant_gemm_triton import dequantize_int8_triton

    _, w = _operands(1, 200, 40, torch.float32)
    q, scales = qz.quantize_int8_per_channel(w)
    for dtype in (torch.float32, torch.float16):
        assert torch.equal(dequantize_int8_triton(q, scales, dtype), (q.float() * scales.float()[:, None]).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [40, 100, 136])
def test_rows_past_the_decode_kernels_match_the_reference(dtype, rows):
    """Past the decode kernels' 16 rows the registered INT8 and INT4 GEMMs run tl.dot tiles of up to 64 rows
    (40 rows: one partial tile; 100: a full one and a partial one) and past 128 multiply by the dequantized
    weight (136)."""
    x, (packed, scales, zeros, group, pqs) = _int4_operands(rows, 576, 72)
    x = x.to(dtype)
    out = decode.gemm_w4a16_decode(x, packed, scales, zeros, group, pqs)
    _close(out, gemm_w4a16(x, packed, scales, zeros, group, pqs), dtype)
    q, q_scales = qz.quantize_int8_per_channel(_operands(1, 576, 72, torch.float32)[1])
    _close(decode.gemm_w8a16_decode(x, q, q_scales), gemm_w8a16(x, q, q_scales), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_m", [32, 64])
def test_dot_tiles_of_more_rows_match_the_reference(dtype, block_m):
    """tl.dot programs of 32 or 64 rows (the weights read once per tile of rows): 40 rows make a partial
    last tile or one partial tile, split over K or not."""
    x, (packed, scales, zeros, group, pqs) = _int4_operands(40, 576, 72)
    x = x.to(dtype)
    q, q_scales = qz.quantize_int8_per_channel(_operands(1, 576, 72, torch.float32)[1])
    for split_k in (1, 2):
        config = DecodeConfig(fma=False, block_n=32, block_k=128, split_k=split_k, block_m=block_m)
        _close(decode.w4a16_decode(x, packed, scales, zeros, group, pqs, config),
               gemm_w4a16(x, packed, scales, zeros, group, pqs), dtype)
        _close(decode.w8a16_decode(x, q, q_scales, config), gemm_w8a16(x, q, q_scales), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,block_m,split_k", [(3, 0, 2), (16, 0, 1), (40, 32, 1), (40, 64, 2), (100, 64, 1)])
def test_int4_one_dot_tiles_match_the_reference(dtype, rows, block_m, split_k):
    """The INT4 tl.dot kernel with each step's codes built whole for one dot (``one_dot``): 16-bit rows
    take it (float32 ones the byte kernel), with the AWQ input scale, a short last K step (576 = 4.5 steps
    of 128) and partial tiles of rows; it must agree with the reference as the eight-plane kernel does."""
    x, (packed, scales, zeros, group, pqs) = _int4_operands(rows, 576, 72)
    x = x.to(dtype)
    expected = gemm_w4a16(x, packed, scales, zeros, group, pqs)
    config = DecodeConfig(fma=False, block_n=32, block_k=128, split_k=split_k, block_m=block_m, one_dot=True)
    out = decode.w4a16_decode(x, packed, scales, zeros, group, pqs, config)
    _close(out, expected, dtype)
    planes = decode.w4a16_decode(x, packed, scales, zeros, group, pqs, replace(config, one_dot=False))
    _close(out, planes, dtype)


def test_one_dot_is_a_tl_dot_setting():
    assert DecodeConfig(fma=False, block_n=64, block_k=128, one_dot=True).describe()["one_dot"] is True
    assert "one_dot" not in _dot(64, 128, 0).describe()
    with pytest.raises(ValueError, match="one_dot"):
        DecodeConfig(fma=True, block_n=64, block_k=128, one_dot=True)


def test_decode_config_rows_per_tile():
    assert _dot(64, 128, 0).rows_per_tile == 16 and "block_m" not in _dot(64, 128, 0).describe()
    assert DecodeConfig(fma=False, block_n=64, block_k=128, block_m=64).describe()["block_m"] == 64
    for bad in ({"fma": False, "block_m": 8}, {"fma": False, "block_m": 48}, {"fma": True, "block_m": 32}):
        with pytest.raises(ValueError, match="block_m"):
            DecodeConfig(block_n=64, block_k=128, **bad)


@pytest.mark.parametrize("tactic", list(decode.FP8_TACTICS))
def test_every_fp8_tactic_matches_reference(tactic):
    x, w = _operands(1, 200, 40, torch.float32)
    weight, w_scale = qz.quantize_fp8_per_tensor(w)
    out = decode.fp8_weight_only_decode(x, weight, w_scale, torch.float32, decode.FP8_TACTICS[tactic])
    _close(out, gemm_fp8(x, None, weight, w_scale, torch.float32), torch.float32)


@pytest.mark.parametrize("tactic", list(decode.INT4_TACTICS))
def test_every_int4_tactic_matches_reference(tactic):
    x, weight = _int4_operands(2, 576, 40)  # two groups a step at block_k 256, a short last group
    for rows in (1, 2):
        out = decode.w4a16_decode(x[:rows], *weight, config=decode.INT4_TACTICS[tactic])
        _close(out, gemm_w4a16(x[:rows], *weight), torch.float32)


@pytest.mark.parametrize("magnitude", [1e-9, 1e4])
def test_int4_gemv_holds_tiny_and_large_activations(magnitude):
    """INT4 codes read as subnormal floats keep every product normal for 2^-41 < |x| < 2^63: activations far
    from 1 (outlier channels, near-zero rows) give the reference's result at float32 tolerance."""
    x, weight = _int4_operands(2, 576, 40)
    x = x * magnitude
    x[:, 5] *= 64.0  # one outlier channel
    for thread_k in (0, 32):
        config = DecodeConfig(fma=True, block_n=16, block_k=128, split_k=2, thread_k=thread_k)
        _close(decode.w4a16_decode(x, *weight, config=config), gemm_w4a16(x, *weight), torch.float32)


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_gemv_tactics_route_one_row_of_their_shape(monkeypatch, fmt):
    from executor_svc.engine_file import PluginChoice
    from executor_svc.kernel_selection import DECODE, apply_tactics
    from plugins import gemv_tactics

    monkeypatch.setattr(gemv_tactics, "_tables", {})
    launched = []
    launch = decode._launch
    monkeypatch.setattr(decode, "_launch", lambda kernel, config, *a, **kw: launched.append(config) or launch(
        kernel, config, *a, **kw))
    if fmt == "fp8":
        kind, tactic, k = "gemm_fp8", "n16 k512 w4", 200
        x, w = _operands(3, k, 40, torch.float32)
        weight = qz.quantize_fp8_per_tensor(w)
        run, reference = (lambda x, wt: decode.fp8_weight_only_decode(x, *wt, torch.float32),
                          lambda x, wt: gemm_fp8(x, None, *wt, torch.float32))
        other = qz.quantize_fp8_per_tensor(_operands(1, k, 48, torch.float32)[1])
    else:
        kind, tactic, k = "gemm_w4a16", "n128 k128 w8", 576
        x, weight = _int4_operands(3, k, 40)
        run, reference = lambda x, wt: decode.w4a16_decode(x, *wt), lambda x, wt: gemm_w4a16(x, *wt)
        other = _int4_operands(1, k, 48)[1]
    apply_tactics({kind: PluginChoice(name=DECODE, requested="auto", tactics={f"40x{k}": tactic})})
    for rows in (1, 3):
        _close(run(x[:rows], weight), reference(x[:rows], weight), torch.float32)
    chosen = decode.TACTICS[fmt][tactic]
    assert (launched[0].block_n, launched[0].block_k) == (chosen.block_n, chosen.block_k)  # one row: the tactic
    assert not launched[1].fma  # three rows: decode_config's tl.dot tiles, whatever the tactic says
    run(x[:1], other)
    default = next(iter(decode.TACTICS[fmt].values()))
    assert (launched[2].block_n, launched[2].block_k) == (default.block_n, default.block_k)  # no tactic: the default
    with pytest.raises(ValueError, match=f"unknown {fmt} GEMV tactic"):
        (decode.set_fp8_tactics if fmt == "fp8" else decode.set_int4_tactics)({"8x8": "fastest"})


@pytest.mark.skipif(not ON_GPU, reason="tactics are timed from CUDA graphs")
@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_gemv_tactics_are_timed_per_shape_and_installed(monkeypatch, fmt):
    from plugins import gemv_tactics

    monkeypatch.setattr(gemv_tactics, "_tables", {})
    if fmt == "fp8":
        report = decode.tune_fp8_tactics([(1024, 4096), (4096, 1024)], DEVICE, torch.bfloat16)
    else:  # timed with the engine's group size
        report = decode.tune_int4_tactics([(1024, 4096), (4096, 1024)], DEVICE, torch.bfloat16, group_size=32)
    assert set(report) == {"1024x4096", "4096x1024"}
    for key, entry in report.items():
        assert set(entry["timings_us"]) == set(decode.TACTICS[fmt]) and "failed" not in entry
        # The report rounds to 0.01 us; the pick is made before rounding, so two tiles may tie in the report.
        assert entry["timings_us"][entry["tactic"]] == min(entry["timings_us"].values())
        assert gemv_tactics.lookup(fmt, *map(int, key.split("x"))) == entry["tactic"]


def test_split_k_is_deterministic_and_leaves_its_counters_at_zero():
    x, w = _operands(3, 512, 40, torch.float32)
    q, scales = qz.quantize_int8_per_channel(w)
    for config in (_gemv(16, 64, 4), _dot(16, 64, 4)):
        first = decode.w8a16_decode(x, q, scales, config)
        assert torch.equal(decode.w8a16_decode(x, q, scales, config), first)  # splits are summed in a fixed order
        assert not decode._locks[x.device].any()  # each launch resets what it counted
        _close(first, decode.w8a16_decode(x, q, scales, _gemv(16, 64, 1)), torch.float32)


def test_registered_kernels_route_by_rows(monkeypatch):
    """Up to 16 rows the decode kernels (their own tile choice); INT8/INT4 up to 128 the tl.dot kernel in
    tiles of the batch's rows (up to 64), past that the dequantized weight; FP8 past 16 rows the scaled matmul."""
    calls = []

    def decode_call(name):
        return lambda x, config: calls.append(
            (name, x.shape[0], "own" if config is None else (config.fma, config.rows_per_tile)))

    monkeypatch.setattr(decode, "w8a16_decode", lambda x, q, s, config=None: decode_call("int8")(x, config))
    monkeypatch.setattr(decode, "w4a16_decode", lambda x, *a: decode_call("int4")(x, a[-1]))
    monkeypatch.setattr(decode, "dequantize_int8_triton",
                        lambda *a: calls.append(("int8 dequantized", a[2])) or torch.ones(3, 8))
    monkeypatch.setattr(decode, "dequantize_int4_triton",
                        lambda *a: calls.append(("int4 dequantized", a[-1])) or torch.ones(3, 8))
    monkeypatch.setattr(decode, "fp8_weight_only_decode", lambda *a: calls.append(("fp8 weight-only", a[0].shape[0])))
    monkeypatch.setattr(decode, "gemm_fp8_scaled_mm", lambda *a: calls.append(("scaled_mm", a[0].shape[0])))
    q8, q4 = torch.zeros(3, 8, dtype=torch.int8), torch.zeros(3, 4, dtype=torch.uint8)
    for rows in (1, 16, 17, 64, 128, 129):
        x = torch.zeros(rows, 8)
        decode.gemm_w8a16_decode(x, q8, None)
        decode.gemm_w4a16_decode(x, q4, None, None, 128)
        decode.gemm_fp8_decode(x, None if rows <= 16 else torch.ones(rows, 1), None, None, torch.float32)
    assert calls == [
        ("int8", 1, "own"), ("int4", 1, "own"), ("fp8 weight-only", 1),
        ("int8", 16, "own"), ("int4", 16, "own"), ("fp8 weight-only", 16),
        ("int8", 17, (False, 32)), ("int4", 17, (False, 32)), ("scaled_mm", 17),
        ("int8", 64, (False, 64)), ("int4", 64, (False, 64)), ("scaled_mm", 64),
        ("int8", 128, (False, 64)), ("int4", 128, (False, 64)), ("scaled_mm", 128),
        ("int8 dequantized", torch.float32), ("int4 dequantized", torch.float32), ("scaled_mm", 129),
    ]
    cpu = torch.device("cpu")
    for kind in ("gemm_w8a16", "gemm_w4a16", "gemm_fp8"):
        with pytest.raises(ValueError, match="cannot run on cpu"):
            get_kernel(kind, "triton_decode", cpu, torch.float32)


def test_fp8_linear_passes_16_bit_activations_to_a_weight_only_kernel():
    seen = []

    def kernel(x_q, x_scale, weight, w_scale, out_dtype):
        seen.append((x_q.dtype, x_scale is None))
        return gemm_fp8(x_q, x_scale, weight, w_scale, out_dtype)

    kernel.weight_only_rows = 4
    w = _randn(24, 64, seed=1, scale=0.1)
    layer = Fp8Linear.from_float(w, kernel)
    layer(_randn(4, 64, seed=2))
    layer(_randn(5, 64, seed=3))
    assert seen == [(torch.float32, True), (qz.FP8_DTYPE, False)]  # quantized above weight_only_rows
    assert weight_only_rows(gemm_fp8) == 0 and weight_only_rows(decode.gemm_fp8_decode) == decode.MAX_ROWS
    # The decode kernel's weight-only path computes what the reference does with unquantized x.
    x = _randn(3, 64, seed=4)
    fast = Fp8Linear.from_float(w, decode.gemm_fp8_decode)
    _close(fast(x), gemm_fp8(x, None, fast.weight, fast.weight_scale, torch.float32), torch.float32)


def test_decode_config_fills_the_gpu_and_respects_the_formats():
    sms = 132
    for fmt in ("int8", "int4", "fp8"):
        assert decode_config(fmt, 1, 6144, 4096, sms).fma and not decode_config(fmt, 16, 6144, 4096, sms).fma
        assert not decode_config(fmt, FMA_MAX_ROWS[fmt] + 1, 4096, 4096, sms).fma
        for rows, n, k in ((1, 6144, 4096), (1, 4096, 4096), (1, 28672, 4096), (1, 4096, 14336), (16, 6144, 4096)):
            config = decode_config(fmt, rows, n, k, sms)
            tiles, steps = -(-n // config.block_n), -(-k // config.block_k)
            # enough programs for every SM, unless splitting further would make splits too short
            assert (tiles * config.split_k >= PROGRAMS_PER_SM * sms or config.split_k == MAX_SPLIT
                    or steps // (2 * config.split_k) < MIN_SPLIT_STEPS), (fmt, rows, n, k, config)
    assert decode_config("int4", 16, 4096, 4096, sms, group_size=32).block_k <= 32  # a tl.dot step in one group
    for tiles, steps in ((1, 1000), (4, 64), (128, 56), (896, 16), (10, 3)):
        split = split_k_for(tiles, steps, sms)
        assert 1 <= split <= MAX_SPLIT and (split == 1 or steps // split >= MIN_SPLIT_STEPS)
    # a config's own split stays as it is
    assert resolve_split(DecodeConfig(fma=True, block_n=32, block_k=128, split_k=8), 1, 4096, 4096, sms).split_k == 8


@pytest.mark.parametrize("thread_k", [3, 24, 512])
def test_decode_config_rejects_thread_sums_no_kernel_runs(thread_k):
    with pytest.raises(ValueError, match="thread_k"):
        DecodeConfig(fma=True, block_n=32, block_k=256, thread_k=thread_k)


@pytest.mark.parametrize("thread_k", [4, 64])
def test_int4_thread_sums_need_whole_words_within_a_group(thread_k):
    x, weight = _int4_operands(1, 256, 16)
    packed, scales, zeros, _, pqs = weight
    config = DecodeConfig(fma=True, block_n=16, block_k=128, split_k=1, thread_k=thread_k)
    with pytest.raises(ValueError, match="thread_k"):  # 4: half a word; 64: past a group of 32
        decode.w4a16_decode(x, packed, scales, zeros, 32 if thread_k == 64 else 128, pqs, config)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_decode_kernels_replay_from_a_cuda_graph():
    x, w = _operands(1, 4096, 4096, torch.bfloat16)
    packed, scales, zeros = qz.quantize_int4_groupwise(w, 128)
    pqs = torch.ones(4096, device=DEVICE)
    call = lambda: decode.gemm_w4a16_decode(x, packed, scales, zeros, 128, pqs)  # noqa: E731
    eager = call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for seed in (5, 6):
        x.copy_(_randn(1, 4096, seed=seed).to(torch.bfloat16))
        graph.replay()
        torch.testing.assert_close(out, call(), rtol=0, atol=0)
    assert not torch.equal(out, eager)


# Compiles each kernel for sm_90 with the specializations a launch on Llama shapes gets (16-byte
# aligned pointers, integer arguments divisible by 16 except M), in a process without the interpreter.
_COMPILE_FOR_HOPPER = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from plugins import gemm_decode as G, quant_gemm_decode_kernels as K

def compile_one(kernel, pointers, constants, num_warps=4, num_stages=2):
    signature = {}
    for name in kernel.arg_names:
        signature[name] = "constexpr" if name in constants else pointers.get(name, "i32")
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
             if name not in constants and name != "M"}
    triton.compile(ASTSource(kernel, signature, constexprs=constants, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": num_warps, "num_stages": num_stages})

def pointers(x, w, scale="*fp32", zero=None):
    p = {"x_ptr": x, "w_ptr": w, "scale_ptr": scale, "out_ptr": x, "part_ptr": "*fp32", "lock_ptr": "*i32",
         "pqs_ptr": "*fp32"}
    if zero:
        p["zero_ptr"] = zero
    return p

# PDL on: griddepcontrol compiles for sm_90 (the launch option itself is only a runtime attribute).
gemv = {"BLOCK_N": 32, "BLOCK_K": 256, "SPLIT_K": 2, "PDL": True}
dot = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 2, "PRECISION": "tf32", "PDL": True}
cases = []
for x in ("*bf16", "*fp16"):
    for rows, even, prefetch in ((1, True, True), (2, False, False)):
        rows_c = {"ROWS": rows, "BLOCK_M": rows, "EVEN_K": even, "PREFETCH": prefetch}
        cases += [
            ("w8a16 gemv", K._w8a16_gemv_kernel, pointers(x, "*i32"), {**gemv, **rows_c}),
            ("w4a16 gemv", K._w4a16_gemv_kernel, pointers(x, "*i32", "*fp16", "*fp16"),
             {**gemv, **rows_c, "GROUP": 128, "HAS_PQS": True, "CHUNK": 128, "THREAD_K": 0}),
            ("w4a16 gemv, thread sums", K._w4a16_gemv_kernel, pointers(x, "*i32", "*fp16", "*fp16"),
             {**gemv, **rows_c, "GROUP": 128, "HAS_PQS": True, "CHUNK": 128, "THREAD_K": 32}),
            ("fp8 gemv", K._float_gemv_kernel, pointers(x, "*fp8e4nv"), {**gemv, **rows_c, "SCALED": True,
                                                                          "THREAD_K": 0}),
            ("fp8 gemv, thread sums", K._float_gemv_kernel, pointers(x, "*fp8e4nv"),
             {**gemv, **rows_c, "SCALED": True, "THREAD_K": 16}),
            ("dense gemv", K._float_gemv_kernel, pointers(x, x), {**gemv, **rows_c, "SCALED": False, "THREAD_K": 0}),
            ("dense gemv, thread sums", K._float_gemv_kernel, pointers(x, x),
             {**gemv, **rows_c, "SCALED": False, "THREAD_K": 8}),
        ]
    cases += [
        ("w8a16 dot", K._weight_dot_kernel, pointers(x, "*i8"), {**dot, "PER_CHANNEL": True}),
        ("w4a16 dot", K._w4a16_dot_kernel, pointers(x, "*i32", "*fp16", "*fp16"),
         {**dot, "GROUP": 128, "HAS_PQS": True, "EVEN_K": x == "*bf16", "ONE_DOT": False}),
        ("w4a16 dot, one dot of 64 rows", K._w4a16_dot_kernel, pointers(x, "*i32", "*fp16", "*fp16"),
         {**dot, "BLOCK_M": 64, "GROUP": 128, "HAS_PQS": True, "EVEN_K": x == "*bf16", "ONE_DOT": True}),
        ("w4a16 dot bytes", K._w4a16_dot_bytes_kernel, pointers(x, "*u8", "*fp16", "*fp16"),
         {**dot, "BLOCK_K": 64, "GROUP": 64, "HAS_PQS": False}),
        ("fp8 dot", K._weight_dot_kernel, pointers(x, "*fp8e4nv"), {**dot, "SPLIT_K": 1, "PER_CHANNEL": False}),
    ]
failed = {}
for name, kernel, ptrs, constants in cases:
    try:
        compile_one(kernel, ptrs, constants)
    except Exception as exc:
        failed[f"{name} {ptrs['x_ptr']} {constants}"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
print(json.dumps({"compiled": len(cases) - len(failed), "failed": failed}))
"""


@pytest.mark.timeout(300)
def test_decode_kernels_compile_for_hopper():
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from importlib.util import find_spec

    if find_spec("triton.backends.nvidia") is None:
        pytest.skip("Triton's NVIDIA backend is not installed")
    repo = Path(__file__).resolve().parent.parent
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_FOR_HOPPER], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=280)
    if proc.returncode != 0 and "ptxas" in proc.stderr:
        pytest.skip(f"no ptxas to compile with: {proc.stderr[-500:]}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not report["failed"], report["failed"]
    assert report["compiled"] == 38  # 2 dtypes x (7 GEMVs x 2 specializations + 5 tl.dot kernels)
