"""Would an attention layer lift the draft head's acceptance? A study on the target's own answers.

The served recurrent head (``draft_heads.RecurrentDraftHead``) steps the target's
final hidden state a token at a time with one MLP block: a draft sees the state
it follows and the token just chosen, nothing else of the context. EAGLE's draft
(Li et al. 2024) is one decoder layer: ``fc([state; e(token)])`` followed by
attention over every earlier position's draft input and an MLP. Serving it needs
a KV cache of its own (one more layer in the paged pool, filled at prefill and
after every verification), which is a large change; this study measures what it
would buy before that is built.

Both drafts are trained on the same data as ``bench/draft_head_variants.py``
(the target's greedy answers to built-in chat requests; ``--data-cache`` shares
the file) and judged the same way (``train_heads.chain_agreement``): per-draft
agreement with the target's argmax and drafts accepted per round of a walk
through each answer as greedy serving verifies it, on the held-out requests and
on the serving benchmark's chat prompts.

The attention draft trains as it would serve (EAGLE-3's "training-time test"):
chain step j at position p feeds the state its step j - 1 predicted at p - 1,
and attends to the true inputs' keys up to where its chain began plus its own
chain's keys, never to another chain's (tests/test_draft_attention_study.py
checks this against chains run a step at a time). The shared data holds answer
positions only, so by default the attention reads the answer so far;
``--with-prompt`` puts each chat-templated request back in front, as serving
would have it, while chains still begin in the answer only.

    python bench/draft_attention_study.py --device cpu --num-texts 256 --epochs 2 \\
        --data-cache W/draft_head_data.pt --output bench/results/cpu_draft_attention_study_smollm2.json
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import log, write_report  # noqa: E402
from draft_head_variants import (  # noqa: E402
    _distill_config, add_study_args, fit_and_judge, load_or_prepare, study_engine)
from model_shapes import default_load_format  # noqa: E402
from speculative import CHAT  # noqa: E402  (the chat prompts the serving benchmark runs)


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x [heads, T, d], cos/sin [T, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class AttentionDraft(nn.Module):
    """EAGLE's one-layer draft over the target's final (normed) hidden states, sharing its embedding and LM head.

    Position p's input is ``fc([s_{p-1}; e(x_p)])``; the layer's output predicts the target's hidden state h_p,
    whose LM head row is the draft for the token after x_p. The state part of ``fc`` starts as the identity and
    the residual branches' output projections at zero, so an untrained draft repeats the previous prediction, as an
    untrained recurrent head does."""

    def __init__(self, config, intermediate_size: int = 0) -> None:
        super().__init__()
        hidden, heads, kv_heads, dim = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        inner = intermediate_size or config.intermediate_size
        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim
        self.fc = nn.Linear(2 * hidden, hidden)
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, :hidden].copy_(torch.eye(hidden))
            self.fc.weight[:, hidden:].normal_(0, hidden**-0.5)
            self.fc.bias.zero_()
        self.attn_norm = nn.Parameter(torch.ones(hidden))
        self.qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * dim, bias=False)
        self.o = nn.Linear(heads * dim, hidden, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(hidden))
        self.gate_up = nn.Linear(hidden, 2 * inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)
        nn.init.zeros_(self.o.weight)
        nn.init.zeros_(self.down.weight)
        inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _rope_tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        angles = torch.arange(length, device=self.inv_freq.device, dtype=torch.float32)[:, None] * self.inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    def _project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Normed rows [T, H] -> q [heads, T, d], k and v [heads, T, d] (KV heads repeated for GQA)."""
        t = x.shape[0]
        q, k, v = self.qkv(rms(x, self.attn_norm)).split(
            [self.heads * self.dim, self.kv_heads * self.dim, self.kv_heads * self.dim], dim=-1)
        q = rope(q.view(t, self.heads, self.dim).transpose(0, 1), cos, sin)
        k = rope(k.view(t, self.kv_heads, self.dim).transpose(0, 1), cos, sin)
        v = v.view(t, self.kv_heads, self.dim).transpose(0, 1)
        group = self.heads // self.kv_heads
        return q, k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)

    def _finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        x = x + self.o(attended.transpose(0, 1).reshape(x.shape[0], -1))
        gate, up = self.gate_up(rms(x, self.mlp_norm)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)

    def chain(self, states: torch.Tensor, embeddings: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Every chain of ``steps`` drafts at once over one text. ``states`` [T, H]: the target's hidden state
        before each position (h_{p-1}); ``embeddings`` [T, H]: e(x_p), the token each position feeds.

        Returns F_1 .. F_steps, each [T, H]: F_j[p] is step j of the chain that began at p - j + 1 (its first step
        fed the true state h_{p-j}), so it predicts h_p. Step j's query attends to the true inputs' keys up to
        p - j + 1 and to its own chain's keys at p - j + 2 .. p; rows with p < j - 1 belong to no chain."""
        length = states.shape[0]
        cos, sin = self._rope_tables(length)
        scale = self.dim**-0.5
        causal = torch.ones(length, length, dtype=torch.bool, device=states.device).tril()
        outputs: list[torch.Tensor] = []
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        state = states
        for j in range(1, steps + 1):
            if j > 1:  # the previous step's prediction at p - 1 is this step's state at p
                state = torch.cat([states[:1], outputs[-1][:-1]], dim=0)
            x = self.fc(torch.cat([state, embeddings], dim=-1))
            q, k, v = self._project(x, cos, sin)
            keys.append(k)
            values.append(v)
            # True inputs' keys up to p - j + 1 ...
            scores = [(q @ keys[0].transpose(1, 2) * scale).masked_fill(~causal.roll(j - 1, 0) | (
                torch.arange(length, device=x.device)[:, None] < j - 1), float("-inf"))] if j > 1 else [
                (q @ keys[0].transpose(1, 2) * scale).masked_fill(~causal, float("-inf"))]
            # ... and the chain's own step-i keys at p - (j - i), i = 2 .. j.
            shifted_values = []
            for i in range(2, j + 1):
                shift = j - i
                k_i = torch.cat([keys[i - 1][:, :1].expand(-1, shift, -1), keys[i - 1][:, : length - shift]], dim=1)
                v_i = torch.cat([values[i - 1][:, :1].expand(-1, shift, -1), values[i - 1][:, : length - shift]], dim=1)
                scores.append((q * k_i).sum(-1, keepdim=True) * scale)
                shifted_values.append(v_i)
            probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
            attended = probs[..., :length] @ values[0]
            for n, v_i in enumerate(shifted_values):
                attended = attended + probs[..., length + n : length + n + 1] * v_i
            outputs.append(self._finish(x, attended))
        return outputs


class Text(NamedTuple):
    """One answer to train or judge on: the target's hidden states [T, H] and the tokens [T] of its rows (None where
    only the target's argmax is fed), and the row that chooses the answer's first token (0 when the text is the
    answer alone; with ``--with-prompt`` the rows before it are the chat-templated request's)."""

    hidden: torch.Tensor
    tokens: torch.Tensor | None
    first: int = 0


def with_prompts(engine, requests: list[str], answers: list[Text], max_tokens: int) -> list[Text]:
    """``answers`` (answer rows only, in the order ``train_heads.chat_answers`` made them from ``requests``) with
    their chat-templated requests put back in front, and the target's hidden states over the whole text."""
    from executor_svc.speculative.train_heads import greedy_tokens, prompt_runner
    from scheduler_svc.tokenizer import Tokenizer

    tokenizer = Tokenizer(engine.engine_dir)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}])[: max_tokens - 1] for t in requests]
    prompts = [p for p in prompts if p]
    if len(prompts) != len(answers):
        raise SystemExit(f"{len(prompts)} requests for {len(answers)} answers: the cached data is of other requests")
    runner = prompt_runner(engine, max_tokens)
    texts = []
    for prompt, answer in zip(tqdm(prompts, desc="hidden states with prompts", unit="text"), answers):
        # The answer's tokens after its first row: its own, or the target's argmax of each row before.
        tail = answer.tokens[1:] if answer.tokens is not None else greedy_tokens(engine.model, answer.hidden)[:-1]
        ids = prompt + tail.tolist()
        hidden = runner.hidden_states(ids).clone()
        if hidden.shape[0] - (len(prompt) - 1) != answer.hidden.shape[0]:
            raise SystemExit("an answer's rows do not line up with its prompt's")
        texts.append(Text(hidden, torch.tensor(ids, device=hidden.device), len(prompt) - 1))
    return texts


