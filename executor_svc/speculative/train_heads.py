"""Self-distillation of draft heads from the frozen target (Medusa-2's and EAGLE's recipe).

The target runs over text with teacher forcing; its final hidden states h_t
are kept. Draft i (i = 0..K-1) made at position t learns to match the
target's own distribution p_{t+1+i} (the one it gives for the token at
t + 2 + i), with a KL loss per draft weighted ``head_loss_decay ** i``, summed
over drafts. The labels come from the target, not from the text, so the heads
learn what the target will say, which is exactly what verification accepts.

* Medusa heads: head i reads h_t.
* The recurrent head steps a state from h_t, fed the text's tokens
  t + 1 .. t + 1 + i (teacher forcing; on self-generated text they are the
  target's greedy tokens, what an accepted chain feeds it). Its step i also
  learns to predict the target's hidden state h_{t+1+i} itself (smooth L1,
  weighted ``hidden_loss_weight``): without that, the state drifts from
  anything the lm_head was made for and chains fall apart after one or two
  drafts (a CPU experiment on SmolLM2's greedy continuations of docstrings:
  0.78 accepted drafts per step at k = 4 with weight 0, 1.05 with weight 10,
  against 0.93 for four Medusa heads). Optimiser settings matter as much: on
  the H200, chat answers, lr 3e-3 without clipping reached 0.33 accepted
  drafts per step, lr 1e-3 with gradients clipped to norm 1 reached 0.88.

Memory: only the hidden states are kept ([tokens, hidden] in the target's
dtype); the target's full-vocabulary distributions are recomputed from them
per minibatch (one lm_head GEMM), never stored for the whole corpus.

Data (``self_generate``, the default, as Medusa-2 recommends: when serving,
the heads read hidden states of contexts made of the target's own accepted
tokens, not of human text; it costs a decode step per token, seconds on a GPU
and minutes on a CPU):

* ``chat`` (the default): user requests (``--data FILE``, one per line; else
  ``requests``: the built-in templated ones of ``chat_prompts``, ones the
  target writes itself by continuing its chat template where a user's message
  begins, or half each) wrapped in the tokenizer's chat template, answered
  greedily by the target; the held-out report uses built-in requests about
  subjects training never saw, answered the same way.
* otherwise texts (``--data FILE`` or the built-in stdlib-docstring corpus):
  the target continues each text's first ``prompt_tokens`` tokens greedily,
  or with ``self_generate=False`` the texts are used as they are (one context
  forward per text). Measured on SmolLM2-135M (48 built-in texts cut to 128
  tokens, one Medusa head, 3 epochs), held-out head-0 agreement went from
  9.6% untrained to 15.5% with teacher forcing on the texts and to 17.5% with
  self-generated data.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from executor_svc.quantization.corpus import calibration_texts, encode_texts, held_out_texts, text_lines
from executor_svc.quantization.forward import PromptForward
from executor_svc.speculative.chat_prompts import MAX_REQUEST_TOKENS, chat_requests, sampled_requests
from executor_svc.speculative.draft_heads import HEAD_KINDS, AnyDraftHeads, make_heads
from executor_svc.speculative.self_generation import check_vocabulary, self_generate, tokenizer_eos_ids

# Where chat requests come from when no file is given: the built-in templated ones (``chat_requests``), ones the
# target writes itself (``sampled_requests``), or half each.
REQUEST_SOURCES = ("builtin", "sampled", "mixed")
SEGMENT_ROWS = 16  # minibatches take runs of consecutive positions: their teacher rows overlap
EVAL_ROWS = 128  # positions scored at once by head_agreement ([rows, K, vocab] float32 logits)


@dataclass(slots=True)
class DistillConfig:
    """Settings of ``inflight train-draft``."""

    num_heads: int = 4  # most drafts per step: Medusa heads, or the recurrent head's chain depth
    kind: str = "recurrent"  # "recurrent" (EAGLE-style) or "medusa"
    data: str = ""  # file of texts (or chat requests), one per line; "" = the built-in ones
    chat: bool = True  # the texts are user requests: wrap each in the chat template, train on the answers
    requests: str = "builtin"  # chat without ``data``: one of REQUEST_SOURCES
    # Training texts: by default every built-in chat request outside the held-out subjects (1,824; the docstrings
    # number about 210). On an H100, SmolLM2's heads trained on all of them for 5 epochs (193 s) accepted 0.87 drafts
    # a round on held-out answers against 0.77 for 1,024 requests and 3 epochs (73 s), and serving rounds emitted
    # 2.16-2.31 tokens against the 2.04-2.26 of earlier runs (bench/results/h100_spec_heads_chat_1848_e5*_smollm2.json).
    # With --requests sampled or mixed, this many requests are written (or half of them).
    num_texts: int = 1824
    max_tokens_per_text: int = 256
    self_generate: bool = True  # train on the target's greedy continuations of the texts' first tokens
    prompt_tokens: int = 16  # self_generate: tokens of each text kept as its prompt
    epochs: int = 5
    lr: float = 1e-3  # AdamW, cosine-decayed to 0 over the run
    max_grad_norm: float = 1.0  # gradients clipped to this norm (the recurrent chain is unrolled: it can spike)
    weight_decay: float = 0.0
    batch_rows: int = 64  # positions per minibatch
    head_loss_decay: float = 0.8  # head i's loss weighs decay ** i: far heads are less often reached
    hidden_loss_weight: float = 10.0  # recurrent head: weight of predicting the target's next hidden state
    intermediate_size: int = 0  # recurrent head: width of its block (0 = twice the hidden size)
    input_norm: bool = False  # recurrent head: RMS-normalise the block's inputs (state and token embedding)
    num_eval_texts: int = 32  # held-out texts for the agreement report
    # Drafts come from this many of the tokens the training answers use most (``DraftVocabulary``); 0: every token.
    # On SmolLM2 (49,152 tokens) the answers to 1,024 chat requests used fewer than 16,384 distinct tokens, the
    # held-out walk accepted as much as with every token (0.768 both), and a chained round of four head drafts took
    # 0.85 ms on an H100 against 0.91 (bench/results/h100_{round_cost,spec_heads}_draft_vocab*_smollm2.json).
    draft_vocab: int = 16384
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_texts", "epochs", "batch_rows", "num_eval_texts", "prompt_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_tokens_per_text < 2:  # head 0 at position t needs the target's row t + 1 inside the text
            raise ValueError(f"max_tokens_per_text must be at least 2, got {self.max_tokens_per_text}")
        if self.lr <= 0 or self.max_grad_norm <= 0:
            raise ValueError(f"lr and max_grad_norm must be positive, got {self.lr} and {self.max_grad_norm}")
        if self.kind not in HEAD_KINDS:
            raise ValueError(f"kind must be one of {', '.join(HEAD_KINDS)}, got {self.kind!r}")
        if self.requests not in REQUEST_SOURCES:
            raise ValueError(f"requests must be one of {', '.join(REQUEST_SOURCES)}, got {self.requests!r}")
        if self.requests != "builtin" and (self.data or not self.chat):
            raise ValueError(f"requests={self.requests!r} chooses where chat requests come from when no data file "
                             "is given: it needs chat and no data")
        if self.chat and not self.self_generate:
            raise ValueError("chat requests carry no answers to train on: chat needs self_generate")
        if self.intermediate_size < 0:
            raise ValueError(f"intermediate_size must be at least 0 (0 = twice the hidden size), "
                             f"got {self.intermediate_size}")
        if self.hidden_loss_weight < 0:
            raise ValueError(f"hidden_loss_weight must be at least 0, got {self.hidden_loss_weight}")
        if self.draft_vocab < 0:
            raise ValueError(f"draft_vocab must be at least 0 (0 = every token), got {self.draft_vocab}")


@dataclass(slots=True)
class DistillReport:
    """What training did, saved in the heads' JSON and printed by the CLI."""

    kind: str
    data: str
    num_texts: int
    num_tokens: int
    self_generate: bool
    epochs: int
    lr: float
    epoch_losses: list[float] = field(default_factory=list)  # weighted KL per position, mean over each epoch
    eval_data: str = ""
    eval_positions: list[int] = field(default_factory=list)  # per head
    agreement_before: list[float] = field(default_factory=list)  # per head, untrained (zero) heads
    agreement_after: list[float] = field(default_factory=list)
    # Held-out drafts a greedy chain of num_heads drafts would have accepted per step (meaningful on
    # self-generated text, where the text is the target's own greedy output).
    mean_accepted_before: float = 0.0
    mean_accepted_after: float = 0.0
    # The same per round of a walk that verifies each text as serving does (``Agreement.walk_accepted``).
    walk_accepted_before: float = 0.0
    walk_accepted_after: float = 0.0
    # The draft vocabulary (0: every token), the share of the training answers' tokens in it, and the trained
    # heads' walk with every token to draft from, for what the smaller vocabulary costs.
    draft_vocab_size: int = 0
    draft_vocab_coverage: float = 1.0
    walk_accepted_whole_vocab: float = 0.0
    seconds: float = 0.0

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(slots=True)
class DistillData:
    """What heads are trained and judged on: the target's final hidden states from each text's first drafted
    position on (with chat, the answers: the template's turns are the same in every text, and would flatter the
    held-out figures), and the tokens at those positions."""

    hidden: list[torch.Tensor]  # [positions, H] per training text
    tokens: list[torch.Tensor]  # [positions] int64 per training text
    eval_hidden: list[torch.Tensor]  # [positions, H] per held-out text
    data: str  # what the training texts are
    eval_data: str  # and the held-out ones


