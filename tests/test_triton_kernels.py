"""Triton kernels against their torch references: under Triton's interpreter on
the CPU (small shapes, CI), and for real on a GPU (INFLIGHT_TEST_DEVICE=cuda)."""

from __future__ import annotations

import pytest
import torch

from plugins.norm_torch import rms_norm
from tests.conftest import TEST_DEVICE

triton = pytest.importorskip("triton")
from plugins.norm_triton import rms_norm_triton  # noqa: E402

DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if TEST_DEVICE == "cuda" else [])
SHAPES = [(1, 64), (7, 576), (3, 640)] + ([(4096, 4096), (257, 5120)] if TEST_DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
def test_rms_norm_triton_matches_reference(dtype, shape, with_residual, weight_offset):
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=gen).to(TEST_DEVICE, dtype)
    weight = torch.randn(shape[1], generator=gen).to(TEST_DEVICE, dtype)
    residual = torch.randn(shape, generator=gen).to(TEST_DEVICE, dtype) if with_residual else None
    expected, expected_residual = rms_norm(x, weight, 1e-6, residual, weight_offset)
    out, out_residual = rms_norm_triton(x, weight, 1e-6, residual, weight_offset)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    if with_residual:
        assert torch.equal(out_residual, expected_residual)
    else:
        assert out_residual is None


def test_triton_kernel_is_registered_for_cuda_only():
    from plugins import get_kernel

    with pytest.raises(ValueError, match="cannot run on cpu"):
        get_kernel("rmsnorm", "triton", torch.device("cpu"), torch.float32)