def chain_inputs(hidden: torch.Tensor, tokens: torch.Tensor, model: nn.Module):
    """A text's positions 1 .. T-1: (h_{p-1} [T-1, H], e(x_p) [T-1, H], the target's h_p [T-1, H])."""
    return hidden[:-1], model.embed_tokens(tokens[1:]).to(hidden.dtype), hidden[1:]


def chain_loss(draft: AttentionDraft, model: nn.Module, hidden: torch.Tensor, tokens: torch.Tensor, steps: int,
               decay: float, hidden_weight: float, first: int = 0) -> torch.Tensor:
    """Sum over steps j of decay^(j-1) x (KL(target || draft) + hidden_weight x smooth L1 to h_p), each a mean over
    the positions where step j belongs to a chain begun at row ``first`` or later (the answer's rows, when the text
    holds its prompt too): the recurrent head's loss (``train_heads.distill_loss``)."""
    states, embeddings, targets = chain_inputs(hidden, tokens, model)
    with torch.no_grad():
        teacher = F.log_softmax(model.compute_logits(targets), dim=-1)
    total = hidden.new_zeros(())
    for j, predicted in enumerate(draft.chain(states, embeddings, steps), start=1):
        rows = slice(first + j - 1, None)  # row q is step j of the chain begun at q + 1 - j
        student = F.log_softmax(model.compute_logits(predicted[rows]), dim=-1)
        kl = F.kl_div(student, teacher[rows], log_target=True, reduction="none").sum(-1)
        error = F.smooth_l1_loss(predicted[rows], targets[rows], reduction="none").mean(-1)
        total = total + decay ** (j - 1) * (kl + hidden_weight * error).mean()
    return total