def prepare_data(engine, config: DistillConfig, progress: bool = True) -> DistillData:
    """The texts of ``config`` (generated by the target where asked) and the target's hidden states over them."""
    max_tokens = min(config.max_tokens_per_text, engine.max_seq_len)
    (token_lists, starts, data), (eval_lists, eval_starts, eval_data) = training_texts(engine, config, max_tokens, progress)
    runner = prompt_runner(engine, max_tokens)
    hidden = answer_hidden(runner, token_lists, starts, "hidden states", progress)
    eval_hidden = answer_hidden(runner, eval_lists, eval_starts, "held-out hidden states", progress)
    tokens = [torch.tensor(ids[s:], dtype=torch.int64, device=engine.device) for ids, s in zip(token_lists, starts)]
    return DistillData(hidden, tokens, eval_hidden, data, eval_data)


def answer_hidden(
    runner: PromptForward, token_lists: list[list[int]], starts: list[int], desc: str, progress: bool = True
) -> list[torch.Tensor]:
    """Each text's hidden states from its row ``starts[i]`` on."""
    return [h[s:] for h, s in zip(collect_hidden(runner, token_lists, desc, progress), starts)]


def fit_heads(engine, config: DistillConfig, data: DistillData, progress: bool = True
              ) -> tuple[AnyDraftHeads, DistillReport]:
    """Heads of ``config.kind`` trained on ``data`` and judged on its held-out texts, before and after."""
    began = time.perf_counter()
    torch.manual_seed(config.seed)  # the recurrent head's random input projection
    config_model = engine.model_config
    heads = make_heads(config.kind, config.num_heads, config_model.hidden_size, config_model.vocab_size,
                       config.intermediate_size, config.input_norm)
    heads = heads.to(engine.device)  # trained in float32 whatever the target's dtype
    report = DistillReport(config.kind, data.data, len(data.hidden), sum(h.shape[0] for h in data.hidden),
                           config.self_generate, config.epochs, config.lr, eval_data=data.eval_data)
    heads.token_counts = answer_token_counts(data.tokens, config_model.vocab_size)
    heads.use_draft_vocab(config.draft_vocab)
    report.draft_vocab_size = heads.draft_vocab_size
    report.draft_vocab_coverage = round(heads.vocab_coverage() or 1.0, 4)
    before = head_agreement(heads, engine.model, data.eval_hidden)
    report.agreement_before, report.eval_positions = before.per_draft, before.positions
    report.mean_accepted_before, report.walk_accepted_before = before.mean_accepted, before.walk_accepted
    report.epoch_losses = train_heads(heads, engine.model, data.hidden, data.tokens, config, progress)
    after = head_agreement(heads, engine.model, data.eval_hidden)
    report.agreement_after, report.mean_accepted_after, report.walk_accepted_after = (
        after.per_draft, after.mean_accepted, after.walk_accepted)
    report.walk_accepted_whole_vocab = after.walk_accepted
    if report.draft_vocab_size:
        heads.use_draft_vocab(0)
        report.walk_accepted_whole_vocab = head_agreement(heads, engine.model, data.eval_hidden).walk_accepted
        heads.use_draft_vocab(report.draft_vocab_size)
    report.seconds = round(time.perf_counter() - began, 1)
    return heads.eval().requires_grad_(False), report


