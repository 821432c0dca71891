"""``inflight train-draft``: draft heads for an engine (recurrent EAGLE-style or Medusa), by self-distillation.

The heads are written next to the engine (``draft_heads.safetensors`` and
``draft_heads.json``), or into ``--output DIR``; ``inflight serve --speculative
draft_heads`` uses the engine's, ``--draft-heads DIR`` another folder's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_train_draft_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``train-draft`` on the CLI's subparsers."""
    from executor_svc.speculative.train_heads import REQUEST_SOURCES, DistillConfig

    d = DistillConfig()
    p = subparsers.add_parser("train-draft", help="train draft heads for an engine (speculative decoding)")
    p.add_argument("engine_dir", help="engine folder; the heads are saved in it unless --output says elsewhere")
    p.add_argument("--output", default=None, metavar="DIR",
                   help="save the heads in this folder instead (serve them with --draft-heads DIR)")
    p.add_argument("--kind", default=d.kind, choices=["recurrent", "medusa"],
                   help="recurrent: one block that steps the target's hidden state a token at a time (EAGLE-style); "
                        "medusa: one independent head per draft position")
    p.add_argument("--num-heads", type=int, default=d.num_heads,
                   help="most draft tokens per step (Medusa heads, or the recurrent head's chain depth)")
    p.add_argument("--data", default=d.data, metavar="FILE",
                   help="training texts, one per line: chat requests with --chat (default: built-in requests), "
                        "documents with --no-chat (default: the built-in stdlib-docstring corpus)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=d.chat,
                   help="the texts are user requests: wrap each in the chat template and train on the target's "
                        "greedy answers (what the heads draft when serving chat)")
    p.add_argument("--requests", default=d.requests, choices=list(REQUEST_SOURCES),
                   help="chat without --data: builtin (templated requests about everyday subjects), sampled (requests "
                        "the target writes itself, continuing its chat template where the user's message begins, at "
                        "temperature 1) or mixed (half each)")
    p.add_argument("--num-texts", type=int, default=d.num_texts,
                   help="training texts (default %(default)s: every built-in chat request outside the held-out ones)")
    p.add_argument("--max-tokens-per-text", type=int, default=d.max_tokens_per_text, help="tokens kept per text")
    p.add_argument("--epochs", type=int, default=d.epochs, help="passes over the training texts (default %(default)s)")
    p.add_argument("--lr", type=float, default=d.lr, help="AdamW learning rate (cosine-decayed)")
    p.add_argument("--max-grad-norm", type=float, default=d.max_grad_norm, help="clip gradients to this norm")
    p.add_argument("--batch-rows", type=int, default=d.batch_rows, help="positions per minibatch")
    p.add_argument("--hidden-loss-weight", type=float, default=d.hidden_loss_weight,
                   help="recurrent head: weight of predicting the target's next hidden state (0 = KL only)")
    p.add_argument("--intermediate-size", type=int, default=d.intermediate_size,
                   help="recurrent head: width of its block (0 = twice the hidden size)")
    p.add_argument("--input-norm", action=argparse.BooleanOptionalAction, default=d.input_norm,
                   help="recurrent head: RMS-normalise the block's inputs, the target's hidden state and the token's "
                        "embedding (EAGLE-3's norms; its chain drafts through torch's kernels, not the Triton chain)")
    p.add_argument("--self-generate", action=argparse.BooleanOptionalAction, default=d.self_generate,
                   help="train on the target's own greedy continuations of the texts' first tokens (what the heads "
                        "see when serving; one decode step per token); --no-self-generate: the texts as they are")
    p.add_argument("--num-eval-texts", type=int, default=d.num_eval_texts,
                   help="held-out texts for the agreement report")
    p.add_argument("--draft-vocab", type=int, default=d.draft_vocab, metavar="N",
                   help="draft from the N tokens the training answers use most, reading only their rows of the LM "
                        "head (0 = every token; the report says how many of the answers' tokens they cover); "
                        "serving may change it (--draft-vocab)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: the engine's device")
    return p


