"""Reference kernels against independent formulations (transformers' own code
where it exists), and the registry's refusal to run a kernel where it cannot."""

from __future__ import annotations

import math

import pytest
import torch

from plugins import get_kernel, list_kernels
from plugins.activation_torch import act_and_mul
from plugins.attention_metadata import AttentionMetadata
from plugins.attention_torch import paged_attention, write_kv
from plugins.norm_torch import rms_norm
from plugins.rope_torch import apply_rope, rope_cos_sin, rope_inv_freq


def test_every_kind_has_a_torch_reference():
    with_reference = {spec.kind for spec in list_kernels() if spec.name == "torch"}
    assert {spec.kind for spec in list_kernels()} == with_reference
    assert {"attention", "rmsnorm", "rope", "activation", "gemm"} <= with_reference


def test_registry_refuses_kernel_that_cannot_run():
    with pytest.raises(KeyError, match="no attention kernel named 'nope'"):
        get_kernel("attention", "nope", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="cannot run on cpu"):
        get_kernel("attention", "torch", torch.device("cpu"), torch.int8)


def test_rms_norm_matches_transformers():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, residual = torch.randn(5, 64), torch.randn(5, 64)
    hf = LlamaRMSNorm(64, eps=1e-5)
    hf.weight.data = torch.randn(64)
    out, new_residual = rms_norm(x, hf.weight.data, 1e-5, residual=residual)
    assert torch.equal(new_residual, x + residual)
    assert torch.equal(out, hf(x + residual))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_rms_norm_matches_transformers(dtype):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    x = torch.randn(5, 64).to(dtype)
    hf = Gemma3RMSNorm(64, eps=1e-6)
    hf.weight.data = torch.randn(64) * 0.1
    out, _ = rms_norm(x, hf.weight.data.to(dtype), 1e-6, weight_offset=1.0)
    expected = hf.to(dtype)(x)  # a bf16 model holds bf16 norm weights
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_kernel_rotates_like_transformers_and_caches_k_v(dtype):
    """The registered rope kernel: rotated q back, rotated k and raw v stored at their slots."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k, v = torch.randn(7, 4, 32).to(dtype), torch.randn(7, 2, 32).to(dtype), torch.randn(7, 2, 32).to(dtype)
    positions = torch.tensor([0, 1, 2, 10, 11, 100, 5])
    cos, sin = rope_cos_sin(rope_inv_freq(32, 10000.0), 128)
    k_cache, v_cache = torch.full((6, 4, 2, 32), 7.0, dtype=dtype), torch.full((6, 4, 2, 32), 7.0, dtype=dtype)
    slots = torch.tensor([21, 3, 4, 12, 0, 17, 9])  # scattered over blocks 5, 0, 0, 3, 0, 4, 2
    rope = get_kernel("rope", "torch", torch.device("cpu"), dtype).fn
    ours_q = rope(q, k, v, cos, sin, positions, k_cache, v_cache, slots, "neox")
    # transformers: q [batch, heads, seq, dim], cos [batch, seq, dim] in the model dtype
    hf_cos, hf_sin = cos[positions][None].to(dtype), sin[positions][None].to(dtype)
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    assert torch.equal(ours_q, hf_q[0].transpose(0, 1))
    assert torch.equal(k_cache.flatten(0, 1)[slots], hf_k[0].transpose(0, 1))
    assert torch.equal(v_cache.flatten(0, 1)[slots], v)
    untouched = torch.ones(24, dtype=torch.bool)
    untouched[slots] = False
    assert (k_cache.flatten(0, 1)[untouched] == 7).all() and (v_cache.flatten(0, 1)[untouched] == 7).all()
    assert torch.equal(ours_q, apply_rope(q, k, cos, sin, positions, "neox")[0])


def test_gptj_rope_is_complex_rotation_of_adjacent_pairs():
    q, k = torch.randn(3, 2, 8), torch.randn(3, 1, 8)
    positions = torch.tensor([0, 3, 9])
    inv_freq = rope_inv_freq(8, 500.0)
    cos, sin = rope_cos_sin(inv_freq, 16, style="gptj")
    ours_q, _ = apply_rope(q, k, cos, sin, positions, style="gptj")
    angles = positions[:, None].float() * inv_freq[None, :]  # [tokens, 4]
    rotated = torch.view_as_real(torch.view_as_complex(q.unflatten(-1, (4, 2))) * torch.polar(torch.ones_like(angles), angles)[:, None, :])
    assert torch.allclose(ours_q, rotated.flatten(-2), atol=1e-6)


def test_llama3_rope_scaling_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    config = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0, rope_scaling=scaling,
                         max_position_embeddings=131072)
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    assert torch.allclose(rope_inv_freq(128, 500000.0, scaling), hf_inv_freq, rtol=1e-6)


def test_gated_activations():
    x = torch.randn(4, 16)
    gate, up = x[:, :8], x[:, 8:]
    assert torch.allclose(act_and_mul(x, "silu"), gate * torch.sigmoid(gate) * up, atol=1e-6)
    tanh_gelu = 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3)))
    assert torch.allclose(act_and_mul(x, "gelu_tanh"), tanh_gelu * up, atol=1e-6)


def _naive_attention(q, k, v, q_positions, scale, window=0):
    # q: [q_len, H, D], k/v: [ctx, KvH, D] contiguous; GQA by repeating kv heads
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    key_pos = torch.arange(k.shape[0])[None, :]
    mask = key_pos <= q_positions[:, None]
    if window:
        mask &= key_pos > q_positions[:, None] - window
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("window", [0, 5])
def test_paged_attention_matches_naive_attention(window):
    torch.manual_seed(0)
    heads, kv_heads, dim, block, num_blocks = 6, 2, 16, 4, 32
    k_cache = torch.zeros(num_blocks, block, kv_heads, dim)
    v_cache = torch.zeros_like(k_cache)
    # (tokens already cached, new query tokens): a chunk continuing a prompt, a fresh
    # prompt, and two single-token generation steps.
    shapes = [(8, 5), (0, 7), (13, 1), (3, 1)]
    free = torch.randperm(num_blocks).tolist()
    tables, contexts, qs, expected = [], [], [], []
    slots = []
    for cached, new in shapes:
        ctx = cached + new
        table = [free.pop() for _ in range(-(-ctx // block))]
        k, v = torch.randn(ctx, kv_heads, dim), torch.randn(ctx, kv_heads, dim)
        pos = torch.arange(ctx)
        flat = torch.tensor([table[p // block] * block + p % block for p in range(ctx)])
        write_kv(k_cache, v_cache, k, v, flat)
        q = torch.randn(new, heads, dim)
        qs.append(q)
        expected.append(_naive_attention(q, k, v, pos[cached:], 0.25, window))
        tables.append(table)
        contexts.append(ctx)
        slots.extend(flat[cached:].tolist())
    starts = [0]
    for _, new in shapes:
        starts.append(starts[-1] + new)
    width = max(map(len, tables))
    single = [i for i, (_, n) in enumerate(shapes) if n == 1]
    meta = AttentionMetadata(
        query_start=starts, context_lens=contexts,
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        context_lens_t=torch.tensor(contexts), slot_mapping=torch.tensor(slots),
        single_query_rows=torch.tensor(single), single_query_tokens=torch.tensor([starts[i] for i in single]),
        multi_query_rows=[i for i, (_, n) in enumerate(shapes) if n > 1],
    )
    out = paged_attention(torch.cat(qs), k_cache, v_cache, meta, 0.25, sliding_window=window)
    assert torch.allclose(out, torch.cat(expected), atol=1e-5)
