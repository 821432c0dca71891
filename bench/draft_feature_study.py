"""Would the target's earlier layers lift the draft head's first draft? A study on the target's own answers.

The served recurrent head (``draft_heads.RecurrentDraftHead``) reads the
target's final hidden state, which the target has shaped to name the next
token, and the token chosen there. Its first draft is right about 42% of the
time on these data, and every chain passes through it (bench/draft_head_variants.py,
bench/draft_attention_study.py: an attention layer over the context does not
raise it). EAGLE-3 (Li et al. 2025) feeds its draft a fusion of a low, a middle
and a high layer of the target instead of the last one alone. This study adds
that to the recurrent head's first step: its block reads
``h + W [n(x_a); n(x_b); ...]`` beside the token, where ``x_a`` is the residual
stream after ``a`` of the target's layers, ``n`` an RMS normalisation and ``W``
starts at zero, so the head starts as the served one. Later steps read the
state the chain predicted, as before (the target's layers exist only for rows
it has run).

Both heads train on the same rows (the target's greedy answers to built-in chat
requests, read back with their chat-templated requests in front so that every
layer sees the context serving would) with ``train_heads.train_heads``, and are
judged the same way (``train_heads.head_agreement``): per-draft agreement with
the target's argmax and drafts accepted per round of a walk through each answer
as greedy serving verifies it, on the held-out requests and on the serving
benchmark's chat prompts. Serving such a head needs the engine to keep those
layers' rows for the positions a chain starts from; this measures what it
would buy before that is built.

    python bench/draft_feature_study.py --device cpu --num-texts 256 --epochs 2 \\
        --data-cache W/draft_head_data.pt --output bench/results/cpu_draft_feature_study_smollm2.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import log, write_report  # noqa: E402
from draft_attention_study import Text, with_prompts  # noqa: E402
from draft_head_variants import _distill_config, add_study_args, load_or_prepare, study_engine  # noqa: E402
from model_shapes import default_load_format  # noqa: E402
from speculative import CHAT  # noqa: E402  (the chat prompts the serving benchmark runs)

from executor_svc.speculative.draft_heads import RecurrentDraftHead  # noqa: E402


def default_layers(num_layers: int) -> list[int]:
    """EAGLE-3's choice: the residual stream after 2 layers, after half of them and 3 before the last."""
    return sorted({2, num_layers // 2, num_layers - 3})


class LayerTap:
    """Records, for every forward of ``model`` while open, the residual stream after each of ``layers`` of its
    decoder layers ([len(layers), tokens, H] a forward, float32) into ``outputs``."""

    def __init__(self, model: nn.Module, layers: list[int]) -> None:
        if not all(1 <= n <= len(model.layers) for n in layers):
            raise SystemExit(f"--layers must name layer counts in [1, {len(model.layers)}], got {layers}")
        self.model, self.layers = model, layers
        self.outputs: list[torch.Tensor] = []
        self._pending: dict[int, torch.Tensor] = {}
        self._handles: list = []

    def _hook(self, count: int):
        def record(module, inputs, output) -> None:
            x, residual = output  # a decoder layer returns its output before the residual add, and the residual
            self._pending[count] = (x + residual).float()
            if len(self._pending) == len(self.layers):
                self.outputs.append(torch.stack([self._pending.pop(n) for n in self.layers]))
        return record

    def __enter__(self) -> LayerTap:
        self._handles = [self.model.layers[n - 1].register_forward_hook(self._hook(n)) for n in self.layers]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()


class LayerFeatureHead(RecurrentDraftHead):
    """The recurrent head whose first step's block also reads ``features`` [N, F] (the normalised residual streams
    of a few of the target's layers, side by side) through ``w_fuse`` [H, F], zero at the start."""

    fused = False  # the Triton chain reads the final state alone

    def __init__(self, max_drafts: int, hidden_size: int, vocab_size: int, num_features: int,
                 intermediate_size: int = 0) -> None:
        super().__init__(max_drafts, hidden_size, vocab_size, intermediate_size)
        self.w_fuse = nn.Parameter(torch.zeros(hidden_size, num_features))

    def first_step(self, state: torch.Tensor, token_embedding: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Step 1: the block reads the fused state; the residual stays the target's own state."""
        fused = state + F.linear(features.to(state.dtype), self.w_fuse)
        x = torch.cat([fused, token_embedding.to(state.dtype)], dim=-1)
        return state + F.linear(F.silu(F.linear(x, self.w_in, self.b_in)), self.w_out, self.b_out)

    def forward(self, hidden: torch.Tensor, model: nn.Module, tokens: torch.Tensor,
                features: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        state = hidden.to(self.w_in.dtype)
        embeddings = model.embed_tokens(tokens)  # [N, k, H]
        states = [state := self.first_step(state, embeddings[:, 0], features)]
        for i in range(1, tokens.shape[1]):
            states.append(state := self.step(state, embeddings[:, i]))
        stacked = torch.stack(states, dim=1)  # [N, k, H]
        logits = model.compute_logits(stacked.reshape(-1, self.hidden_size).to(hidden.dtype))
        return logits.view(hidden.shape[0], tokens.shape[1], -1), stacked

    @torch.inference_mode()
    def propose(self, hidden: torch.Tensor, model: nn.Module, num_tokens: int, next_tokens: torch.Tensor | None = None,
                features: torch.Tensor | None = None) -> torch.Tensor:
        state, token, drafts = hidden.to(self.w_in.dtype), next_tokens, []
        for i in range(num_tokens):
            embedding = model.embed_tokens(token)
            state = self.first_step(state, embedding, features) if i == 0 else self.step(state, embedding)
            token = self.vocab_ids(self.vocab_logits(state.to(hidden.dtype), model).argmax(dim=-1))
            drafts.append(token)
        return torch.stack(drafts, dim=1)


def answer_rows(engine, requests: list[str], answers: list[Text], layers: list[int], max_tokens: int):
    """``answers`` read back with their requests in front: per answer, its rows' final hidden states [T, H], tokens
    [T] and the normalised residual streams after ``layers`` side by side [T, len(layers) x H]."""
    with LayerTap(engine.model, layers) as tap:
        texts = with_prompts(engine, requests, answers, max_tokens)
    rows = []
    for text, streams in zip(texts, tap.outputs):
        streams = streams[:, text.first :].clone()  # (a normal tensor: recorded under inference mode)
        normed = streams * torch.rsqrt(streams.pow(2).mean(-1, keepdim=True) + 1e-6)
        rows.append((text.hidden[text.first :], text.tokens[text.first :], normed.transpose(0, 1).flatten(1)))
    return rows


def fit_and_judge(head, engine, config, train, held_out, chat, with_features: bool) -> dict:
    """Train ``head`` on ``train``'s rows and judge it on the held-out and chat rows (``answer_rows``' triples)."""
    from executor_svc.speculative.train_heads import answer_token_counts, head_agreement, train_heads

    model = engine.model
    head = head.to(engine.device)
    head.token_counts = answer_token_counts([t for _, t, _ in train], engine.model_config.vocab_size)
    head.use_draft_vocab(config.draft_vocab)

    def features(rows):
        return [f for _, _, f in rows] if with_features else None

    began = time.perf_counter()
    losses = train_heads(head, model, [h for h, _, _ in train], [t for _, t, _ in train], config, True,
                         features(train))
    seconds = time.perf_counter() - began
    head.eval()
    judged = {}
    for name, rows in (("held_out", held_out), ("bench_chat", chat)):
        measured = head_agreement(head, model, [h for h, _, _ in rows], features(rows))
        judged[name] = {"agreement": measured.per_draft, "mean_accepted": measured.mean_accepted,
                        "walk_accepted": measured.walk_accepted}
    return {"train_seconds": round(seconds, 1), "epoch_losses": losses, **judged}


def run(args: argparse.Namespace) -> dict:
    from executor_svc.speculative.chat_prompts import chat_requests

    engine, base = study_engine(args, args.steps)
    data, chat_hidden = load_or_prepare(engine, base, args)
    model = engine.model
    for p in model.parameters():
        p.requires_grad_(False)
    layers = [int(n) for n in args.layers.split(",")] if args.layers else default_layers(len(model.layers))
    log(f"features: the residual stream after layers {layers} of {len(model.layers)}")
    train = answer_rows(engine, chat_requests(args.num_texts), [Text(h, t) for h, t in zip(data.hidden, data.tokens)],
                        layers, args.max_tokens)
    held_out = answer_rows(engine, chat_requests(args.num_eval_texts, held_out=True),
                           [Text(h, None) for h in data.eval_hidden], layers, args.max_tokens)
    chat = answer_rows(engine, CHAT, [Text(h, None) for h in chat_hidden], layers, args.max_tokens)
    config = _distill_config(**base)
    hidden, vocab = engine.model_config.hidden_size, engine.model_config.vocab_size
    report = {
        "engine_dir": engine.engine_dir.name, "dtype": str(engine.dtype), "data": data.data,
        "eval_data": data.eval_data, "layers": layers, "num_layers": len(model.layers),
        "training_positions": sum(h.shape[0] for h, _, _ in train),
        "held_out_positions": sum(h.shape[0] for h, _, _ in held_out),
        "bench_chat_positions": sum(h.shape[0] for h, _, _ in chat),
        "settings": {k: v for k, v in vars(args).items() if k not in ("output", "data_cache")},
        "heads": {},
    }
    for name in args.heads.split(","):
        torch.manual_seed(config.seed)  # both heads draw the same block weights
        if name == "recurrent":
            head = RecurrentDraftHead(config.num_heads, hidden, vocab, config.intermediate_size)
        elif name == "layer_features":
            head = LayerFeatureHead(config.num_heads, hidden, vocab, len(layers) * hidden, config.intermediate_size)
        else:
            raise SystemExit(f"--heads: unknown head {name!r} (recurrent, layer_features)")
        result = fit_and_judge(head, engine, config, train, held_out, chat, name == "layer_features")
        report["heads"][name] = result
        held, bench = result["held_out"], result["bench_chat"]
        log(f"{name}: held-out first draft {held['agreement'][0]:.1%}, {held['walk_accepted']:.2f} per round; "
            f"bench chat {bench['agreement'][0]:.1%}, {bench['walk_accepted']:.2f} ({result['train_seconds']:.0f} s)")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_study_args(p)  # the data and its --data-cache are draft_head_variants.py's
    p.add_argument("--steps", type=int, default=4, help="chain depth trained and judged")
    p.add_argument("--layers", default="", help="layer counts whose residual streams the first step reads "
                                                "(default: 2, half and 3 before the last, as EAGLE-3)")
    p.add_argument("--heads", default="recurrent,layer_features", help="which heads to train, in order")
    args = p.parse_args(argv)
    default_load_format(args)
    write_report("bench/draft_feature_study.py", argv, args.device, Path(args.output), run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