def answer_token_counts(token_lists: list[torch.Tensor], vocab_size: int) -> torch.Tensor:
    """How often each token id is the target's next token in the training texts ([vocab_size] int64 on the CPU):
    every token of each text but its first (the row that chose the answer's first token)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for tokens in token_lists:
        counts += torch.bincount(tokens[1:].cpu(), minlength=vocab_size)[:vocab_size]
    return counts


def distill_heads(engine, config: DistillConfig, progress: bool = True) -> tuple[AnyDraftHeads, DistillReport]:
    """Train draft heads of ``config.kind`` for ``engine`` (an executor_svc.engine.Engine) and measure them."""
    began = time.perf_counter()
    heads, report = fit_heads(engine, config, prepare_data(engine, config, progress), progress)
    report.seconds = round(time.perf_counter() - began, 1)  # with the data's generation
    return heads, report


Texts = tuple[list[list[int]], list[int], str]  # token lists, each one's first row to learn from, what they are


def training_texts(engine, config: DistillConfig, max_tokens: int, progress: bool = True) -> tuple[Texts, Texts]:
    """The training texts and the held-out ones, generated where asked. With chat, a text's first row is the one
    that chooses the answer's first token; otherwise 0."""
    if config.chat:
        if config.data:
            requests = text_lines(config.data, config.num_texts, "chat requests file")
            data = f"chat requests of {config.data}"
        else:
            requests, data = chat_request_mix(engine, config, progress)
        eval_requests = chat_requests(config.num_eval_texts, held_out=True)
        token_lists, starts = chat_answers(engine, requests, max_tokens, progress)
        eval_lists, eval_starts = chat_answers(engine, eval_requests, max_tokens, progress)
        answered = "the target's greedy answers (chat template), answer positions only"
        return ((token_lists, starts, f"{data}, {answered}"),
                (eval_lists, eval_starts, f"held-out built-in chat requests, {answered}"))
    texts, data = calibration_texts(config.data, config.num_texts)
    eval_texts, eval_data = held_out_texts(config.num_eval_texts)
    token_lists = encode_texts(engine.engine_dir, texts, max_tokens)
    eval_lists = encode_texts(engine.engine_dir, eval_texts, max_tokens)
    if not token_lists or not eval_lists:
        raise ValueError(f"no texts of two or more tokens to train on ({data}) or to evaluate on ({eval_data})")
    check_vocabulary(engine, token_lists + eval_lists)
    if config.self_generate:
        prompts = [ids[: max(1, min(config.prompt_tokens, len(ids) - 1))] for ids in token_lists]
        from scheduler_svc.tokenizer import Tokenizer

        eos = tokenizer_eos_ids(Tokenizer(engine.engine_dir).hf)
        token_lists = self_generate(engine, prompts, max_tokens, eos, progress)
        data += f", greedy continuations of their first {config.prompt_tokens} tokens"
    return (token_lists, [0] * len(token_lists), data), (eval_lists, [0] * len(eval_lists), eval_data)


