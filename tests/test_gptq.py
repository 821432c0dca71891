"""GPTQ rounding: against the step-by-step Optimal Brain update it reorganises, on every grid, in every module."""

from __future__ import annotations

import pytest
import torch

from executor_svc.quantization.gptq import fp8_tensor_grid, gptq_round, int4_group_grid, int8_channel_grid, output_error
from executor_svc.quantization.linear import Fp8Linear, Int4AWQLinear, Int8WeightOnlyLinear, SmoothQuantLinear
from executor_svc.quantization.quantize import (
    dequantize_fp8, dequantize_int4_groupwise, dequantize_int8_per_channel, fp8_tensor_scale, int4_group_params,
    int8_channel_scales,
)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _inputs(rows: int, features: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Correlated inputs with a few loud channels, like a transformer's: what GPTQ has to exploit.

    One distribution per width (the mixing is fixed); ``seed`` draws the rows.
    """
    mixing = torch.randn(features, features, generator=_gen(100), dtype=dtype) / features**0.5
    mixing += torch.eye(features, dtype=dtype)
    x = torch.randn(rows, features, generator=_gen(seed), dtype=dtype) @ mixing
    x[:, :: max(1, features // 8)] *= 6.0
    return x


def _grids(weight: torch.Tensor) -> dict:
    return {
        "fp8": fp8_tensor_grid(fp8_tensor_scale(weight)),
        "int8": int8_channel_grid(int8_channel_scales(weight)),
        "int4": int4_group_grid(*int4_group_params(weight, 32), 32, weight.shape[1]),
    }


def _step_by_step(weight: torch.Tensor, hessian: torch.Tensor, grid, damp: float) -> torch.Tensor:
    """GPTQ as the Optimal Brain update it is built on: explicit H^-1, one channel at a time, the
    rounded channel eliminated from H^-1 after each step. No Cholesky factor, no blocks."""
    w = weight.clone()
    h = hessian.clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    order = torch.argsort(h.diagonal(), descending=True, stable=True).tolist()
    h += damp * h.diagonal().mean() * torch.eye(h.shape[0], dtype=h.dtype)
    h_inv = torch.linalg.inv(h)
    q = torch.zeros_like(w)
    for j in order:
        q[:, j] = grid.round(w[:, j : j + 1], slice(j, j + 1))[:, 0]
        err = (w[:, j] - q[:, j]) / h_inv[j, j]
        w -= err[:, None] * h_inv[j][None, :]
        h_inv -= torch.outer(h_inv[:, j], h_inv[j]) / h_inv[j, j]
    return q


@pytest.mark.parametrize("block_size", [16, 40, 128])
def test_blocked_cholesky_gptq_equals_the_step_by_step_update(block_size):
    weight = torch.randn(12, 96, generator=_gen(0), dtype=torch.float64)
    x = _inputs(400, 96, seed=1, dtype=torch.float64)
    hessian = x.t() @ x
    grid = int4_group_grid(*int4_group_params(weight, 32), 32, 96)
    found = gptq_round(weight, hessian, grid, damp=0.01, block_size=block_size)
    expected = _step_by_step(weight, hessian, grid, damp=0.01)
    assert torch.allclose(found.weight, expected, rtol=0, atol=1e-9)
    assert found.error == pytest.approx(float((x @ (weight - expected).t()).pow(2).sum()), rel=1e-9)


@pytest.mark.parametrize("kind", ["fp8", "int8", "int4"])
def test_gptq_lands_on_the_grid_with_less_output_error_than_nearest(kind):
    weight = torch.randn(64, 128, generator=_gen(2)) * 0.05
    x = _inputs(1024, 128, seed=3)
    hessian = x.t() @ x
    grid = _grids(weight)[kind]
    found = gptq_round(weight, hessian, grid)
    assert torch.equal(grid.round(found.weight, slice(None)), found.weight)
    nearest = grid.round(weight, slice(None))
    assert found.nearest_error == pytest.approx(float((x @ (weight - nearest).t()).pow(2).sum()), rel=1e-3)
    assert found.error == pytest.approx(output_error(weight - found.weight, hessian), rel=1e-6)
    assert found.error_ratio < 0.8  # the calibration rows' output error drops by at least a fifth
    # On inputs it never saw from the same distribution, the gain holds.
    fresh = _inputs(1024, 128, seed=30)
    assert (fresh @ (weight - found.weight).t()).pow(2).sum() < (fresh @ (weight - nearest).t()).pow(2).sum()


def test_channels_the_calibration_never_fed_are_rounded_to_nearest():
    weight = torch.randn(16, 64, generator=_gen(4))
    x = _inputs(256, 64, seed=5)
    x[:, [3, 40]] = 0.0
    grid = int8_channel_grid(int8_channel_scales(weight))
    found = gptq_round(weight, x.t() @ x, grid)
    assert torch.isfinite(found.weight).all()
    for j in (3, 40):
        assert torch.equal(found.weight[:, j], grid.round(weight, slice(None))[:, j])


def test_hessian_of_the_wrong_size_is_rejected():
    with pytest.raises(ValueError, match="does not match a weight of 8 input channels"):
        gptq_round(torch.zeros(4, 8), torch.eye(6), int8_channel_grid(torch.ones(4)))


class _Recorder:
    """A rounding that remembers what it returned, to compare with what the module stores."""

    def __init__(self, hessian: torch.Tensor) -> None:
        self.hessian = hessian
        self.weight: torch.Tensor | None = None

    def __call__(self, weight: torch.Tensor, grid) -> torch.Tensor:
        self.weight = gptq_round(weight, self.hessian, grid).weight
        return self.weight


def _no_kernel(*args):
    raise AssertionError("from_float must not run the GEMM")


def test_each_module_stores_exactly_the_weights_gptq_chose():
    weight = torch.randn(32, 64, generator=_gen(6)) * 0.1
    x = _inputs(512, 64, seed=7)
    hessian = x.t() @ x

    rounding = _Recorder(hessian)
    fp8 = Fp8Linear.from_float(weight, _no_kernel, rounding=rounding)
    assert torch.equal(dequantize_fp8(fp8.weight, fp8.weight_scale), rounding.weight)
    assert torch.equal(fp8.weight_scale, fp8_tensor_scale(weight))  # the grid is the nearest-rounding one

    rounding = _Recorder(hessian)
    int8 = Int8WeightOnlyLinear.from_float(weight, _no_kernel, rounding)
    assert torch.equal(dequantize_int8_per_channel(int8.qweight, int8.scales), rounding.weight)

    smoothing = torch.rand(64, generator=_gen(8)) + 0.5
    rounding = _Recorder(hessian / smoothing[:, None] / smoothing[None, :])
    sq = SmoothQuantLinear.from_float(weight, _no_kernel, smoothing=smoothing, rounding=rounding)
    assert torch.equal(dequantize_int8_per_channel(sq.qweight, sq.scales), rounding.weight)

    awq_scale = torch.rand(64, generator=_gen(9)) + 0.5
    clip = torch.full((32, 2), 0.9)
    rounding = _Recorder(hessian / awq_scale[:, None] / awq_scale[None, :])
    int4 = Int4AWQLinear.from_float(weight, _no_kernel, 32, awq_scale, clip, rounding)
    stored = dequantize_int4_groupwise(int4.qweight, int4.scales, int4.zeros, 32)
    assert torch.allclose(stored, rounding.weight, rtol=0, atol=1e-6)
    scales, zeros = int4_group_params(weight * awq_scale[None, :], 32, clip)  # the clipped AWQ grid, unchanged
    assert torch.equal(int4.scales, scales) and torch.equal(int4.zeros, zeros)
