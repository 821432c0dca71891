"""Greedy token choice: the lowest index of each row's largest logit, as ``torch.argmax`` breaks ties.

``torch.argmax`` over the last dimension reduces each row with one thread block, so a decode step of
a few rows over a vocabulary of 128k float32 logits keeps a handful of SMs busy while the rest idle:
in a batch-1 profile of Llama-3.1-8B's shape on an H200 that reduction took 28 us of a 2.6-4.3 ms
step (``bench/results/h200_quant_profile_thread_sums_llama8b.json``). ``two_stage`` cuts each row into
equal chunks first, takes every chunk's maximum and its index (one reduction per chunk, so many
blocks), then the first chunk holding the row's maximum: the same index, since ``max`` returns the
first index of a chunk's maximum and ``argmax`` the first chunk of the row's. A NaN wins both stages,
as it wins ``torch.argmax``. Both are plain torch, so they run anywhere and inside CUDA graphs; which
one an engine uses is timed at build, as for every kernel kind.
"""

from __future__ import annotations

import torch

from plugins.registry import register_kernel

MAX_CHUNKS = 64  # chunks of one row: enough reductions to spread a single row over the GPU
MIN_CHUNK = 512  # columns per chunk: a chunk shorter than this is not worth a reduction of its own
MAX_SPLIT_ROWS = 32  # from this many rows the rows alone make enough reductions


def argmax_chunks(rows: int, columns: int) -> int:
    """How many equal chunks ``two_stage`` cuts each row of ``columns`` into (1: not worth cutting).

    The largest power of two that divides ``columns``, leaves chunks of at least ``MIN_CHUNK`` and keeps
    ``rows x chunks`` at most ``MAX_CHUNKS``; fewer than 4 chunks is not worth a second stage.
    """
    if rows >= MAX_SPLIT_ROWS:
        return 1
    chunks = 1
    while (chunks * 2 * rows <= MAX_CHUNKS and columns % (chunks * 2) == 0
           and columns // (chunks * 2) >= MIN_CHUNK):
        chunks *= 2
    return chunks if chunks >= 4 else 1


@register_kernel("argmax", "torch", description="reference: torch.argmax over each row's logits")
def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] -> [rows] int64, the lowest index of each row's maximum."""
    return logits.argmax(dim=-1)


@register_kernel(
    "argmax", "two_stage",
    description="each row's maximum per chunk of columns (many reductions), then the first best chunk",
)
def row_argmax_two_stage(logits: torch.Tensor) -> torch.Tensor:
    """Same contract as ``row_argmax``."""
    if logits.dim() != 2:
        raise ValueError(f"expected logits [rows, vocab], got shape {tuple(logits.shape)}")
    rows, columns = logits.shape
    chunks = argmax_chunks(rows, columns)
    if chunks == 1:
        return logits.argmax(dim=-1)
    width = columns // chunks
    values, index = logits.reshape(rows, chunks, width).max(dim=-1)  # [rows, chunks] each
    best = values.argmax(dim=-1, keepdim=True)  # the first chunk holding the row's maximum
    return (index.gather(1, best) + best * width).squeeze(1)