def chat_request_mix(engine, config: DistillConfig, progress: bool = True) -> tuple[list[str], str]:
    """``config.num_texts`` training requests from ``config.requests``'s source, and what they are."""
    sampled = {"builtin": 0, "sampled": config.num_texts, "mixed": config.num_texts // 2}[config.requests]
    built_in = chat_requests(config.num_texts - sampled)
    written = sampled_requests(engine, sampled, config.seed, progress=progress) if sampled else []
    if sampled and not written:
        raise ValueError("the target wrote no request that ended its turn within "
                         f"{MAX_REQUEST_TOKENS} tokens: train on built-in requests (--requests builtin)")
    # Interleaved, so that a prefix of the list (and every epoch's shuffled minibatches) holds both kinds.
    mixed = [r for pair in itertools.zip_longest(built_in, written) for r in pair if r is not None]
    parts = [f"{len(built_in)} built-in"] * bool(built_in) + [f"{len(written)} target-written"] * bool(written)
    return mixed, " and ".join(parts) + " chat requests"


def chat_answers(engine, requests: list[str], max_tokens: int, progress: bool = True
                 ) -> tuple[list[list[int]], list[int]]:
    """Each user request in the engine's chat template, answered greedily by the target (``max_tokens`` in all,
    or up to an end-of-sequence token), and the row of each that chooses the answer's first token."""
    from scheduler_svc.tokenizer import Tokenizer  # the server's own chat-template path

    tokenizer = Tokenizer(engine.engine_dir)
    if not tokenizer.has_chat_template:
        raise ValueError(f"the engine's tokenizer ({engine.engine_dir}) has no chat template: train with chat off")
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}])[: max_tokens - 1] for t in requests]
    prompts = [p for p in prompts if p]
    answers = self_generate(engine, prompts, max_tokens, tokenizer_eos_ids(tokenizer.hf), progress)
    return answers, [len(p) - 1 for p in prompts]