def run_train_draft(args: argparse.Namespace) -> int:
    """Exit status 0 trained and saved, 2 bad engine folder, data or settings."""
    from executor_svc.engine import RuntimeConfig, load_engine, resolve_device
    from executor_svc.engine_file import EngineMismatchError, read_manifest
    from executor_svc.speculative.draft_heads import save_draft_heads
    from executor_svc.speculative.train_heads import DistillConfig, distill_heads

    engine_dir = Path(args.engine_dir)
    try:
        config = DistillConfig(
            num_heads=args.num_heads, kind=args.kind, data=args.data, chat=args.chat, requests=args.requests,
            num_texts=args.num_texts,
            max_tokens_per_text=args.max_tokens_per_text, self_generate=args.self_generate, epochs=args.epochs,
            lr=args.lr, max_grad_norm=args.max_grad_norm, batch_rows=args.batch_rows, hidden_loss_weight=args.hidden_loss_weight,
            intermediate_size=args.intermediate_size, input_norm=args.input_norm,
            num_eval_texts=args.num_eval_texts, draft_vocab=args.draft_vocab, seed=args.seed,
        )
        manifest = read_manifest(engine_dir)
        device = "auto" if args.device == "auto" else str(resolve_device("cuda:0" if args.device == "cuda" else "cpu"))
        # Training runs in caches of its own; the engine's needs to hold only one sequence.
        min_blocks = -(-manifest.max_seq_len // manifest.build_config.tokens_per_block)
        engine = load_engine(engine_dir, RuntimeConfig(device=device, num_kv_blocks=min_blocks, cuda_graphs=False))
    except (FileNotFoundError, EngineMismatchError, ValueError, RuntimeError) as exc:
        print(f"inflight train-draft: {exc}", file=sys.stderr)
        return 2
    output = Path(args.output) if args.output else engine_dir
    try:  # before training: a folder that cannot be written should not cost the minutes of a run
        output.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"inflight train-draft: --output {output}: {exc}", file=sys.stderr)
        return 2
    try:
        heads, report = distill_heads(engine, config)
    except (FileNotFoundError, ValueError) as exc:  # an unreadable or empty --data file
        print(f"inflight train-draft: {exc}", file=sys.stderr)
        return 2
    path = save_draft_heads(heads, output, report.to_json())
    print(format_report(path, heads, report, separate=output != engine_dir))
    return 0


def format_report(path: Path, heads, report, separate: bool = False) -> str:  # AnyDraftHeads, DistillReport
    """What the CLI prints: where the heads went, what they were trained on, and per-draft agreement;
    ``separate``: the heads are in a folder of their own, which serving must be told of."""
    losses = f"{report.epoch_losses[0]:.3f} -> {report.epoch_losses[-1]:.3f}" if report.epoch_losses else "n/a"
    h, k = heads.hidden_size, heads.num_heads
    shape = (f"{k} heads of {h}x{h}" if heads.kind == "medusa"
             else f"one recurrent block [{h}+{h}] -> {heads.intermediate_size} -> {h}, chains of up to {k} drafts")
    lines = [
        f"draft heads {path} ({heads.kind}: {shape}, + the target's lm_head)",
        f"trained on  {report.num_texts} texts, {report.num_tokens} tokens of {report.data}",
        f"training    {report.epochs} epochs, lr {report.lr:g}, loss per epoch {losses}, {report.seconds:.1f} s",
        f"agreement   top-1 with the target's greedy token on {report.eval_data}: untrained -> trained",
    ]
    for i, (before, after, positions) in enumerate(
        zip(report.agreement_before, report.agreement_after, report.eval_positions)
    ):
        lines.append(f"  draft {i} (token t+{i + 2})  {before:6.1%} -> {after:6.1%}   ({positions} positions)")
    lines.append(f"accepted    per step with {k} drafts (greedy chain, held-out): "
                 f"{report.mean_accepted_before:.2f} -> {report.mean_accepted_after:.2f} from every position, "
                 f"{report.walk_accepted_before:.2f} -> {report.walk_accepted_after:.2f} per round as served")
    if report.draft_vocab_size:
        lines.append(f"vocabulary  drafts from the {report.draft_vocab_size} most used tokens "
                     f"({report.draft_vocab_coverage:.1%} of the training answers' tokens); with every token "
                     f"{report.walk_accepted_whole_vocab:.2f} accepted per round as served")
    lines.append("serve with  --speculative draft_heads" + (f" --draft-heads {path.parent}" if separate else ""))
    return "\n".join(lines)
