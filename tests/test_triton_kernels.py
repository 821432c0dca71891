"""Triton kernels (RMSNorm, rope + KV-cache write, SwiGLU/GeGLU) against their
torch references: under Triton's interpreter on the CPU (small shapes, CI), and
for real on a GPU (INFLIGHT_TEST_DEVICE=cuda)."""

from __future__ import annotations

import pytest
import torch

from plugins.activation_torch import act_and_mul
from plugins.norm_torch import rms_norm
from plugins.rope_torch import apply_rope, rope_and_write_kv, rope_cos_sin, rope_inv_freq
from tests.conftest import TEST_DEVICE

triton = pytest.importorskip("triton")
from plugins.activation_triton import act_and_mul_triton  # noqa: E402
from plugins.norm_triton import rms_norm_triton  # noqa: E402
from plugins.rope_triton import rope_and_write_kv_triton  # noqa: E402

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


@pytest.mark.parametrize("kind", ["rmsnorm", "rope", "activation"])
def test_triton_kernel_is_registered_for_cuda_only(kind):
    from plugins import get_kernel

    with pytest.raises(ValueError, match="cannot run on cpu"):
        get_kernel(kind, "triton", torch.device("cpu"), torch.float32)
    if TEST_DEVICE == "cuda":
        assert get_kernel(kind, "triton", torch.device("cuda"), torch.bfloat16).fn is not None


# --------------------------------------------------------------------------- rope + KV-cache write

# The interpreter rounds float32 -> bfloat16 by truncation (the GPU rounds to
# nearest even), so bfloat16 is checked on the GPU only.
KERNEL_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if TEST_DEVICE == "cuda" else [])
# (tokens, heads, kv_heads, head_dim): GQA ratios 2 and 3, MQA, and on the GPU
# SmolLM2, Llama-3.1-8B and Gemma-3 head layouts.
ROPE_SHAPES = [(5, 4, 2, 16), (3, 3, 1, 8), (6, 6, 2, 32)] + (
    [(37, 9, 3, 64), (300, 32, 8, 128), (19, 4, 1, 256)] if TEST_DEVICE == "cuda" else []
)
TOKENS_PER_BLOCK = 4


