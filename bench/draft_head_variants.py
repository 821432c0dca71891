"""Draft-head settings compared on one set of the target's own answers, by what serving's rounds accept.

`inflight train-draft` generates its data, trains one head and reports; comparing settings that way
generates the data again for each (the slow part on a CPU) and judges them on the held-out requests
only. Here the target answers the training requests, the held-out requests and the chat prompts that
`bench/speculative.py --prompts chat` serves once; each variant is trained on the same answers and
judged on both evaluation sets by:

* per-draft agreement (draft i names the target's greedy token i + 1 places on);
* drafts accepted per step over every position (what `inflight train-draft` has always reported);
* drafts accepted per round of a walk through each answer whose rounds start where the last
  verification ended (``train_heads.Agreement.walk_accepted``): what greedy serving's rounds accept.
  Serving accepts exactly these rounds' drafts (tests/test_draft_heads.py), so 1 + the walk's mean
  is the tokens a round emits with the heads alone at a fixed draft length.

    python bench/draft_head_variants.py --device cpu --num-texts 256 --epochs 2 \\
        --variants default,inner2304 --output bench/results/cpu_draft_head_variants_smollm2.json

A variant is ``name`` or ``name:setting=value,...`` over DistillConfig's fields (``inner2304`` and
``hidden0`` are spelled out below); every variant shares the run's data, epochs and seed.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import log, write_report  # noqa: E402
from model_shapes import add_model_source_args, default_load_format, resolve_model_source  # noqa: E402
from speculative import CHAT  # noqa: E402  (the chat prompts the serving benchmark runs)

# Short names for the settings compared so far; anything else is ``name:field=value,...``.
NAMED_VARIANTS = {
    "default": {},
    "inner2304": {"intermediate_size": 2304},  # a block four times the hidden size wide, not two
    "hidden0": {"hidden_loss_weight": 0.0},  # KL only: no loss on the predicted hidden state
    "norm": {"input_norm": True},  # RMS norms on the block's inputs
}


def parse_variant(spec: str) -> tuple[str, dict]:
    """(name, DistillConfig overrides) of ``name`` or ``name:field=value,...``."""
    name, _, rest = spec.partition(":")
    if not rest:
        if name not in NAMED_VARIANTS:
            raise SystemExit(f"unknown variant {name!r}: one of {', '.join(NAMED_VARIANTS)} or name:field=value,...")
        return name, dict(NAMED_VARIANTS[name])
    fields = {f.name: f.type for f in dataclasses.fields(_distill_config())}
    overrides = {}
    for item in rest.split(","):
        key, _, value = item.partition("=")
        if key not in fields:
            raise SystemExit(f"variant {spec!r}: {key!r} is not a DistillConfig field")
        kind = str(fields[key])
        overrides[key] = value.lower() in ("1", "true") if kind == "bool" else {"int": int, "float": float}.get(
            kind, str)(value)
    return name, overrides


def _distill_config(**overrides):
    from executor_svc.speculative.train_heads import DistillConfig

    return DistillConfig(**overrides)


def bench_chat_hidden(engine, max_tokens: int, progress: bool) -> list:
    """The target's hidden states over its greedy answers to the serving benchmark's chat prompts."""
    from executor_svc.speculative.train_heads import answer_hidden, chat_answers, prompt_runner

    answers, starts = chat_answers(engine, CHAT, max_tokens, progress)
    return answer_hidden(prompt_runner(engine, max_tokens), answers, starts, "bench chat hidden states", progress)


def load_or_prepare(engine, base: dict, args: argparse.Namespace):
    """(DistillData, the bench chat prompts' hidden states): from ``--data-cache`` when it holds data made with
    the same engine and settings, else generated (and written there when asked)."""
    from executor_svc.speculative.train_heads import DistillData, prepare_data

    # Training settings (epochs) do not change the data: a cache serves runs that train for longer.
    key = {"engine": engine.engine_dir.name, **{k: v for k, v in base.items() if k != "epochs"}, "chat_prompts": CHAT}
    cache = Path(args.data_cache) if args.data_cache else None
    if cache is not None and cache.is_file():
        saved = torch.load(cache, map_location=engine.device)
        if saved["key"] == key:
            log(f"data from {cache}")
            return DistillData(**saved["data"]), saved["chat_hidden"]
        log(f"{cache} holds data of other settings: generating")
    data = prepare_data(engine, _distill_config(**base))
    chat_hidden = bench_chat_hidden(engine, args.max_tokens, progress=True)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        fields = {f.name: getattr(data, f.name) for f in dataclasses.fields(data)}
        torch.save({"key": key, "data": fields, "chat_hidden": chat_hidden}, cache)
    return data, chat_hidden


def study_engine(args: argparse.Namespace, num_heads: int):
    """The target (built, or found in the engine cache) loaded for a study of drafts, with room for one text of
    ``args.max_tokens``, and the data settings of ``--data-cache`` for drafts of ``num_heads`` steps."""
    from executor_svc.build_config import BuildConfig
    from executor_svc.engine import RuntimeConfig, load_engine
    from executor_svc.engine_cache import build_cached
    from inflight.model_store import default_cache_dir

    checkpoint, _ = resolve_model_source(args)
    build = BuildConfig(max_batch_size=8, max_num_tokens=2048, max_seq_len=args.max_tokens, dtype=args.dtype)
    engine_dir = build_cached(checkpoint, build, default_cache_dir(), args.device, args.load_format)
    min_blocks = -(-args.max_tokens // build.tokens_per_block)
    engine = load_engine(engine_dir, RuntimeConfig(device=args.device, num_kv_blocks=min_blocks, cuda_graphs=False))
    base = dict(num_heads=num_heads, num_texts=args.num_texts, max_tokens_per_text=args.max_tokens,
                epochs=args.epochs, num_eval_texts=args.num_eval_texts, seed=args.seed)
    return engine, base


def add_study_args(p: argparse.ArgumentParser) -> None:
    """The options a study of drafts shares with this one: the target, its data and how long to train."""
    add_model_source_args(p)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-texts", type=int, default=1024)
    p.add_argument("--num-eval-texts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per text, prompt and answer")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-cache", default="", metavar="FILE",
                   help="keep the generated data here and reuse it when the engine and settings match")
    p.add_argument("--output", required=True)


def fit_and_judge(engine, config, data, chat_hidden: list) -> dict:
    """Train recurrent heads by ``config`` on ``data`` and judge them on the held-out texts and the bench chat
    prompts' hidden states: per-draft agreement, drafts accepted per step and per round of a served walk."""
    from executor_svc.speculative.train_heads import fit_heads, head_agreement

    heads, trained = fit_heads(engine, config, data)
    chat = head_agreement(heads, engine.model, chat_hidden)
    return {
        "train_seconds": trained.seconds, "epoch_losses": trained.epoch_losses,
        "held_out": {"agreement": trained.agreement_after, "mean_accepted": trained.mean_accepted_after,
                     "walk_accepted": trained.walk_accepted_after},
        "bench_chat": {"agreement": chat.per_draft, "mean_accepted": chat.mean_accepted,
                       "walk_accepted": chat.walk_accepted},
    }


def run(args: argparse.Namespace) -> dict:
    variants = [parse_variant(v) for v in args.variants]
    engine, base = study_engine(args, args.num_heads)
    engine_dir = engine.engine_dir
    if args.requests != "builtin":  # (only then: data cached before the setting existed stays valid)
        base["requests"] = args.requests
    started = time.perf_counter()
    data, chat_hidden = load_or_prepare(engine, base, args)
    data_seconds = time.perf_counter() - started
    training_positions = sum(h.shape[0] for h in data.hidden)
    log(f"data: {len(data.hidden)} training answers ({training_positions} positions), "
        f"{len(data.eval_hidden)} held-out, {len(chat_hidden)} bench chat, {data_seconds:.0f} s")
    report: dict = {
        "engine_dir": engine_dir.name, "device": str(engine.device), "dtype": str(engine.dtype),
        "data": data.data, "eval_data": data.eval_data, "bench_chat_prompts": len(CHAT),
        "training_positions": training_positions,
        "held_out_positions": sum(h.shape[0] for h in data.eval_hidden),
        "bench_chat_positions": sum(h.shape[0] for h in chat_hidden),
        "data_seconds": round(data_seconds, 1), "variants": {},
    }
    for name, overrides in variants:
        result = {"overrides": overrides, **fit_and_judge(engine, _distill_config(**{**base, **overrides}), data,
                                                          chat_hidden)}
        report["variants"][name] = result
        held, chat = result["held_out"], result["bench_chat"]
        log(f"{name}: held-out first draft {held['agreement'][0]:.1%}, accepted per step "
            f"{held['mean_accepted']:.2f} over every position, {held['walk_accepted']:.2f} per round; "
            f"bench chat {chat['agreement'][0]:.1%}, {chat['mean_accepted']:.2f}, {chat['walk_accepted']:.2f} "
            f"({result['train_seconds']:.0f} s)")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_study_args(p)
    p.add_argument("--variants", default="default", type=lambda s: s.split(";") if ";" in s else s.split(","),
                   help="comma-separated names (default, inner2304, hidden0, norm), "
                        "or ';'-separated name:field=value,...")
    p.add_argument("--num-heads", type=int, default=4, help="chain depth the heads train and are judged at")
    p.add_argument("--requests", default="builtin", choices=["builtin", "sampled", "mixed"],
                   help="where the training requests come from (`inflight train-draft --requests`)")
    args = p.parse_args(argv)
    default_load_format(args)
    write_report("bench/draft_head_variants.py", argv, args.device, Path(args.output), run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
