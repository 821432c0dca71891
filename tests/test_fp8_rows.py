"""Norm and activation kernels that hand an FP8 projection its input already quantized (plugins/fp8_rows.py).

The fused kernels must store exactly the bytes and scales that the projection's
own per-token quantizer makes of the unfused kernel's 16-bit output, so an FP8
engine computes the same tokens with or without the fusion. Triton kernels run
under the interpreter on the CPU (tests/conftest.py sets TRITON_INTERPRET) and
for real on a GPU (INFLIGHT_TEST_DEVICE=cuda).
"""

from __future__ import annotations

import pytest
import torch

from executor_svc.model.llama import RMSNorm, as_fp8_rows, gated_activation
from executor_svc.quantization import quantize as qz
from executor_svc.quantization.linear import Fp8Linear
from plugins.activation_torch import act_and_mul
from plugins.fp8_rows import Fp8Rows, fp8_rows_variant, wants_fp8_rows
from plugins.kernels import Kernels
from plugins.norm_torch import rms_norm
from plugins.registry import get_kernel
from tests.conftest import TEST_DEVICE

pytest.importorskip("triton")
from plugins import activation_triton  # noqa: E402
from plugins.activation_triton import act_and_mul_fp8_triton, act_and_mul_triton  # noqa: E402
from plugins.norm_triton import rms_norm_fp8_triton, rms_norm_triton  # noqa: E402

DEVICE = torch.device(TEST_DEVICE)
# Triton's interpreter handles bfloat16 as raw bits; bfloat16 is checked on the GPU.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if TEST_DEVICE == "cuda" else [])


