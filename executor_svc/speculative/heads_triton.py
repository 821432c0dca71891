"""A recurrent draft head's greedy chain as three Triton kernels a draft.

Each draft of ``RecurrentDraftHead.propose`` is, in torch, some ten kernels:
the token's embedding, a concatenation, two linears with their biases, the
SiLU, the residual add, the LM head's GEMV, its float32 copy and an argmax
over the vocabulary. At batch 1 on a fast GPU each is a few microseconds of
launch and tail for little work: on an H100, a chain of four drafts of
SmolLM2-135M took 0.23 ms in torch's kernels, against a 0.74 ms forward of
the target (bench/results/h100_round_cost_fused_head_smollm2.json). Here a
draft is:

* ``_head_in_kernel``: ``SiLU(W_in [s; E[x]] + b_in)``, reading the state and
  the token's embedding row directly (no concatenated copy);
* ``_head_out_kernel``: ``s + W_out u + b_out``, the next state;
* ``_lm_head_argmax_kernel``: the LM head's GEMV over a block of the
  vocabulary and that block's best token, so the logits are never written;
  the row's last block to finish (an atomic count) picks the best of the
  blocks' and writes the draft, which the next draft's first kernel reads.
  With a draft vocabulary (``draft_heads.DraftVocabulary``) the GEMV reads
  only its rows of the LM head, and the pick is mapped to its token id.

Every value is rounded where torch's kernels round it (each linear's output,
the SiLU, the residual sum, the 16-bit logits before the argmax), and ties go
to the lowest token id as ``torch.argmax``'s do, so the drafts are the torch
chain's up to the order of float32 sums. Rows are a grid axis, each program
one row: the rows' programs for one weight tile run together and share it
through L2, which serves a few rows (``MAX_ROWS``). On an H200 with
SmolLM2-135M's sizes a chain of four drafts took 104 us at one row against
torch's 192, 192 against 213 at four rows, and 320 against 222 at eight
(bench/results/h200_draft_head_kernels_smollm2.json): past four rows the
torch chain's batched GEMMs read each weight once and win. On an H100, with
programmatic dependent launch, the chain of four drafts (its CUDA graph) took
0.14 ms against torch's 0.23, and a round verifying four drafts 0.93 ms
against 1.03.

Checked against the torch chain on the CPU through Triton's interpreter and on
the GPU (tests/test_draft_heads.py); timed in bench/round_cost.py and
bench/draft_head_kernels.py (which chose ``ChainConfig``'s defaults).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from plugins.pdl import enter, pdl_launch_args

MAX_ROWS = 4  # the most requests whose chain runs these kernels (each program one row): see below


@dataclass(frozen=True)
class ChainConfig:
    """Tiles of the chain's kernels; the defaults timed fastest at one row on an H200 for SmolLM2-135M's sizes
    (bench/draft_head_kernels.py). The head's linears are small (2.6 and 1.3 MB there), so they take few
    outputs a program and their whole K in one step (one round trip to memory); the LM head streams its
    weight in narrow steps, which keeps more programs resident per SM."""

    block_hidden: int = 4  # outputs per program of the head's two linears
    block_k_hidden: int = 2048  # their step along K (at most the next power of two of K)
    warps_hidden: int = 2
    block_vocab: int = 32  # vocabulary rows per program of the LM head
    block_k_vocab: int = 64  # its step along the hidden size
    warps_vocab: int = 2


DEFAULT_CONFIG = ChainConfig()


@triton.jit
def _tile(ptr, rows, rows_ok, stride, k, K):
    """[rows, k] of a row-major matrix, zero past K, as float32."""
    return tl.load(ptr + rows[:, None] * stride + k[None, :], mask=rows_ok[:, None] & (k[None, :] < K), other=0.0).to(
        tl.float32)


@triton.jit
def _dot_rows(w, w_ptr, rows, rows_ok, stride, x_ptr, k, K, BLOCK_K: tl.constexpr):
    """``W[rows] @ x`` in float32 for one vector ``x`` of length K, ``w`` the first tile (``_tile`` at column 0,
    which the caller loads before the PDL wait); the later tiles stream in steps of BLOCK_K."""
    x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
    acc = w * x[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w = _tile(w_ptr + k0, rows, rows_ok, stride, k, K - k0)
        x = tl.load(x_ptr + k0 + k, mask=k0 + k < K, other=0.0).to(tl.float32)
        acc += w * x[None, :]
    return tl.sum(acc, axis=1)


# Each kernel loads its first step of weights and its bias, which no earlier kernel writes, before ``enter``
# (plugins/pdl.py): with programmatic dependent launch that overlaps the kernel before it.
# Step-dependent integers are not specialised on: one compilation serves every draft of every chain length.
@triton.jit(do_not_specialize=["stride_tokens", "token_column"])
def _head_in_kernel(
    state_ptr, tokens_ptr, embed_ptr, w_in_ptr, b_in_ptr, out_ptr,
    stride_state, stride_tokens, token_column, stride_embed, stride_w_in, H, INNER,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    row = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < INNER
    k = tl.arange(0, BLOCK_K)
    w_s = _tile(w_in_ptr, n, n_ok, stride_w_in, k, H)  # the columns that multiply the state
    w_e = _tile(w_in_ptr + H, n, n_ok, stride_w_in, k, H)  # and the token's embedding
    bias = tl.load(b_in_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    enter(PDL)
    token = tl.load(tokens_ptr + row * stride_tokens + token_column)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        if k0 > 0:
            w_s = _tile(w_in_ptr + k0, n, n_ok, stride_w_in, k, H - k0)
            w_e = _tile(w_in_ptr + H + k0, n, n_ok, stride_w_in, k, H - k0)
        k_ok = k0 + k < H
        x = tl.load(state_ptr + row * stride_state + k0 + k, mask=k_ok, other=0.0).to(tl.float32)
        e = tl.load(embed_ptr + token * stride_embed + k0 + k, mask=k_ok, other=0.0).to(tl.float32)
        acc += w_s * x[None, :] + w_e * e[None, :]
    dtype = out_ptr.dtype.element_ty
    y = (tl.sum(acc, axis=1) + bias).to(dtype).to(tl.float32)  # the linear's output, rounded as torch's
    tl.store(out_ptr + row * INNER + n, (y * tl.sigmoid(y)).to(dtype), mask=n_ok)


@triton.jit
def _head_out_kernel(
    inner_ptr, state_in_ptr, w_out_ptr, b_out_ptr, state_out_ptr,
    stride_state_in, stride_w_out, H, INNER,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    row = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < H
    k = tl.arange(0, BLOCK_K)
    w = _tile(w_out_ptr, n, n_ok, stride_w_out, k, INNER)
    bias = tl.load(b_out_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    enter(PDL)
    dtype = state_out_ptr.dtype.element_ty
    update = (_dot_rows(w, w_out_ptr, n, n_ok, stride_w_out, inner_ptr + row * INNER, k, INNER, BLOCK_K) + bias)
    update = update.to(dtype).to(tl.float32)
    state = tl.load(state_in_ptr + row * stride_state_in + n, mask=n_ok, other=0.0).to(tl.float32)
    # Only this program reads its outputs' old state, so the state may be updated in place.
    tl.store(state_out_ptr + row * H + n, (state + update).to(dtype), mask=n_ok)


@triton.jit(do_not_specialize=["stride_drafts", "column"])
def _lm_head_argmax_kernel(
    state_ptr, weight_ptr, ids_ptr, best_value_ptr, best_index_ptr, count_ptr, drafts_ptr,
    stride_weight, stride_drafts, column, H, VOCAB, NUM_BLOCKS,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_BLOCKS: tl.constexpr, HAS_IDS: tl.constexpr,
    PDL: tl.constexpr,
):
    # ``weight`` holds VOCAB rows: the whole LM head, or with HAS_IDS the rows of the token ids at ``ids_ptr``
    # (ascending, so the lowest row among equal logits is also the lowest id).
    row = tl.program_id(0)  # rows vary fastest: one weight tile's programs run together and share it in L2
    block = tl.program_id(1)
    v = block * BLOCK_N + tl.arange(0, BLOCK_N)
    v_ok = v < VOCAB
    k = tl.arange(0, BLOCK_K)
    w = _tile(weight_ptr, v, v_ok, stride_weight, k, H)
    enter(PDL)
    # The 16-bit logits the LM head's GEMM writes, so near-ties resolve as in the torch chain.
    logits = _dot_rows(w, weight_ptr, v, v_ok, stride_weight, state_ptr + row * H, k, H, BLOCK_K)
    logits = logits.to(weight_ptr.dtype.element_ty).to(tl.float32)
    logits = tl.where(v_ok, logits, float("-inf"))
    best = tl.max(logits, axis=0)
    index = tl.min(tl.where(logits == best, v, VOCAB), axis=0)  # the lowest id among equals, as torch.argmax
    tl.store(best_value_ptr + row * NUM_BLOCKS + block, best)
    tl.store(best_index_ptr + row * NUM_BLOCKS + block, index)
    # The row's last block to finish picks the best of all blocks' (no reduction kernel): its atomic's acquire
    # sees every earlier block's stores, read from L2 (.cg) rather than a stale L1 line.
    tl.debug_barrier()
    if tl.atomic_add(count_ptr + row, 1, sem="acq_rel") == NUM_BLOCKS - 1:
        b = tl.arange(0, BLOCK_BLOCKS)
        ok = b < NUM_BLOCKS
        values = tl.load(best_value_ptr + row * NUM_BLOCKS + b, mask=ok, other=float("-inf"), cache_modifier=".cg")
        indices = tl.load(best_index_ptr + row * NUM_BLOCKS + b, mask=ok, other=VOCAB, cache_modifier=".cg")
        top = tl.max(values, axis=0)
        token = tl.min(tl.where(values == top, indices, VOCAB), axis=0)
        if HAS_IDS:
            token = tl.load(ids_ptr + token)
        tl.store(drafts_ptr + row * stride_drafts + column, token.to(tl.int64))
        tl.atomic_xchg(count_ptr + row, 0)  # ready for the next draft


def fits(hidden: torch.Tensor, tensors: list[torch.Tensor]) -> bool:
    """Whether these kernels can run a chain from ``hidden`` with ``tensors`` (the head's, the embedding, the
    LM head): few rows, one 16-bit or float32 dtype for all of them, and rows laid out contiguously."""
    dtype = hidden.dtype
    return (
        hidden.dim() == 2 and 1 <= hidden.shape[0] <= MAX_ROWS
        and dtype in (torch.bfloat16, torch.float16, torch.float32)
        and all(t.dtype == dtype and t.device == hidden.device and t.stride(-1) == 1 for t in [hidden, *tensors])
    )


def recurrent_drafts(
    hidden: torch.Tensor,  # [N, H] the rows that chose next_tokens, in the head's dtype
    next_tokens: torch.Tensor,  # [N] int64
    embed: torch.Tensor,  # [V, H] the target's token embedding
    w_in: torch.Tensor, b_in: torch.Tensor, w_out: torch.Tensor, b_out: torch.Tensor,  # the head
    lm_weight: torch.Tensor,  # [V, H] the target's LM head, or [n, H] its rows of vocab_ids
    num_tokens: int,
    config: ChainConfig | None = None,
    vocab_ids: torch.Tensor | None = None,  # [n] int64 ascending: the token ids of lm_weight's rows (None: 0..V-1)
) -> torch.Tensor:  # [N, num_tokens] int64
    """The greedy chain of ``num_tokens`` drafts (``RecurrentDraftHead.propose``'s), with no host sync."""
    c = config or DEFAULT_CONFIG
    rows, dim = hidden.shape
    inner, vocab = w_in.shape[0], lm_weight.shape[0]
    device, dtype = hidden.device, w_in.dtype
    drafts = torch.empty((rows, num_tokens), dtype=torch.int64, device=device)
    state = torch.empty((rows, dim), dtype=dtype, device=device)
    activation = torch.empty((rows, inner), dtype=dtype, device=device)
    num_blocks = triton.cdiv(vocab, c.block_vocab)
    best_value = torch.empty((rows, num_blocks), dtype=torch.float32, device=device)
    best_index = torch.empty((rows, num_blocks), dtype=torch.int32, device=device)
    counts = torch.zeros(rows, dtype=torch.int32, device=device)  # blocks done per row; the last resets it
    next_tokens = next_tokens.reshape(rows)
    pdl = pdl_launch_args(device)
    for step in range(num_tokens):
        # Step 0 reads the target's row and its token; later steps the chain's own state and last draft.
        source, source_stride = (hidden, hidden.stride(0)) if step == 0 else (state, dim)
        if step == 0:
            tokens, token_stride, column = next_tokens, next_tokens.stride(0), 0
        else:
            tokens, token_stride, column = drafts, num_tokens, step - 1
        _head_in_kernel[(rows, triton.cdiv(inner, c.block_hidden))](
            source, tokens, embed, w_in, b_in, activation,
            source_stride, token_stride, column, embed.stride(0), w_in.stride(0), dim, inner,
            BLOCK_N=c.block_hidden, BLOCK_K=min(c.block_k_hidden, triton.next_power_of_2(dim)),
            num_warps=c.warps_hidden, **pdl,
        )
        _head_out_kernel[(rows, triton.cdiv(dim, c.block_hidden))](
            activation, source, w_out, b_out, state, source_stride, w_out.stride(0), dim, inner,
            BLOCK_N=c.block_hidden, BLOCK_K=min(c.block_k_hidden, triton.next_power_of_2(inner)),
            num_warps=c.warps_hidden, **pdl,
        )
        _lm_head_argmax_kernel[(rows, num_blocks)](
            state, lm_weight, best_index if vocab_ids is None else vocab_ids, best_value, best_index, counts, drafts,
            lm_weight.stride(0), num_tokens, step, dim, vocab, num_blocks,
            BLOCK_N=c.block_vocab, BLOCK_K=min(c.block_k_vocab, triton.next_power_of_2(dim)),
            BLOCK_BLOCKS=triton.next_power_of_2(num_blocks), HAS_IDS=vocab_ids is not None,
            num_warps=c.warps_vocab, **pdl,
        )
    return drafts