@torch.inference_mode()
def draft_rights(draft: AttentionDraft, model: nn.Module, hidden: torch.Tensor, steps: int,
                 tokens: torch.Tensor | None = None, first: int = 0) -> torch.Tensor:
    """[T - 1 - first, steps] bool for ``train_heads.chain_agreement``: row t - first, column i true when the chain
    begun at position t (fed the target's argmax there, as serving feeds the token it chose) names the target's
    argmax at t + 1 + i. ``tokens`` [T]: the text's own tokens, fed instead of the target's argmax (a prompt's
    tokens are not the target's choices); ``first``: the first row a chain may begin at (the answer's)."""
    from executor_svc.speculative.train_heads import greedy_tokens

    greedy = greedy_tokens(model, hidden)  # [T]: the token after each row
    length = hidden.shape[0]
    # Position p feeds the token at p: the target's choice at p - 1, greedy[p - 1], or the text's own.
    fed = greedy[:-1] if tokens is None else tokens[1:]
    states, embeddings = hidden[:-1], model.embed_tokens(fed).to(hidden.dtype)
    right = torch.zeros(length - 1, steps, dtype=torch.bool, device=hidden.device)
    for j, predicted in enumerate(draft.chain(states, embeddings, steps), start=1):
        # predicted[q] is position p = q + 1, step j of the chain begun at t = p - j, naming greedy[p].
        names = model.compute_logits(predicted).argmax(-1)  # [T - 1]
        hits = names == greedy[1:]
        t = torch.arange(length - 1, device=hidden.device) + 1 - j  # the start of each row's chain
        keep = t >= 0
        right[t[keep], j - 1] = hits[keep]
    return right[first:]


def train(draft: AttentionDraft, model: nn.Module, data: list[Text], args: argparse.Namespace) -> list[float]:
    """AdamW over ``args.epochs`` passes, one answer a step (warm-up, then cosine decay; gradients clipped to 1)."""
    texts = [n for n, text in enumerate(data) if text.hidden.shape[0] - text.first > args.steps + 1]
    total = args.epochs * math.ceil(len(texts) / args.texts_per_step)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=args.lr)
    warmup = max(1, int(total * args.warmup))  # a linear warm-up, then cosine decay to 0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    generator = torch.Generator().manual_seed(args.seed)
    losses = []
    with tqdm(total=total, desc="training the attention draft", unit="step") as bar:
        for _ in range(args.epochs):
            order = [texts[i] for i in torch.randperm(len(texts), generator=generator).tolist()]
            epoch_loss = 0.0
            for start in range(0, len(order), args.texts_per_step):
                group = order[start : start + args.texts_per_step]
                optimizer.zero_grad(set_to_none=True)
                for n in group:
                    text = data[n]
                    loss = chain_loss(draft, model, text.hidden.float(), text.tokens, args.steps, args.decay,
                                      args.hidden_weight, text.first) / len(group)
                    loss.backward()
                    epoch_loss += loss.item() * len(group)
                torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
                optimizer.step()
                schedule.step()
                bar.update(1)
            losses.append(round(epoch_loss / len(texts), 4))
            bar.set_postfix(loss=losses[-1])
    return losses


