"""Programmatic dependent launch: off where it cannot work, and on the GPU a chain of decode kernels
launched with it gives bit-for-bit what the same chain gives launched the ordinary way."""

from __future__ import annotations

import pytest
import torch

from plugins import pdl
from tests.conftest import TEST_DEVICE

triton = pytest.importorskip("triton")


def test_pdl_is_off_on_the_cpu_whatever_is_asked():
    cpu = torch.device("cpu")
    assert not pdl.pdl_enabled(cpu)
    with pdl.forced(True):
        assert not pdl.pdl_enabled(cpu)
    assert pdl.pdl_launch_args(cpu) == {"PDL": False}


def test_forced_overrides_the_environment_and_restores(monkeypatch):
    monkeypatch.setattr(pdl, "pdl_supported", lambda device: True)
    monkeypatch.setenv("INFLIGHT_PDL", "0")
    gpu = torch.device("cuda", 0)
    assert not pdl.pdl_enabled(gpu)
    with pdl.forced(True):
        assert pdl.pdl_enabled(gpu)
        assert pdl.pdl_launch_args(gpu) == {"PDL": True, "launch_pdl": True}
        with pdl.forced(False):
            assert not pdl.pdl_enabled(gpu)
        assert pdl.pdl_enabled(gpu)
    assert not pdl.pdl_enabled(gpu)
    monkeypatch.setenv("INFLIGHT_PDL", "1")
    assert pdl.pdl_enabled(gpu)


def _decode_chain(x, weights, eps=1e-5):
    """A few decoder MLP blocks at one row, through the Triton kernels a batch-1 step runs."""
    from plugins.activation_triton import act_and_mul_triton
    from plugins.gemm_decode import linear_gemv
    from plugins.norm_triton import rms_norm_triton

    residual = None
    for norm_weight, gate_up, down in weights:
        h, residual = rms_norm_triton(x, norm_weight, eps, residual)
        residual = x if residual is None else residual
        x = linear_gemv(act_and_mul_triton(linear_gemv(h, gate_up)), down)
    return rms_norm_triton(x, weights[0][0], eps, residual)[0]


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="needs a GPU")
def test_pdl_chain_in_a_cuda_graph_matches_ordinary_launches():
    device = torch.device("cuda")
    if not pdl.pdl_supported(device):
        pytest.skip("this GPU or Triton has no programmatic dependent launch")
    gen = torch.Generator(device=device).manual_seed(0)
    hidden, intermediate = 2048, 5632
    weights = [
        (torch.rand(hidden, generator=gen, device=device, dtype=torch.bfloat16) + 0.5,
         torch.randn(2 * intermediate, hidden, generator=gen, device=device, dtype=torch.bfloat16) * 0.02,
         torch.randn(hidden, intermediate, generator=gen, device=device, dtype=torch.bfloat16) * 0.02)
        for _ in range(4)
    ]
    x = torch.randn(1, hidden, generator=gen, device=device, dtype=torch.bfloat16)
    with pdl.forced(False):
        expected = _decode_chain(x, weights)
    with pdl.forced(True):
        assert torch.equal(_decode_chain(x, weights), expected)  # eager, compiles the PDL variants
        static_x = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _decode_chain(static_x, weights)
    for seed in range(20):
        new_x = torch.randn(1, hidden, generator=gen, device=device, dtype=torch.bfloat16)
        with pdl.forced(False):
            want = _decode_chain(new_x, weights)
        static_x.copy_(new_x)
        graph.replay()
        assert torch.equal(out, want), f"replay {seed}"