def prompt_runner(engine, max_tokens: int) -> PromptForward:
    """A context forward of up to ``max_tokens`` tokens in the engine's dtypes, for ``collect_hidden``."""
    return PromptForward.create(engine.model, engine.model_config, max_tokens, engine.tokens_per_block,
                                engine.device, engine.dtype, engine.layout.dtype)


def collect_hidden(
    runner: PromptForward, token_lists: list[list[int]], desc: str, progress: bool = True
) -> list[torch.Tensor]:
    """The target's final hidden states of each text, [tokens, hidden] each, as ordinary (autograd-safe) tensors."""
    # hidden_states runs under inference_mode: its outputs may not be saved for backward, their clones may.
    texts = tqdm(token_lists, desc=desc, unit="text", disable=not progress)
    return [runner.hidden_states(ids).clone() for ids in texts]


def train_heads(
    heads: AnyDraftHeads, model: nn.Module, hidden_lists: list[torch.Tensor], token_lists: list[torch.Tensor],
    config: DistillConfig, progress: bool = True, feature_lists: list[torch.Tensor] | None = None,
) -> list[float]:
    """AdamW over ``config.epochs`` passes of the positions of ``hidden_lists`` (and their texts' tokens,
    ``token_lists``, [tokens] int64 each); the mean loss of each epoch. ``feature_lists`` ([tokens, F] each, row
    for row with ``hidden_lists``): more of the target at each position for heads that read it (``features=``)."""
    device = next(heads.parameters()).device
    hidden_all = torch.cat(hidden_lists)  # [rows, H] in the target's dtype
    features_all = None if feature_lists is None else torch.cat(feature_lists)
    tokens_all = torch.cat(token_lists).to(device)  # [rows]
    lengths = torch.tensor([h.shape[0] for h in hidden_lists], device=device)
    ends = torch.repeat_interleave(torch.cumsum(lengths, 0), lengths)  # [rows] first row past each row's text
    rows = torch.arange(hidden_all.shape[0], device=device)
    segments = rows[rows + 1 < ends].split(SEGMENT_ROWS)  # positions whose next-next token is in the text
    if not segments:
        raise ValueError("no position to train on: every text is shorter than two tokens")
    offsets = torch.arange(1, heads.num_heads + 1, device=device)  # draft i matches the target's row t + 1 + i
    weights = torch.tensor([config.head_loss_decay**i for i in range(heads.num_heads)], device=device)
    num_rows = sum(len(s) for s in segments)
    total_steps = config.epochs * math.ceil(num_rows / config.batch_rows)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total_steps, 1))
    generator = torch.Generator().manual_seed(config.seed)
    heads.train()
    losses = []
    with tqdm(total=total_steps, desc=f"training {heads.kind} heads", unit="step", disable=not progress) as bar:
        for _ in range(config.epochs):
            order = torch.cat([segments[i] for i in torch.randperm(len(segments), generator=generator).tolist()])
            epoch_loss = torch.zeros((), device=device)
            for start in range(0, num_rows, config.batch_rows):
                batch = order[start : start + config.batch_rows]
                loss = distill_loss(heads, model, hidden_all, tokens_all, ends, batch, offsets, weights,
                                    config.hidden_loss_weight, features_all)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(heads.parameters(), config.max_grad_norm)
                optimizer.step()
                schedule.step()
                epoch_loss += loss.detach() * len(batch)
                bar.update(1)
            losses.append(round(float(epoch_loss) / num_rows, 4))
            bar.set_postfix(loss=losses[-1])
    return losses