def _rows(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows whose magnitudes span six decades, one of them all zero (it gets the minimum scale)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * torch.logspace(-3, 3, max(rows, 1))[:rows, None]
    if rows > 2:
        x[1] = 0
    return x.to(DEVICE, dtype)


def assert_same_fp8_rows(got: Fp8Rows, values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and got.values.dtype == torch.float8_e4m3fn
    assert torch.equal(got.scales, scales)
    assert torch.equal(got.values.view(torch.uint8), values.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden", [(0, 64), (1, 64), (5, 300)])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
def test_fused_norm_stores_what_the_projection_would_quantize(dtype, rows, hidden, with_residual, weight_offset):
    x = _rows(rows, hidden, dtype, seed=rows + hidden)
    residual = _rows(rows, hidden, dtype, seed=7) if with_residual else None
    weight = (torch.rand(hidden, generator=torch.Generator().manual_seed(3)) + 0.5).to(DEVICE, dtype)
    out, residual_out = rms_norm_triton(x, weight, 1e-6, residual, weight_offset)
    fused, fused_residual = rms_norm_fp8_triton(x, weight, 1e-6, residual, weight_offset)
    values, scales = qz.quantize_fp8_per_token_reference(out)
    assert_same_fp8_rows(fused, values, scales, dtype)
    assert (fused_residual is None) == (residual_out is None)
    if residual_out is not None:
        assert torch.equal(fused_residual, residual_out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, intermediate", [(0, 64), (1, 64), (4, 1500)])
@pytest.mark.parametrize("single_pass", [True, False])  # False: rows walked in two blocks of columns, twice
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's sigmoid of a large gate
def test_fused_activation_stores_what_the_projection_would_quantize(
    dtype, rows, intermediate, single_pass, activation, monkeypatch
):
    if not single_pass:
        monkeypatch.setattr(activation_triton, "SINGLE_PASS_COLUMNS", 512)
    x = _rows(rows, 2 * intermediate, dtype, seed=rows * 3 + intermediate) * 0.01  # gate and up near [-3, 3] x 10^k
    values, scales = qz.quantize_fp8_per_token_reference(act_and_mul_triton(x, activation))
    assert_same_fp8_rows(act_and_mul_fp8_triton(x, activation), values, scales, dtype)


def test_fused_activation_checks_its_input():
    with pytest.raises(ValueError, match="even last dimension"):
        act_and_mul_fp8_triton(torch.zeros(2, 5, device=DEVICE), "silu")
    with pytest.raises(ValueError, match="activation must be one of"):
        act_and_mul_fp8_triton(torch.zeros(2, 4, device=DEVICE), "relu")
    with pytest.raises(ValueError, match="expected"):
        act_and_mul_fp8_triton(torch.zeros(2, 2, 4, device=DEVICE), "silu")


def test_the_triton_kernels_carry_their_fused_variants_and_the_references_do_not():
    for dtype in (torch.float16, torch.bfloat16):
        assert fp8_rows_variant(rms_norm_triton, dtype) is rms_norm_fp8_triton
        assert fp8_rows_variant(act_and_mul_triton, dtype) is act_and_mul_fp8_triton
        assert fp8_rows_variant(rms_norm, dtype) is None and fp8_rows_variant(act_and_mul, dtype) is None
    # float32 rows take the projection's own quantizer (see fp8_rows_variant)
    assert fp8_rows_variant(rms_norm_triton, torch.float32) is None
    assert fp8_rows_variant(act_and_mul_triton, torch.float32) is None


def _fp8_projection(in_features: int, out_features: int, static: bool = False) -> Fp8Linear:
    kernel = get_kernel("gemm_fp8", "torch", DEVICE, torch.float32).fn
    weight = (torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(5)) * 0.05).to(DEVICE)
    return Fp8Linear.from_float(weight, kernel, torch.tensor(0.02) if static else None)


def test_only_a_dynamic_fp8_projection_past_its_weight_only_rows_asks_for_fp8_rows(monkeypatch):
    dynamic, static = _fp8_projection(64, 32), _fp8_projection(64, 32, static=True)
    assert wants_fp8_rows(dynamic, 3) and not wants_fp8_rows(static, 3)
    assert not wants_fp8_rows(torch.nn.Linear(64, 32), 3)  # a 16-bit projection
    monkeypatch.setattr(dynamic.kernel, "weight_only_rows", 4, raising=False)
    assert not wants_fp8_rows(dynamic, 4) and wants_fp8_rows(dynamic, 5)


def test_a_projection_given_fp8_rows_computes_what_it_computes_from_the_16bit_rows():
    projection = _fp8_projection(64, 32)
    x = _rows(6, 64, torch.float32, seed=11)
    assert torch.equal(projection(as_fp8_rows(x)), projection(x))


@pytest.mark.parametrize("fused", [False, True])
def test_model_norm_and_activation_hand_over_the_same_fp8_rows_with_or_without_a_fused_variant(fused):
    # Fused: the Triton kernels and their variants; unfused: the references, quantized by the model.
    names = {"rmsnorm": "triton", "activation": "triton"} if fused else {}
    kernels = Kernels(**{kind: (_triton(kind) if kind in names else get_kernel(kind, "torch", DEVICE, torch.float32).fn)
                         for kind in Kernels.__slots__})
    dtype = torch.float16  # the variants serve 16-bit rows (and the interpreter computes float16 exactly)
    norm = RMSNorm(64, 1e-6, kernels).to(DEVICE, dtype)
    x, residual = _rows(5, 64, dtype, seed=1), _rows(5, 64, dtype, seed=2)
    out, summed = norm(x, residual)
    rows, summed_too = norm(x, residual, fp8_rows=True)
    values, scales = qz.quantize_fp8_per_token(out)
    assert_same_fp8_rows(rows, values, scales, dtype)
    assert torch.equal(summed, summed_too)
    gate_up = _rows(5, 2 * 96, dtype, seed=3) * 0.01
    values, scales = qz.quantize_fp8_per_token(kernels.activation(gate_up, "silu"))
    assert_same_fp8_rows(gated_activation(kernels.activation, gate_up, "silu", fp8_rows=True), values, scales, dtype)


def _triton(kind: str):
    """The Triton kernel of ``kind`` (registered for CUDA only; the interpreter runs it on the CPU)."""
    return {"rmsnorm": rms_norm_triton, "activation": act_and_mul_triton}[kind]
