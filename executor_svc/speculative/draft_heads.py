"""Medusa-style draft heads on the target's final hidden state, and their files.

Medusa (Cai et al. 2024) puts K small heads on the hidden state h_t that the
target's lm_head turns into its next token t + 1. Head i (i = 0..K-1) guesses
the token at t + 2 + i. Each head is one residual block ``h + SiLU(W_i h + b_i)``
followed by the target's own lm_head (``model.compute_logits``), which is
shared and frozen: the heads add K x hidden x hidden parameters and no copy of
the vocabulary projection. W and b start at zero, so an untrained head repeats
the target's next-token prediction.

The heads live next to the engine they were trained for, as safetensors plus a
small JSON that records their shape and how they were trained.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

HEADS_NAME = "draft_heads.safetensors"
HEADS_META_NAME = "draft_heads.json"
FORMAT_VERSION = 1


class DraftHeads(nn.Module):
    """K residual blocks sharing the target's lm_head; all heads run as one batched matmul."""

    def __init__(self, num_heads: int, hidden_size: int, vocab_size: int) -> None:
        super().__init__()
        if num_heads < 1:
            raise ValueError(f"num_heads must be at least 1, got {num_heads}")
        self.num_heads = num_heads
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size  # the target's; recorded to refuse heads of another model
        # Stacked rather than K nn.Linear modules, so every head runs in one einsum.
        self.weight = nn.Parameter(torch.zeros(num_heads, hidden_size, hidden_size))  # [K, out, in]
        self.bias = nn.Parameter(torch.zeros(num_heads, hidden_size))  # [K, out]

    def head_states(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """Residual outputs of the first ``num_heads`` heads: hidden [N, H] -> [N, k, H] in the heads' dtype."""
        k = self.num_heads if num_heads is None else num_heads
        x = hidden.to(self.weight.dtype)  # x: [N, H]
        update = torch.einsum("nh,koh->nko", x, self.weight[:k]) + self.bias[:k]  # [N, k, H]
        return x[:, None, :] + F.silu(update)

    def forward(self, hidden: torch.Tensor, model: nn.Module) -> torch.Tensor:
        """Logits of every head: hidden [N, H] (the target's dtype) -> [N, K, V] float32."""
        return self._logits(hidden, model, self.num_heads)

    @torch.inference_mode()
    def propose(self, hidden: torch.Tensor, model: nn.Module, num_tokens: int) -> torch.Tensor:
        """Greedy drafts of the first ``num_tokens`` heads: hidden [N, H] -> [N, num_tokens] int64."""
        if not 1 <= num_tokens <= self.num_heads:
            raise ValueError(f"num_tokens must be in [1, {self.num_heads}], got {num_tokens}")
        return self._logits(hidden, model, num_tokens).argmax(dim=-1)

    def _logits(self, hidden: torch.Tensor, model: nn.Module, k: int) -> torch.Tensor:
        states = self.head_states(hidden, k)  # [N, k, H]
        rows = states.reshape(-1, self.hidden_size).to(hidden.dtype)  # the lm_head runs in the target's dtype
        logits = model.compute_logits(rows)  # [N * k, V] float32
        return logits.view(hidden.shape[0], k, logits.shape[-1])


def heads_path(engine_dir: Path) -> Path:
    """Where the draft heads of the engine in ``engine_dir`` live."""
    return Path(engine_dir) / HEADS_NAME


def heads_meta_path(engine_dir: Path) -> Path:
    """The JSON beside the heads: shape and training summary."""
    return Path(engine_dir) / HEADS_META_NAME


def save_draft_heads(heads: DraftHeads, engine_dir: Path, meta: dict) -> Path:
    """Write ``heads`` (float32) and a JSON of their shape plus ``meta`` next to the engine; the weights' path."""
    path = heads_path(engine_dir)
    tensors = {"weight": heads.weight.detach().float().cpu().contiguous(),
               "bias": heads.bias.detach().float().cpu().contiguous()}
    save_file(tensors, str(path), metadata={"format": str(FORMAT_VERSION)})
    summary = {
        "format": FORMAT_VERSION, "num_heads": heads.num_heads, "hidden_size": heads.hidden_size,
        "vocab_size": heads.vocab_size, "weights": HEADS_NAME, "training": meta,
    }
    heads_meta_path(engine_dir).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return path


def read_heads_meta(engine_dir: Path) -> dict:
    """The JSON written by ``save_draft_heads``."""
    path = heads_meta_path(engine_dir)
    if not path.is_file():
        raise FileNotFoundError(f"no draft heads description at {path}: train heads with `inflight train-draft`")
    return json.loads(path.read_text(encoding="utf-8"))


def load_draft_heads(engine_dir: Path, model_config, device: torch.device, dtype: torch.dtype) -> DraftHeads:
    """The heads saved next to the engine, checked against ``model_config`` and cast to ``dtype`` on ``device``.

    Raises FileNotFoundError when there are none, ValueError when they were
    trained for a model of another hidden size or vocabulary.
    """
    path = heads_path(engine_dir)
    if not path.is_file():
        raise FileNotFoundError(f"no draft heads at {path}: train them with `inflight train-draft {engine_dir}`")
    meta = read_heads_meta(engine_dir)
    tensors = load_file(str(path))
    weight, bias = tensors.get("weight"), tensors.get("bias")
    if weight is None or bias is None or weight.dim() != 3 or bias.shape != weight.shape[:2]:
        raise ValueError(f"{path} is not a draft heads file (expected tensors 'weight' [K, H, H] and 'bias' [K, H])")
    num_heads, hidden_size = weight.shape[0], weight.shape[1]
    vocab_size = int(meta.get("vocab_size", -1))
    expected = (model_config.hidden_size, model_config.hidden_size)
    if tuple(weight.shape[1:]) != expected or vocab_size != model_config.vocab_size:
        raise ValueError(
            f"{path} holds heads for hidden size {hidden_size} and vocabulary {vocab_size}, but the engine's model "
            f"{model_config.name} has hidden size {model_config.hidden_size} and vocabulary {model_config.vocab_size}: "
            f"retrain them with `inflight train-draft {engine_dir}`"
        )
    heads = DraftHeads(num_heads, hidden_size, vocab_size)
    heads.load_state_dict({"weight": weight, "bias": bias})
    return heads.to(device=device, dtype=dtype).eval().requires_grad_(False)