def _rope_case(tokens: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, style: str, seed: int):
    """Inputs laid out as the model has them, with tokens scattered over the cache."""
    gen = torch.Generator().manual_seed(seed)
    # q, k, v are views into one fused projection output, as after the qkv GEMM.
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(TEST_DEVICE, dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)
    max_positions = 4 * tokens + 16
    cos, sin = (t.to(TEST_DEVICE) for t in rope_cos_sin(rope_inv_freq(dim, 10000.0), max_positions, style))
    positions = torch.randint(0, max_positions, (tokens,), generator=gen).to(TEST_DEVICE)
    # Twice the slots needed, shuffled: consecutive tokens land in unrelated blocks.
    num_blocks = 2 * -(-tokens // TOKENS_PER_BLOCK)
    slots = torch.randperm(num_blocks * TOKENS_PER_BLOCK, generator=gen)[:tokens].to(TEST_DEVICE)
    # Caches start full of other data, which the write must leave alone outside its slots.
    k_cache = torch.randn(num_blocks, TOKENS_PER_BLOCK, kv_heads, dim, generator=gen).to(TEST_DEVICE, dtype)
    v_cache = torch.randn(num_blocks, TOKENS_PER_BLOCK, kv_heads, dim, generator=gen).to(TEST_DEVICE, dtype)
    return q, k, v, cos, sin, positions, k_cache, v_cache, slots


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("shape", ROPE_SHAPES)
@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_rope_write_kv_triton_matches_reference(dtype, shape, style):
    q, k, v, cos, sin, positions, k_cache, v_cache, slots = _rope_case(*shape, dtype, style, seed=sum(shape))
    expected_k_cache, expected_v_cache = k_cache.clone(), v_cache.clone()
    expected_q = rope_and_write_kv(q, k, v, cos, sin, positions, expected_k_cache, expected_v_cache, slots, style)
    out_q = rope_and_write_kv_triton(q, k, v, cos, sin, positions, k_cache, v_cache, slots, style)
    # The kernel rounds every product and sum as the reference does: equal, not just close.
    assert out_q.shape == expected_q.shape and out_q.dtype == expected_q.dtype
    assert torch.equal(out_q, expected_q)
    assert torch.equal(k_cache, expected_k_cache)  # rotated k at the slots, everything else untouched
    assert torch.equal(v_cache, expected_v_cache)


def test_rope_write_kv_triton_skips_padding_slots():
    q, k, v, cos, sin, positions, k_cache, v_cache, slots = _rope_case(6, 4, 2, 16, torch.float32, "neox", seed=3)
    # Tokens 1 and 4 are padding: rotated q, no cache write (the real slots
    # avoid 0 and 1, where a misread -1 would land).
    slots = torch.tensor([9, -1, 14, 6, -1, 11], device=TEST_DEVICE)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    out_q = rope_and_write_kv_triton(q, k, v, cos, sin, positions, k_cache, v_cache, slots, "neox")
    assert torch.equal(out_q, apply_rope(q, k, cos, sin, positions, "neox")[0])
    real = slots >= 0
    rope_and_write_kv(q[real], k[real], v[real], cos, sin, positions[real], expected_k, expected_v, slots[real], "neox")
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_rope_rejects_unknown_style():
    q, k, v, cos, sin, positions, k_cache, v_cache, slots = _rope_case(2, 2, 1, 8, torch.float32, "neox", seed=0)
    with pytest.raises(ValueError, match="rope style"):
        rope_and_write_kv_triton(q, k, v, cos, sin, positions, k_cache, v_cache, slots, "llama")


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_rope_write_kv_triton_replays_in_a_cuda_graph():
    """Captured once, replayed on new positions and slots: no host sync, grid from shapes."""
    first = _rope_case(16, 32, 8, 128, torch.bfloat16, "neox", seed=1)
    static = [t.clone() for t in first]
    q, k, v, cos, sin, positions, k_cache, v_cache, slots = static
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        rope_and_write_kv_triton(q, k, v, cos, sin, positions, k_cache, v_cache, slots, "neox")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_q = rope_and_write_kv_triton(q, k, v, cos, sin, positions, k_cache, v_cache, slots, "neox")
    second = _rope_case(16, 32, 8, 128, torch.bfloat16, "neox", seed=2)
    for buffer, value in zip(static, second):
        buffer.copy_(value)
    graph.replay()
    s_q, s_k, s_v, s_cos, s_sin, s_positions, s_k_cache, s_v_cache, s_slots = second
    expected_q = rope_and_write_kv(s_q, s_k, s_v, s_cos, s_sin, s_positions, s_k_cache, s_v_cache, s_slots, "neox")
    assert torch.equal(out_q, expected_q)
    assert torch.equal(k_cache, s_k_cache) and torch.equal(v_cache, s_v_cache)


# --------------------------------------------------------------------------- SwiGLU / GeGLU

# (tokens, intermediate): less than one column block, a ragged last block, and
# on the GPU SmolLM2's, Gemma-3-270M's and Llama-3.1-8B's MLP widths.
ACTIVATION_SHAPES = [(1, 40), (3, 1100)] + ([(7, 1536), (5, 2048), (257, 14336)] if TEST_DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("shape", ACTIVATION_SHAPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_act_and_mul_triton_matches_reference(dtype, shape, activation):
    tokens, intermediate = shape
    gen = torch.Generator().manual_seed(tokens + intermediate)
    x = (3 * torch.randn(tokens, 2 * intermediate, generator=gen)).to(TEST_DEVICE, dtype)
    expected = act_and_mul(x, activation)
    out = act_and_mul_triton(x, activation)
    assert out.shape == expected.shape and out.dtype == dtype
    # float32 inside and one rounding at the end, where the reference rounds
    # after the activation and again after the product: up to about one ulp apart.
    tol = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


def test_act_and_mul_triton_tells_the_activations_apart():
    x = torch.randn(2, 64).to(TEST_DEVICE)
    assert not torch.allclose(act_and_mul_triton(x, "silu"), act_and_mul_triton(x, "gelu_tanh"), atol=1e-3)
    with pytest.raises(ValueError, match="activation must be one of"):
        act_and_mul_triton(x, "relu")
