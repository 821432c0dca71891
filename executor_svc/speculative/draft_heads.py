"""Draft heads on the target's final hidden state, and their files.

Two kinds, both reading the hidden state h_t that the target's lm_head turns
into its next token t + 1, and both sharing that lm_head (``model.compute_logits``),
frozen, so neither adds a copy of the vocabulary projection:

* ``medusa`` (Cai et al. 2024): K independent heads; head i (i = 0..K-1)
  guesses the token at t + 2 + i from h_t alone. Each is one residual block
  ``h + SiLU(W_i h + b_i)``. W and b start at zero, so an untrained head
  repeats the target's next-token prediction.
* ``recurrent`` (in the manner of EAGLE, Li et al. 2024, without its attention
  layer): one block that predicts the target's *next* hidden state from the
  current one and the token just chosen, ``s' = s + W_out SiLU(W_in [s; e(x)] + b_in) + b_out``
  with ``e`` the target's own (frozen) token embedding. Drafting runs it k
  times: s_0 = h_t and x_1 the token the target just emitted give s_1, whose
  lm_head argmax is draft 1; draft 1 and s_1 give s_2; and so on. Because each
  draft sees the one before it, later drafts stay coherent with earlier ones,
  which independent Medusa heads cannot. W_out starts at zero, so an untrained
  block keeps the state and repeats the target's next-token prediction.

Both may draft from a *draft vocabulary* (``DraftVocabulary``): the tokens the
target used most in the training answers, whose rows of the LM head are all a
draft's argmax reads, as FR-Spec and EAGLE-3 do. A draft outside it cannot be
made, which costs little (the target's own answers seldom use rare tokens), and
each draft reads a fraction of the LM head: at batch 1 that GEMV is most of a
draft's work (49,152 x 576 for SmolLM2, 57 MB in 16 bits, against 3.9 MB for
the recurrent head's two linears). Verification is untouched, so output stays
the target's.

The heads live next to the engine they were trained for, as safetensors plus a
small JSON that records their kind, shape and how they were trained.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from executor_svc.speculative.draft_tree import TreeTensors, top_ids
from plugins.norm_torch import rms_norm

HEADS_NAME = "draft_heads.safetensors"
HEADS_META_NAME = "draft_heads.json"
# 2 added "kind" (files of version 1 are Medusa heads); 3 the training answers' token counts ("token_counts") and
# the draft vocabulary's size ("draft_vocab_size").
FORMAT_VERSION = 3
HEAD_KINDS = ("recurrent", "medusa")
NORM_EPS = 1e-6  # the recurrent head's input norms (``input_norm``)
COUNTS_NAME = "token_counts"  # the tensor of the training answers' token counts in the heads' file


class DraftVocabulary:
    """The tokens a head's drafts are chosen among (all of the target's when ``draft_vocab`` is None), for the
    heads below: ``vocab_logits`` scores a state's rows over them, ``vocab_ids`` maps a pick back to token ids.

    ``token_counts`` (how often each token was the target's next token in the training answers) ranks the
    tokens; ``use_draft_vocab(n)`` keeps the n most frequent (ties to the lower id), in id order, so that the
    lowest index among equal logits is also the lowest token id, as ``torch.argmax`` breaks ties over the whole
    vocabulary."""

    draft_vocab: torch.Tensor | None  # [n] int64 token ids, ascending (a buffer: it moves with the heads)
    token_counts: torch.Tensor | None  # [V] int64 on the CPU, or None for heads trained without counting
    vocab_size: int

    def _init_vocabulary(self: nn.Module) -> None:
        self.register_buffer("draft_vocab", None, persistent=False)
        self.token_counts = None
        self._vocab_weight: tuple[torch.Tensor, torch.Tensor] | None = None  # (LM head weight, its draft rows)

    @property
    def draft_vocab_size(self) -> int:
        """Tokens the drafts are chosen among; 0 when it is the whole vocabulary."""
        return 0 if self.draft_vocab is None else int(self.draft_vocab.numel())

    def use_draft_vocab(self, size: int) -> None:
        """Draft among the ``size`` tokens the training answers used most; 0 (or the whole vocabulary): all."""
        if size < 0:
            raise ValueError(f"a draft vocabulary's size must be at least 0 (0 = the whole vocabulary), got {size}")
        self._vocab_weight = None
        if size == 0 or size >= self.vocab_size:
            self.draft_vocab = None
            return
        if self.token_counts is None:
            raise ValueError("these heads were saved without the training answers' token counts: retrain them to "
                             "draft from a smaller vocabulary")
        # Most frequent first, the lower id first among equals (a stable sort of ids by descending count).
        order = torch.sort(self.token_counts, descending=True, stable=True).indices[:size]
        device = next(iter(self.parameters())).device  # type: ignore[attr-defined]
        self.draft_vocab = order.sort().values.to(device)

    def vocab_coverage(self) -> float | None:
        """The share of the training answers' tokens inside the draft vocabulary (None without counts)."""
        if self.token_counts is None:
            return None
        total = int(self.token_counts.sum())
        if self.draft_vocab is None or not total:
            return 1.0 if total else None
        return int(self.token_counts[self.draft_vocab.cpu()].sum()) / total

    def vocab_logits(self, rows: torch.Tensor, model: nn.Module) -> torch.Tensor:
        """float32 logits of ``rows`` [N, H] (the target's dtype) over the draft vocabulary: [N, n] (or [N, V])."""
        if self.draft_vocab is None:
            return model.compute_logits(rows)
        weight = self.vocab_weight(model)
        if weight is None:  # a quantized LM head keeps its own GEMM: score everything, keep the draft columns
            return model.compute_logits(rows).index_select(-1, self.draft_vocab)
        return model.lm_head.kernel(rows, weight).float()  # the engine's GEMM, as the LM head's own rows

    def vocab_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Token ids of positions in ``vocab_logits``' last dimension."""
        return index if self.draft_vocab is None else self.draft_vocab[index]

    def vocab_weight(self, model: nn.Module) -> torch.Tensor | None:
        """The LM head's rows of the draft vocabulary ([n, H], gathered once per LM head weight), or None where
        the LM head is not a plain 16-bit or float32 projection (or there is no draft vocabulary)."""
        from executor_svc.model.llama import Linear

        lm_head = getattr(model, "lm_head", None)
        if self.draft_vocab is None or type(lm_head) is not Linear:
            return None
        cached = self._vocab_weight
        if cached is None or cached[0] is not lm_head.weight:
            rows = lm_head.weight.detach().index_select(0, self.draft_vocab).contiguous()
            self._vocab_weight = cached = (lm_head.weight, rows)
        return cached[1]


class DraftHeads(DraftVocabulary, nn.Module):
    """Medusa: K residual blocks sharing the target's lm_head; all heads run as one batched matmul."""

    kind = "medusa"

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
        self._init_vocabulary()

    @property
    def max_drafts(self) -> int:
        """Most drafts one call proposes: one per head."""
        return self.num_heads

    def head_states(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """Residual outputs of the first ``num_heads`` heads: hidden [N, H] -> [N, k, H] in the heads' dtype."""
        k = self.num_heads if num_heads is None else num_heads
        x = hidden.to(self.weight.dtype)  # x: [N, H]
        update = torch.einsum("nh,koh->nko", x, self.weight[:k]) + self.bias[:k]  # [N, k, H]
        return x[:, None, :] + F.silu(update)

    def forward(self, hidden: torch.Tensor, model: nn.Module, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of every head: hidden [N, H] (the target's dtype) -> [N, K, V] float32. ``tokens`` is unused
        (Medusa heads do not see the tokens they follow); it keeps one signature for both kinds."""
        return self._logits(hidden, model, self.num_heads)

    @torch.inference_mode()
    def propose(
        self, hidden: torch.Tensor, model: nn.Module, num_tokens: int, next_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Greedy drafts of the first ``num_tokens`` heads: hidden [N, H] -> [N, num_tokens] int64."""
        if not 1 <= num_tokens <= self.num_heads:
            raise ValueError(f"num_tokens must be in [1, {self.num_heads}], got {num_tokens}")
        return self.vocab_ids(self._logits(hidden, model, num_tokens, drafting=True).argmax(dim=-1))

    @torch.inference_mode()
    def propose_tree(
        self, hidden: torch.Tensor, model: nn.Module, tree: TreeTensors, next_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Tree drafts: hidden [N, H] -> [N, tree.num_nodes] int64, breadth-first. Head d's best guesses fill
        depth d + 1, whatever the node's parent (Medusa's heads do not see earlier drafts)."""
        if not 1 <= tree.k <= self.num_heads:
            raise ValueError(f"a tree of depth {tree.k} needs at most {self.num_heads} heads")
        logits = self._logits(hidden, model, tree.k, drafting=True)  # [N, k, V or the draft vocabulary's n]
        levels = [top_ids(logits[:, d], level.width).index_select(1, level.ranks) for d, level in enumerate(tree.grow)]
        return self.vocab_ids(torch.cat(levels, dim=1))

    def _logits(self, hidden: torch.Tensor, model: nn.Module, k: int, drafting: bool = False) -> torch.Tensor:
        """[N, k, V] float32; ``drafting``: over the draft vocabulary only (``vocab_logits``)."""
        states = self.head_states(hidden, k)  # [N, k, H]
        rows = states.reshape(-1, self.hidden_size).to(hidden.dtype)  # the lm_head runs in the target's dtype
        logits = self.vocab_logits(rows, model) if drafting else model.compute_logits(rows)  # [N * k, V] float32
        return logits.view(hidden.shape[0], k, logits.shape[-1])

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight, "bias": self.bias}


class RecurrentDraftHead(DraftVocabulary, nn.Module):
    """One block that steps the target's hidden state forward a token at a time (EAGLE-style, no attention)."""

    kind = "recurrent"
    # Greedy chains of a few rows on a GPU run as three Triton kernels a draft (heads_triton); False, on a head or
    # on the class, keeps torch's kernels (the benchmarks' comparison, the tests' oracle).
    fused = True

    def __init__(
        self, max_drafts: int, hidden_size: int, vocab_size: int, intermediate_size: int = 0, input_norm: bool = False,
    ) -> None:
        super().__init__()
        if max_drafts < 1:
            raise ValueError(f"max_drafts must be at least 1, got {max_drafts}")
        self.num_heads = max_drafts  # the chain depth it was trained for; serving drafts no further
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        inner = intermediate_size or 2 * hidden_size
        self.w_in = nn.Parameter(torch.randn(inner, 2 * hidden_size) / (2 * hidden_size) ** 0.5)
        self.b_in = nn.Parameter(torch.zeros(inner))
        self.w_out = nn.Parameter(torch.zeros(hidden_size, inner))
        self.b_out = nn.Parameter(torch.zeros(hidden_size))
        # RMS norms (learned gains) on the block's two inputs, as EAGLE-3's: the target's residual stream and its
        # token embeddings differ in scale by an order of magnitude (SmolLM2, over one chat prompt:
        # RMS about 1.9 against 0.12).
        self.input_norm = input_norm
        if input_norm:
            self.norm_state = nn.Parameter(torch.ones(hidden_size))
            self.norm_embed = nn.Parameter(torch.ones(hidden_size))
        self._init_vocabulary()

    @property
    def max_drafts(self) -> int:
        return self.num_heads

    @property
    def intermediate_size(self) -> int:
        return self.w_in.shape[0]

    def step(self, state: torch.Tensor, token_embedding: torch.Tensor) -> torch.Tensor:
        """The predicted next hidden state: state [N, H], token_embedding [N, H] -> [N, H] in the head's dtype."""
        token_embedding = token_embedding.to(state.dtype)
        if self.input_norm:
            x = torch.cat([rms_norm(state, self.norm_state, NORM_EPS)[0],
                           rms_norm(token_embedding, self.norm_embed, NORM_EPS)[0]], dim=-1)
        else:
            x = torch.cat([state, token_embedding], dim=-1)  # [N, 2H]
        return state + F.linear(F.silu(F.linear(x, self.w_in, self.b_in)), self.w_out, self.b_out)

    def forward(self, hidden: torch.Tensor, model: nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced chain: hidden [N, H] and the tokens fed at each step [N, k] -> (logits [N, k, V]
        float32, predicted states [N, k, H] in the head's dtype). Step i's state predicts the target's hidden
        state i rows on, and its logits the token after tokens[:, i]."""
        state = hidden.to(self.w_in.dtype)
        embeddings = model.embed_tokens(tokens)  # [N, k, H] in the target's dtype
        states = []
        for i in range(tokens.shape[1]):
            state = self.step(state, embeddings[:, i])
            states.append(state)
        stacked = torch.stack(states, dim=1)  # [N, k, H]
        logits = model.compute_logits(stacked.reshape(-1, self.hidden_size).to(hidden.dtype))
        return logits.view(hidden.shape[0], tokens.shape[1], -1), stacked

    @torch.inference_mode()
    def propose(
        self, hidden: torch.Tensor, model: nn.Module, num_tokens: int, next_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Greedy chain of ``num_tokens`` drafts: hidden [N, H] (the row that chose ``next_tokens`` [N]) ->
        [N, num_tokens] int64. No host sync: it can be captured in a CUDA graph. A few rows on a GPU run the
        chain's Triton kernels (``heads_triton``), which draft what this torch loop drafts."""
        if not 1 <= num_tokens <= self.num_heads:
            raise ValueError(f"num_tokens must be in [1, {self.num_heads}], got {num_tokens}")
        if next_tokens is None:
            raise ValueError("a recurrent draft head needs the token each hidden state chose (next_tokens)")
        state, token = hidden.to(self.w_in.dtype), next_tokens
        fused = self._fused_parts(state, model)
        if fused is not None:
            from executor_svc.speculative.heads_triton import recurrent_drafts

            return recurrent_drafts(state, token, *fused, num_tokens, vocab_ids=self.draft_vocab)
        drafts = []
        for _ in range(num_tokens):
            state = self.step(state, model.embed_tokens(token))
            token = self.vocab_ids(self.vocab_logits(state.to(hidden.dtype), model).argmax(dim=-1))
            drafts.append(token)
        return torch.stack(drafts, dim=1)

    def _fused_parts(self, hidden: torch.Tensor, model: nn.Module) -> list[torch.Tensor] | None:
        """For a chain from ``hidden`` (in the head's dtype), the tensors ``heads_triton.recurrent_drafts`` reads
        (the embedding, the head's four, the LM head's weight or its draft vocabulary's rows) where its kernels
        give this chain's drafts: on a GPU, ``fused`` set, no input norms, a target whose logits are its plain
        16-bit LM head's (no quantized head, no soft cap) and few rows. None otherwise."""
        from executor_svc.model.llama import Linear

        lm_head, embed = getattr(model, "lm_head", None), getattr(model, "embed_tokens", None)
        if (
            not self.fused or self.input_norm or not hidden.is_cuda or type(lm_head) is not Linear
            or not isinstance(embed, nn.Embedding)
            or getattr(model.config, "final_logit_softcapping", None) is not None
        ):
            return None
        from executor_svc.speculative import heads_triton

        head_rows = lm_head.weight if self.draft_vocab is None else self.vocab_weight(model)
        parts = [embed.weight, self.w_in, self.b_in, self.w_out, self.b_out, head_rows]
        return parts if heads_triton.fits(hidden, parts) else None

    @torch.inference_mode()
    def propose_tree(
        self, hidden: torch.Tensor, model: nn.Module, tree: TreeTensors, next_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Tree drafts: hidden [N, H] (the row that chose ``next_tokens`` [N]) -> [N, tree.num_nodes] int64,
        breadth-first. Every node with children steps the state of its parent with its own token, so each
        branch drafts on from what it guessed; the children are that state's best guesses. No host sync."""
        if not 1 <= tree.k <= self.num_heads:
            raise ValueError(f"a tree of depth {tree.k} needs a head trained for at least that depth ({self.num_heads})")
        if next_tokens is None:
            raise ValueError("a recurrent draft head needs the token each hidden state chose (next_tokens)")
        n, dim = hidden.shape[0], self.hidden_size
        states = self.step(hidden.to(self.w_in.dtype), model.embed_tokens(next_tokens))[:, None]  # the root's: [N, 1, H]
        levels = []
        for d, level in enumerate(tree.grow):
            logits = self.vocab_logits(states.reshape(-1, dim).to(hidden.dtype), model).view(n, states.shape[1], -1)
            guesses = self.vocab_ids(top_ids(logits, level.width))  # [N, expanding, width] token ids
            tokens = guesses[:, level.parent_pos, level.ranks]  # [N, level's nodes]
            levels.append(tokens)
            if d + 1 < len(tree.grow):  # the next level's expanding nodes step their parent's state
                grow = tree.grow[d + 1].expanding
                parents = states.index_select(1, level.parent_pos.index_select(0, grow))
                chosen = tokens.index_select(1, grow)
                states = self.step(parents.reshape(-1, dim), model.embed_tokens(chosen.reshape(-1))).view(n, -1, dim)
        return torch.cat(levels, dim=1)

    def tensors(self) -> dict[str, torch.Tensor]:
        norms = {"norm_state": self.norm_state, "norm_embed": self.norm_embed} if self.input_norm else {}
        return {"w_in": self.w_in, "b_in": self.b_in, "w_out": self.w_out, "b_out": self.b_out, **norms}


AnyDraftHeads = DraftHeads | RecurrentDraftHead


def make_heads(kind: str, max_drafts: int, hidden_size: int, vocab_size: int,
               intermediate_size: int = 0, input_norm: bool = False) -> AnyDraftHeads:
    """Untrained heads of ``kind`` ("recurrent" or "medusa"); ``intermediate_size`` is the recurrent block's
    width (0: twice the hidden size), ``input_norm`` whether it normalises its inputs."""
    if kind == "medusa":
        return DraftHeads(max_drafts, hidden_size, vocab_size)
    if kind == "recurrent":
        return RecurrentDraftHead(max_drafts, hidden_size, vocab_size, intermediate_size, input_norm)
    raise ValueError(f"draft head kind must be one of {', '.join(HEAD_KINDS)}, got {kind!r}")


def heads_path(engine_dir: Path) -> Path:
    """Where the draft heads of the engine in ``engine_dir`` live."""
    return Path(engine_dir) / HEADS_NAME


def heads_meta_path(engine_dir: Path) -> Path:
    """The JSON beside the heads: shape and training summary."""
    return Path(engine_dir) / HEADS_META_NAME


def save_draft_heads(heads: AnyDraftHeads, engine_dir: Path, meta: dict) -> Path:
    """Write ``heads`` (float32) and a JSON of their kind, shape and ``meta`` next to the engine; the weights' path."""
    path = heads_path(engine_dir)
    tensors = {name: t.detach().float().cpu().contiguous() for name, t in heads.tensors().items()}
    if heads.token_counts is not None:
        tensors[COUNTS_NAME] = heads.token_counts.to(torch.int64).cpu().contiguous()
    save_file(tensors, str(path), metadata={"format": str(FORMAT_VERSION), "kind": heads.kind})
    summary = {
        "format": FORMAT_VERSION, "kind": heads.kind, "num_heads": heads.num_heads, "hidden_size": heads.hidden_size,
        "vocab_size": heads.vocab_size, "weights": HEADS_NAME, "training": meta,
        # Drafts come from this many of the most frequent tokens of the training answers (0: every token).
        "draft_vocab_size": heads.draft_vocab_size,
    }
    if isinstance(heads, RecurrentDraftHead):
        summary["intermediate_size"] = heads.intermediate_size
        summary["input_norm"] = heads.input_norm
    heads_meta_path(engine_dir).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return path


def read_heads_meta(engine_dir: Path) -> dict:
    """The JSON written by ``save_draft_heads``."""
    path = heads_meta_path(engine_dir)
    if not path.is_file():
        raise FileNotFoundError(f"no draft heads description at {path}: train heads with `inflight train-draft`")
    return json.loads(path.read_text(encoding="utf-8"))


def load_draft_heads(
    engine_dir: Path, model_config, device: torch.device, dtype: torch.dtype, draft_vocab: int | None = None,
) -> AnyDraftHeads:
    """The heads saved in ``engine_dir`` (the engine's folder, or one of their own), checked against
    ``model_config`` and cast to ``dtype`` on ``device``; ``draft_vocab``: draft among that many of the training
    answers' most frequent tokens (0: all of them; None: as saved).

    Raises FileNotFoundError when there are none, ValueError when they were
    trained for a model of another hidden size or vocabulary, the file is not
    a draft heads file (or is of a newer format), or a draft vocabulary is
    asked of heads saved without token counts.
    """
    path = heads_path(engine_dir)
    if not path.is_file():
        raise FileNotFoundError(f"no draft heads at {path}: train them with `inflight train-draft ENGINE_DIR`, "
                                f"which saves them in the engine's folder, or with `--output {engine_dir}`")
    meta = read_heads_meta(engine_dir)
    kind = meta.get("kind", "medusa")  # format 1 had only Medusa heads
    if int(meta.get("format", 1)) > FORMAT_VERSION:
        raise ValueError(f"{path} was written in draft heads format {meta['format']}; this version reads up to "
                         f"{FORMAT_VERSION}: upgrade inflight or retrain the heads")
    tensors = load_file(str(path))
    counts = tensors.pop(COUNTS_NAME, None)
    hidden_size, vocab_size = int(meta.get("hidden_size", -1)), int(meta.get("vocab_size", -1))
    if hidden_size != model_config.hidden_size or vocab_size != model_config.vocab_size:
        raise ValueError(
            f"{path} holds heads for hidden size {hidden_size} and vocabulary {vocab_size}, but the engine's model "
            f"{model_config.name} has hidden size {model_config.hidden_size} and vocabulary {model_config.vocab_size}: "
            f"retrain them with `inflight train-draft {engine_dir}`"
        )
    if kind == "medusa":
        heads: AnyDraftHeads = DraftHeads(int(meta.get("num_heads", 0)) or 1, hidden_size, vocab_size)
    elif kind == "recurrent":
        heads = RecurrentDraftHead(int(meta.get("num_heads", 0)) or 1, hidden_size, vocab_size,
                                   int(meta.get("intermediate_size", 0)), bool(meta.get("input_norm", False)))
    else:
        raise ValueError(f"{path}: unknown draft head kind {kind!r} (this version reads {', '.join(HEAD_KINDS)})")
    expected = {name: tuple(t.shape) for name, t in heads.tensors().items()}
    found = {name: tuple(t.shape) for name, t in tensors.items()}
    if found != expected:
        raise ValueError(f"{path} is not a {kind} draft heads file: tensors {found}, expected {expected}")
    heads.load_state_dict(tensors)
    heads = heads.to(device=device, dtype=dtype).eval().requires_grad_(False)
    if counts is not None:
        if tuple(counts.shape) != (vocab_size,):
            raise ValueError(f"{path}: token counts of shape {tuple(counts.shape)}, expected ({vocab_size},)")
        heads.token_counts = counts.to(torch.int64)
    heads.use_draft_vocab(int(meta.get("draft_vocab_size", 0)) if draft_vocab is None else draft_vocab)
    return heads
