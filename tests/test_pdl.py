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


def _attention_chain(x, norm_weight, cos, sin, positions, slots, k_cache, v_cache, meta, heads, kv_heads):
    """RMSNorm, then RoPE + KV write, then decode attention: RoPE and attention read the step's
    metadata before their wait for the kernel before them (plugins/pdl.py)."""
    from plugins.attention_triton import paged_attention_triton
    from plugins.norm_triton import rms_norm_triton
    from plugins.rope_triton import rope_and_write_kv_triton

    rows, head_dim = x.shape[0], k_cache.shape[-1]
    qkv = rms_norm_triton(x, norm_weight, 1e-5)[0].view(rows, heads + 2 * kv_heads, head_dim)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    q = rope_and_write_kv_triton(q, k, v, cos, sin, positions, k_cache, v_cache, slots)
    return paged_attention_triton(q, k_cache, v_cache, meta, head_dim**-0.5)


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="needs a GPU")
def test_rope_and_attention_reading_metadata_early_match_ordinary_launches():
    """Each replay's positions, slots, context lengths and block tables are copied in before it, as the
    runner does; RoPE and attention under PDL must see them and give what ordinary launches give."""
    from plugins.rope_torch import rope_cos_sin, rope_inv_freq
    from tests.test_triton_attention import LLAMA_8B, make_step

    device = torch.device("cuda")
    if not pdl.pdl_supported(device):
        pytest.skip("this GPU or Triton has no programmatic dependent launch")
    heads, kv_heads, head_dim, block = (LLAMA_8B[key] for key in ("heads", "kv_heads", "head_dim", "tokens_per_block"))
    requests = [(300, 1), (17, 1), (1000, 1), (64, 1)]
    meta = make_step(requests, seed=3, extra_table_blocks=2, **LLAMA_8B)[3]
    gen = torch.Generator(device=device).manual_seed(1)
    # A pool with a block of its own for every table entry: no two rows ever write one cache slot.
    pool = (meta.block_tables.numel() + 3, block, kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(pool, generator=gen, device=device, dtype=torch.bfloat16) for _ in range(2))
    cos, sin = (t.to(device) for t in rope_cos_sin(rope_inv_freq(head_dim, 500000.0), 2048))
    x = torch.randn(len(requests), (heads + 2 * kv_heads) * head_dim, generator=gen, device=device, dtype=torch.bfloat16)
    norm_weight = torch.rand(x.shape[1], generator=gen, device=device, dtype=torch.bfloat16) + 0.5
    positions = torch.zeros(len(requests), dtype=torch.int64, device=device)
    slots = torch.zeros_like(positions)
    caches = k_cache.clone(), v_cache.clone()

    def set_step(lens: list[int], tables: torch.Tensor) -> None:
        """The metadata of a step whose rows have these context lengths (their new token's included)."""
        meta.context_lens_t.copy_(torch.tensor(lens))
        meta.block_tables.copy_(tables)
        positions.copy_(torch.tensor([n - 1 for n in lens]))
        slots.copy_(torch.tensor([int(tables[r, (n - 1) // block]) * block + (n - 1) % block for r, n in enumerate(lens)]))
        k_cache.copy_(caches[0])
        v_cache.copy_(caches[1])

    def random_tables() -> torch.Tensor:  # distinct blocks everywhere
        return torch.randperm(k_cache.shape[0])[: meta.block_tables.numel()].view(meta.block_tables.shape)

    chain = lambda: _attention_chain(x, norm_weight, cos, sin, positions, slots, k_cache, v_cache, meta, heads,  # noqa: E731
                                     kv_heads)

    set_step([n for n, _ in requests], random_tables())
    with pdl.forced(True):
        chain()  # compiles the PDL variants
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain()
    torch.manual_seed(0)
    for step in range(10):
        lens, tables = torch.randint(1, meta.block_tables.shape[1] * block, (len(requests),)).tolist(), random_tables()
        set_step(lens, tables)
        with pdl.forced(False):
            want = chain().clone()
        set_step(lens, tables)
        graph.replay()
        assert torch.equal(out, want), f"step {step}"
