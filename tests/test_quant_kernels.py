"""Quantization primitives and quantized GEMM kernels against their references.

Triton kernels run under Triton's interpreter on the CPU (small shapes) and for
real on a GPU (INFLIGHT_TEST_DEVICE=cuda); tests/conftest.py sets TRITON_INTERPRET.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from executor_svc.quantization import quantize as qz
from executor_svc.quantization.linear import Fp8Linear, Int4AWQLinear, Int8WeightOnlyLinear, SmoothQuantLinear
from plugins.quant_gemm_torch import gemm_fp8, gemm_w4a16, gemm_w8a8, gemm_w8a16
from plugins.registry import get_kernel
from tests.conftest import TEST_DEVICE

DEVICE = torch.device(TEST_DEVICE)


def _randn(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(DEVICE)


# -- quantize / dequantize ---------------------------------------------------------


def test_int8_per_channel_error_is_at_most_half_a_step():
    w = _randn(48, 96)
    w[3, 7] = 40.0  # an outlier coarsens only its own row
    q, scales = qz.quantize_int8_per_channel(w)
    assert q.dtype == torch.int8 and scales.shape == (48,)
    err = (qz.dequantize_int8_per_channel(q, scales) - w).abs()
    assert (err <= scales[:, None] / 2 + 1e-6).all()
    assert err[3].max() > 10 * err[4].max()


@pytest.mark.parametrize("in_features, group_size", [(256, 128), (576, 128), (96, 32)])
def test_int4_groups_round_trip_within_half_a_step(in_features, group_size):
    w = _randn(40, in_features, seed=in_features)
    packed, scales, zeros = qz.quantize_int4_groupwise(w, group_size)
    groups = -(-in_features // group_size)  # 576 / 128: a short last group of 64
    assert packed.shape == (40, in_features // 2) and packed.dtype == torch.uint8
    assert scales.shape == zeros.shape == (40, groups) and scales.dtype == torch.float16
    codes = qz.unpack_int4(packed)
    assert codes.max() <= 15 and torch.equal(qz.pack_int4(codes), packed)
    assert ((zeros >= 0) & (zeros <= 15) & (zeros == zeros.round())).all()
    dq = qz.dequantize_int4_groupwise(packed, scales, zeros, group_size)
    step = scales.float().repeat_interleave(group_size, dim=1)[:, :in_features]
    assert ((dq - w).abs() <= step / 2 + 1e-5).all()
    torch.testing.assert_close(qz.fake_quantize_int4(w, group_size), dq)


def test_float_int4_zeros_reproduce_a_grid_that_does_not_hold_zero():
    """Weights on a Q4_1-style grid (each group of 32: codes 0..15 times a step, plus an offset that
    is no multiple of it) come back from float zeros to float16 precision; whole-code zeros, whose
    grid must hold 0, cannot follow them."""
    gen = torch.Generator().manual_seed(3)
    out, groups, size = 24, 6, 32
    codes = torch.randint(0, 16, (out, groups, size), generator=gen)
    codes[:, :, 0], codes[:, :, 1] = 0, 15  # every group uses its whole range, as a Q4_1 quantizer leaves it
    step = (torch.rand(out, groups, 1, generator=gen) * 0.01 + 0.001).half().float()
    offset = (-step * (torch.rand(out, groups, 1, generator=gen) * 12 + 1.5)).half().float()
    w = (codes * step + offset).reshape(out, groups * size).to(DEVICE)
    packed, scales, zeros = qz.quantize_int4_groupwise(w, size, float_zeros=True)
    dq = qz.dequantize_int4_groupwise(packed, scales, zeros, size)
    steps = step.reshape(out, groups).repeat_interleave(size, dim=1).to(DEVICE)
    assert ((dq - w).abs() <= steps * 0.01).all()  # float16 scales and zeros: a hundredth of a step at most
    assert not torch.equal(zeros, zeros.round())
    torch.testing.assert_close(qz.fake_quantize_int4(w, size, float_zeros=True), dq)
    integer = qz.fake_quantize_int4(w, size)
    assert ((integer - w).abs() > steps * 0.1).float().mean() > 0.3


def test_float_int4_zeros_stay_finite_and_clip_towards_the_middle():
    w = torch.full((2, 32), 3.0, device=DEVICE)
    w[0, :16] += 1e-4  # a narrow range far from 0: its zero would pass float16's range at the finest step
    w[1] = torch.linspace(1.0, 2.0, 32)
    scales, zeros = qz.int4_group_params(w, 32, float_zeros=True)
    assert torch.isfinite(zeros).all() and zeros.abs().max() <= qz.FLOAT_ZERO_LIMIT
    err = (qz.fake_quantize_int4(w, 32, float_zeros=True) - w).abs()
    assert err[0].max() <= 3.0 / qz.FLOAT_ZERO_LIMIT and err[1].max() <= 1 / 30 + 1e-3
    clipped = qz.fake_quantize_int4(w[1:], 32, torch.full((1, 1), 0.5, device=DEVICE), float_zeros=True)
    assert clipped.min().item() == pytest.approx(1.25, abs=1e-3)
    assert clipped.max().item() == pytest.approx(1.75, abs=1e-3)


def test_int4_packing_puts_even_channels_in_the_low_nibble():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    assert qz.pack_int4(codes).tolist() == [[0x21, 0x0F]]


def test_fp8_per_tensor_relative_error():
    w = _randn(64, 128)
    q, scale = qz.quantize_fp8_per_tensor(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (1,)
    dq = qz.dequantize_fp8(q, scale)
    normal = w.abs() > 2**-6 * scale  # E4M3 has 3 mantissa bits for normal numbers: rounding within 2**-4
    assert ((dq - w).abs()[normal] <= w.abs()[normal] * 2**-4 + 1e-7).all()
    assert dq.abs().max().item() == pytest.approx(w.abs().max().item(), rel=1e-6)  # the largest value maps to 448 exactly


def test_per_token_activation_scales():
    x = _randn(5, 64)
    x[2] *= 100  # one loud token does not coarsen the others
    q, s = qz.quantize_int8_per_token(x)
    assert s.shape == (5, 1)
    assert ((q.float() * s - x).abs() <= s / 2 + 1e-6).all()
    q8, s8 = qz.quantize_fp8_per_token(x)
    assert (q8.float().abs().amax(dim=1) == qz.FP8_MAX).all()


# -- kernels against references ----------------------------------------------------

SHAPES = [(1, 192, 64), (7, 576, 96), (33, 256, 136)] + ([(256, 4096, 4096)] if TEST_DEVICE == "cuda" else [])
DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if TEST_DEVICE == "cuda" else [])
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-3}


def _close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(out.float(), expected.float(), atol=TOL[dtype] * scale, rtol=TOL[dtype])


def test_references_approximate_the_float_product():
    x, w = _randn(9, 256, seed=1), _randn(64, 256, seed=2, scale=0.05)
    exact = x @ w.t()

    def rel(out: torch.Tensor) -> float:
        return ((out - exact).norm() / exact.norm()).item()

    assert rel(gemm_w8a16(x, *qz.quantize_int8_per_channel(w))) < 0.01
    assert rel(gemm_w4a16(x, *qz.quantize_int4_groupwise(w, 64), 64)) < 0.1
    assert rel(gemm_w8a8(*qz.quantize_int8_per_token(x), *qz.quantize_int8_per_channel(w), torch.float32)) < 0.02
    assert rel(gemm_fp8(*qz.quantize_fp8_per_token(x), *qz.quantize_fp8_per_tensor(w), torch.float32)) < 0.05


def test_w8a8_reference_is_the_integer_product():
    xq = torch.randint(-127, 128, (6, 64), dtype=torch.int8)
    wq = torch.randint(-127, 128, (16, 64), dtype=torch.int8)
    xs, ws = torch.rand(6, 1) + 0.5, torch.rand(16) + 0.5
    integer = (xq.long() @ wq.long().t()).double()
    expected = integer * xs.double() * ws.double()[None, :]
    torch.testing.assert_close(gemm_w8a8(xq, xs, wq, ws, torch.float64), expected, rtol=1e-6, atol=1e-6)


def test_int_mm_kernel_matches_reference():
    spec = get_kernel("gemm_w8a8", "int_mm", DEVICE, torch.float32)
    for rows in (1, 17, 40):  # below 17 rows cuBLAS needs padding
        x, w = _randn(rows, 128, seed=rows), _randn(64, 128, seed=99)
        args = (*qz.quantize_int8_per_token(x), *qz.quantize_int8_per_channel(w), torch.float32)
        torch.testing.assert_close(spec.fn(*args), gemm_w8a8(*args), rtol=1e-5, atol=1e-4)


def test_scaled_mm_kernel_matches_reference():
    from plugins.quant_gemm_scaled_mm import gemm_fp8_scaled_mm, scaled_mm_supported

    if TEST_DEVICE == "cuda" and not scaled_mm_supported(DEVICE):
        pytest.skip("FP8 needs compute capability 8.9")
    x, w = _randn(8, 128, seed=3), _randn(64, 128, seed=4)
    wq, ws = qz.quantize_fp8_per_tensor(w)
    per_token = qz.quantize_fp8_per_token(x)
    static_scale = (x.abs().max() / qz.FP8_MAX).reshape(1)
    per_tensor = (qz.quantize_fp8_static(x, static_scale), static_scale)
    for xq, xs in (per_token, per_tensor):
        expected = gemm_fp8(xq, xs, wq, ws, torch.bfloat16)
        try:
            out = gemm_fp8_scaled_mm(xq, xs, wq, ws, torch.bfloat16)
        except RuntimeError as exc:  # CPU builds of torch without FP8 matmul
            pytest.skip(f"torch._scaled_mm cannot run here: {exc}")
        _close(out, expected, torch.bfloat16)


def test_scaled_mm_makes_a_weight_scales_column_row_once_and_again_after_it_changes():
    import gc

    from plugins import quant_gemm_scaled_mm as scaled_mm

    scale = torch.tensor([0.5], device=DEVICE)
    row = scaled_mm._column_scales(scale, 32)
    assert row.shape == (1, 32) and row.is_contiguous() and torch.all(row == 0.5)
    assert scaled_mm._column_scales(scale, 32) is row  # no copy per call
    scale.fill_(2.0)  # a reload writes the scale in place
    assert torch.all(scaled_mm._column_scales(scale, 32) == 2.0)
    key = id(scale)
    del scale
    gc.collect()
    assert key not in scaled_mm._COLUMN_SCALES  # forgotten with its weight


triton_kernels = pytest.importorskip("plugins.quant_gemm_triton")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_w8a16_triton_matches_reference(shape, dtype):
    m, k, n = shape
    x, w = _randn(m, k, seed=m).to(dtype), _randn(n, k, seed=n, scale=k**-0.5)
    q, scales = qz.quantize_int8_per_channel(w)
    _close(triton_kernels.gemm_w8a16_triton(x, q, scales), gemm_w8a16(x, q, scales), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("group_size, with_scale", [(128, True), (64, False), (32, True)])
def test_w4a16_triton_matches_reference(shape, dtype, group_size, with_scale):
    m, k, n = shape
    x, w = _randn(m, k, seed=m).to(dtype), _randn(n, k, seed=n, scale=k**-0.5)
    packed, scales, zeros = qz.quantize_int4_groupwise(w, group_size)
    pqs = (torch.rand(k, generator=torch.Generator().manual_seed(k)) + 0.5).to(DEVICE) if with_scale else None
    out = triton_kernels.gemm_w4a16_triton(x, packed, scales, zeros, group_size, pqs)
    _close(out, gemm_w4a16(x, packed, scales, zeros, group_size, pqs), dtype)


@pytest.mark.parametrize("group_size", [128, 32])
def test_w4a16_triton_reads_scales_laid_out_by_group(group_size):
    """A loaded engine holds INT4 scales and zeros [groups, N] in memory (Int4AWQLinear.store_scales_by_group)."""
    m, k, n = SHAPES[-1]
    x, w = _randn(m, k, seed=m), _randn(n, k, seed=n, scale=k**-0.5)
    packed, scales, zeros = qz.quantize_int4_groupwise(w, group_size, float_zeros=True)
    by_group = scales.t().contiguous().t(), zeros.t().contiguous().t()
    assert by_group[0].stride() == (1, n)
    out = triton_kernels.gemm_w4a16_triton(x, packed, *by_group, group_size)
    _close(out, gemm_w4a16(x, packed, scales, zeros, group_size), torch.float32)
    with pytest.raises(ValueError, match="share one layout"):
        triton_kernels.gemm_w4a16_triton(x, packed, by_group[0], zeros, group_size)


def test_registry_places_each_kernel_where_it_runs():
    cpu = torch.device("cpu")
    for kind in ("gemm_w8a16", "gemm_w4a16", "gemm_w8a8", "gemm_fp8"):
        get_kernel(kind, "torch", cpu, torch.float32)  # every format computes on the CPU
    for kind, name in (("gemm_w8a16", "triton"), ("gemm_w4a16", "triton"), ("gemm_fp8", "scaled_mm")):
        with pytest.raises(ValueError, match="cannot run on cpu"):
            get_kernel(kind, name, cpu, torch.float32)
    assert get_kernel("gemm_w8a8", "int_mm", cpu, torch.float32).fn is not None  # torch._int_mm exists in 2.13


# -- the quantized Linear modules --------------------------------------------------


def _modules(w: torch.Tensor, x: torch.Tensor) -> dict[str, torch.nn.Module]:
    ref = lambda kind: get_kernel(kind, "torch", DEVICE, torch.float32).fn  # noqa: E731
    input_scale = torch.rand(w.shape[1], generator=torch.Generator().manual_seed(5)).to(DEVICE) + 0.5
    return {
        "w8a16": Int8WeightOnlyLinear.from_float(w, ref("gemm_w8a16")),
        "awq": Int4AWQLinear.from_float(w, ref("gemm_w4a16"), 64, input_scale),
        "sq": SmoothQuantLinear.from_float(w, ref("gemm_w8a8"), smoothing=input_scale),
        "fp8": Fp8Linear.from_float(w, ref("gemm_fp8")),
        "fp8_static": Fp8Linear.from_float(w, ref("gemm_fp8"), x.abs().max() / qz.FP8_MAX),
    }


def test_quantized_modules_approximate_the_linear_and_reload_from_their_state():
    x, w = _randn(6, 128, seed=6), _randn(80, 128, seed=7, scale=128**-0.5)
    exact = F.linear(x, w)
    bounds = {"w8a16": 0.01, "awq": 0.12, "sq": 0.02, "fp8": 0.05, "fp8_static": 0.06}
    for name, module in _modules(w, x).items():
        out = module(x)
        assert ((out - exact).norm() / exact.norm()).item() < bounds[name], name
        # An empty module of the same format filled from the state dict computes the same thing.
        empty = {
            "w8a16": lambda: Int8WeightOnlyLinear(128, 80, module.kernel),
            "awq": lambda: Int4AWQLinear(128, 80, module.kernel, 64),
            "sq": lambda: SmoothQuantLinear(128, 80, module.kernel, pre_quant_scale=True),
            "fp8": lambda: Fp8Linear(128, 80, module.kernel, static_input_scale=False),
            "fp8_static": lambda: Fp8Linear(128, 80, module.kernel, static_input_scale=True),
        }[name]().to(DEVICE)
        empty.load_state_dict(module.state_dict(), strict=True)
        assert torch.equal(empty(x), out), name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(0, 64), (1, 64), (5, 300), (3, 4500)] + ([(1024, 14336)] if TEST_DEVICE == "cuda" else []))
def test_fused_fp8_per_token_quantization_equals_the_reference(shape, dtype):
    """The one-kernel per-token FP8 quantization stores the reference's bytes and scales, also for rows
    longer than one block, an all-zero row, and values that saturate or round at E4M3's grid edges."""
    pytest.importorskip("triton")
    from plugins.quant_activation_triton import quantize_fp8_per_token_triton

    gen = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    x = (torch.randn(shape, generator=gen) * torch.logspace(-3, 3, shape[0] or 1)[: shape[0], None]).to(DEVICE, dtype)
    if shape[0] > 1:
        x[1] = 0  # an all-zero row gets the minimum scale
    if shape[0]:
        x[-1, 0] = -x[-1].abs().max() * 1e-7  # rounds to -0.0, which must keep its sign
    q, scales = quantize_fp8_per_token_triton(x)
    q_ref, scales_ref = qz.quantize_fp8_per_token_reference(x)
    assert torch.equal(scales, scales_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    strided = x.t().contiguous().t()  # the dispatcher copies a column-major view first
    if shape[0]:
        assert torch.equal(qz.quantize_fp8_per_token(strided)[0].view(torch.uint8), q_ref.view(torch.uint8))


def test_int4_tactics_are_timed_with_the_engines_group_size(monkeypatch):
    """A build times the INT4 GEMV tiles with its own group size: the best tile differs between 32 and 128."""
    from executor_svc.build_config import BuildConfig, QuantConfig
    from executor_svc.model.config import ModelConfig
    from executor_svc.quantization import kernel_choice

    asked = []
    monkeypatch.setattr(kernel_choice, "tune_tactics", lambda kind, *args, **weight_format: asked.append(
        (kind, weight_format)) or {})
    model = ModelConfig("tiny", "LlamaForCausalLM", 256, 64, 128, 1, 4, 2, 16, 1e-5, 10000.0, None, 256, False)
    for quant, expected in ((QuantConfig("W4A16_AWQ", group_size=32), {"group_size": 32}), (QuantConfig("FP8"), {})):
        asked.clear()
        kernel_choice.select_quant_plugins(model, BuildConfig(quant_config=quant), torch.device("cpu"), torch.float32)
        assert asked == [(kernel_choice.ALGO_FORMATS[quant.quant_algo][0], expected)]
