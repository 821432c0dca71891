"""Perplexity, and the accuracy gate of ``inflight build --validate``.

Perplexity is exp of the mean negative log-likelihood of each next token,
averaged over every predicted token of every text (so long texts weigh in
proportion to their length). The gate scores the unquantized model (in the
engine's dtype) and the quantized one on the same held-out texts and fails the
build when the increase passes ``max_increase``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from executor_svc.quantization.forward import PromptForward

LOGIT_ROWS = 512  # rows of [rows, vocab] float32 logits alive at once


class AccuracyGateError(RuntimeError):
    """The quantized engine lost more perplexity than the build allows."""


@dataclass(slots=True)
class PerplexityGate:
    """Settings of ``--validate``."""

    max_increase: float = 0.5  # absolute perplexity points
    num_texts: int = 32  # held-out texts
    max_tokens: int = 512  # tokens per text


def logit_chunks(model: nn.Module, hidden: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, float32 logits [rows, vocab]) of final hidden states [positions, hidden], ``LOGIT_ROWS``
    rows at a time."""
    for start in range(0, hidden.shape[0], LOGIT_ROWS):
        yield start, model.compute_logits(hidden[start : start + LOGIT_ROWS])


@torch.inference_mode()
def perplexity(
    runner: PromptForward, token_lists: list[list[int]], desc: str = "perplexity", progress: bool = True
) -> tuple[float, int]:
    """(perplexity, number of predicted tokens) of ``runner.model`` over ``token_lists``."""
    total_nll, total_tokens = 0.0, 0
    for ids in tqdm(token_lists, desc=desc, unit="text", disable=not progress, leave=False):
        hidden = runner.hidden_states(ids)[:-1]  # position i predicts token i + 1
        targets = torch.tensor(ids[1:], device=hidden.device)
        for start, logits in logit_chunks(runner.model, hidden):
            total_nll += float(F.cross_entropy(logits, targets[start : start + LOGIT_ROWS], reduction="sum"))
        total_tokens += len(ids) - 1
    if total_tokens == 0:
        raise ValueError("perplexity needs at least one text of two or more tokens")
    return math.exp(total_nll / total_tokens), total_tokens