def judged(draft: AttentionDraft, model: nn.Module, texts: list[Text], steps: int) -> dict:
    from executor_svc.speculative.train_heads import chain_agreement

    rights = [draft_rights(draft, model, t.hidden.float(), steps, t.tokens if t.first else None, t.first)
              for t in texts if t.hidden.shape[0] - t.first >= 2]
    measured = chain_agreement(rights, steps)
    return {"agreement": measured.per_draft, "mean_accepted": measured.mean_accepted,
            "walk_accepted": measured.walk_accepted}


def run(args: argparse.Namespace) -> dict:
    engine, base = study_engine(args, args.steps)
    engine_dir = engine.engine_dir
    data, chat_hidden = load_or_prepare(engine, base, args)
    model = engine.model
    for p in model.parameters():
        p.requires_grad_(False)
    train_texts = [Text(h, t) for h, t in zip(data.hidden, data.tokens)]
    held_out = [Text(h, None) for h in data.eval_hidden]
    chat = [Text(h, None) for h in chat_hidden]
    if args.with_prompt:
        from executor_svc.speculative.chat_prompts import chat_requests

        train_texts = with_prompts(engine, chat_requests(args.num_texts), train_texts, args.max_tokens)
        held_out = with_prompts(engine, chat_requests(args.num_eval_texts, held_out=True), held_out, args.max_tokens)
        chat = with_prompts(engine, CHAT, chat, args.max_tokens)
    torch.manual_seed(args.seed)
    draft = AttentionDraft(engine.model_config, args.intermediate_size).to(engine.device)
    params = sum(p.numel() for p in draft.parameters())
    log(f"attention draft: {params / 1e6:.2f}M parameters")
    began = time.perf_counter()
    before = judged(draft, model, held_out, args.steps)
    losses = train(draft, model, train_texts, args)
    seconds = time.perf_counter() - began
    result = {
        "parameters": params, "train_seconds": round(seconds, 1), "epoch_losses": losses,
        "held_out_untrained": before,
        "held_out": judged(draft, model, held_out, args.steps),
        "bench_chat": judged(draft, model, chat, args.steps),
    }
    log(f"attention draft: held-out {result['held_out']}, bench chat {result['bench_chat']}")
    report = {
        "engine_dir": engine_dir.name, "dtype": str(engine.dtype), "data": data.data, "eval_data": data.eval_data,
        "training_positions": sum(h.shape[0] for h in data.hidden),
        "held_out_positions": sum(h.shape[0] for h in data.eval_hidden),
        "bench_chat_positions": sum(h.shape[0] for h in chat_hidden),
        "settings": {k: v for k, v in vars(args).items() if k not in ("output", "data_cache")},
        "attention": result,
    }
    if not args.skip_recurrent:
        report["recurrent"] = fit_and_judge(engine, _distill_config(**base), data, chat_hidden)
        recurrent = report["recurrent"]
        log(f"recurrent head: held-out {recurrent['held_out']}, bench chat {recurrent['bench_chat']}")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_study_args(p)  # the data and its --data-cache are draft_head_variants.py's
    p.add_argument("--steps", type=int, default=4, help="chain depth trained and judged")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=float, default=0.05, help="share of the steps the learning rate warms up over")
    p.add_argument("--texts-per-step", type=int, default=1, help="answers per optimiser step")
    p.add_argument("--decay", type=float, default=0.8, help="step j's loss weighs decay ** (j - 1)")
    p.add_argument("--hidden-weight", type=float, default=10.0, help="weight of the smooth L1 to the hidden state")
    p.add_argument("--intermediate-size", type=int, default=0, help="the layer's MLP width (0: the target's)")
    p.add_argument("--with-prompt", action="store_true",
                   help="the attention draft also reads each answer's chat-templated request (as serving would); "
                        "chains still begin in the answer only")
    p.add_argument("--skip-recurrent", action="store_true", help="do not train the recurrent head for comparison")
    args = p.parse_args(argv)
    default_load_format(args)
    write_report("bench/draft_attention_study.py", argv, args.device, Path(args.output), run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