def distill_loss(
    heads: AnyDraftHeads,
    model: nn.Module,
    hidden_all: torch.Tensor,  # [rows, H] every text's hidden states, back to back
    tokens_all: torch.Tensor,  # [rows] the texts' tokens, aligned with hidden_all
    ends: torch.Tensor,  # [rows] first row past each row's text
    batch: torch.Tensor,  # [B] rows to train on
    offsets: torch.Tensor,  # [K] 1..K
    weights: torch.Tensor,  # [K] per-draft loss weights
    hidden_loss_weight: float = 0.0,
    features_all: torch.Tensor | None = None,  # [rows, F] aligned with hidden_all, for heads that read more
) -> torch.Tensor:
    """Sum over drafts of weight_i x mean over the batch's valid rows of KL(p_target(t + 1 + i) || q_i(t)),
    plus, for the recurrent head, ``hidden_loss_weight`` x smooth L1 between its state i and h_{t + 1 + i}."""
    targets = batch[:, None] + offsets  # [B, K] the row whose next-token distribution draft i matches
    valid = targets < ends[batch][:, None]  # [B, K] the target row is still in the same text
    targets = torch.where(valid, targets, batch[:, None])  # any row of the corpus; masked out below
    unique, inverse = torch.unique(targets, return_inverse=True)  # consecutive positions share teacher rows
    with torch.no_grad():
        teacher = F.log_softmax(model.compute_logits(hidden_all[unique]), dim=-1)  # [U, V] float32
    # The recurrent head's step i is fed the token at t + 1 + i (row t + i's choice) and predicts row t + 1 + i.
    more = {} if features_all is None else {"features": features_all[batch]}
    outputs = heads(hidden_all[batch], model, tokens_all[targets], **more)
    logits, states = outputs if isinstance(outputs, tuple) else (outputs, None)
    student = F.log_softmax(logits, dim=-1)  # [B, K, V]
    per_row = F.kl_div(student, teacher[inverse], log_target=True, reduction="none").sum(-1)  # [B, K]
    if states is not None and hidden_loss_weight:
        hidden_error = F.smooth_l1_loss(states, hidden_all[targets].to(states.dtype), reduction="none").mean(-1)
        per_row = per_row + hidden_loss_weight * hidden_error
    per_draft = (per_row * valid).sum(0) / valid.sum(0).clamp(min=1)  # [K]
    return (per_draft * weights).sum()


class Agreement(NamedTuple):
    """How well draft heads predict the target on held-out text (``head_agreement``)."""

    per_draft: list[float]  # draft i: the fraction of positions where it names the target's greedy token
    positions: list[int]  # positions scored per draft
    # Drafts a greedy chain of all heads would have accepted, on average over every position.
    mean_accepted: float
    # The same over the rounds of a walk through each text as serving verifies it: a round starts where the
    # previous one's verification ended (after its accepted drafts and the target's own token), so rounds
    # start more often just after the heads missed, and this is what a round accepts when serving.
    walk_accepted: float


@torch.inference_mode()
def head_agreement(heads: AnyDraftHeads, model: nn.Module, hidden_lists: list[torch.Tensor],
                   feature_lists: list[torch.Tensor] | None = None) -> Agreement:
    """Per-draft agreement and accepted chain lengths of ``heads`` on the texts' hidden states.

    At position t the drafts follow the target's own choice there (its argmax,
    which the recurrent head is fed), and draft i is right when it names the
    target's argmax at t + 1 + i (teacher-forced on the text): the token greedy
    verification would accept (``chain_agreement`` sums it up). ``feature_lists``: as ``train_heads``'.
    """
    k = heads.num_heads
    rights = []
    for n, hidden in enumerate(hidden_lists):  # hidden: [T, H]
        length = hidden.shape[0]
        if length < 2:
            continue
        greedy = greedy_tokens(model, hidden)  # [T]
        features = None if feature_lists is None else feature_lists[n]
        drafts = torch.cat([heads.propose(hidden[s:e], model, k, greedy[s:e],
                                          **({} if features is None else {"features": features[s:e]}))
                            for s in range(0, length - 1, EVAL_ROWS)
                            for e in [min(s + EVAL_ROWS, length - 1)]])  # [T - 1, K]
        right = torch.zeros_like(drafts, dtype=torch.bool)
        for i in range(min(k, length - 1)):
            right[: length - 1 - i, i] = drafts[: length - 1 - i, i] == greedy[1 + i :]
        rights.append(right)
    return chain_agreement(rights, k)


def greedy_tokens(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The target's argmax after each of ``hidden``'s rows ([T, H] -> [T] int64), a few rows of logits at a time."""
    return torch.cat([model.compute_logits(hidden[s : s + EVAL_ROWS]).argmax(-1)
                      for s in range(0, hidden.shape[0], EVAL_ROWS)])


def chain_agreement(rights: list[torch.Tensor], k: int) -> Agreement:
    """``Agreement`` of drafts judged per text: ``rights[n]`` [T - 1, K] bool, row t column i true when the draft
    i made at position t of text n names the target's argmax at t + 1 + i (rows past the text's end false).

    A chain accepts its drafts up to the first wrong one; both of its means are
    over positions with all K drafts inside the text.
    """
    hits, counts = [0] * k, [0] * k
    accepted, chains, walk_accepted, rounds = 0, 0, 0, 0
    for right in rights:
        length = right.shape[0] + 1
        for i in range(min(k, length - 1)):
            scored = length - 1 - i  # positions 0 .. T - 2 - i have a token t + 1 + i in the text
            hits[i] += int(right[:scored, i].sum())
            counts[i] += scored
        whole = length - k  # positions whose K drafts all lie inside the text
        if whole <= 0:
            continue
        chain = right[:whole].to(torch.int64).cumprod(dim=1).sum(dim=1).tolist()  # drafts each position accepts
        accepted += sum(chain)
        chains += whole
        position = 0
        while position < whole:  # a round starts where the previous one's verification ended
            walk_accepted += chain[position]
            rounds += 1
            position += chain[position] + 1
    agreement = [round(h / c, 4) if c else 0.0 for h, c in zip(hits, counts)]
    return Agreement(agreement, counts, round(accepted / chains, 4) if chains else 0.0,
                     round(walk_accepted / rounds, 4) if rounds else 0.0)
