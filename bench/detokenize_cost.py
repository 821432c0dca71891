"""Host cost of streaming a step's tokens as text, by batch size and tokens per request (CPU).

The step loop detokenizes every streaming request's new tokens before it plans the step after
next; with speculation a request gets a run of tokens a step. This times one step's text for
``batch`` requests of ``tokens`` new tokens each, three ways:

* ``transformers_per_token``: two windows decoded per token through transformers' ``decode``
  (how the loop decoded a run of tokens before);
* ``rust_per_token``: the same windows through the Rust tokenizer directly (``add_tokens``);
* ``batch``: ``detokenize_batch``, which decodes a run of tokens at once (what the loop does now).

  python bench/detokenize_cost.py --output bench/results/cpu_detokenize_cost_smollm2.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_common import CORPUS, log, write_report  # noqa: E402


class _TransformersDecode:
    """A tokenizer whose ``decode`` goes through transformers' wrapper, as the loop's did."""

    def __init__(self, tokenizer) -> None:
        self.hf = tokenizer.hf

    def decode(self, token_ids: list[int]) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=True)


def step_ms(tokenizer, text_ids: list[int], batch: int, tokens: int, way: str, steps: int) -> float:
    """Mean ms to detokenize one step of ``batch`` requests with ``tokens`` new tokens each."""
    from scheduler_svc.detokenizer import IncrementalDetokenizer, detokenize_batch

    decoder = _TransformersDecode(tokenizer) if way == "transformers_per_token" else tokenizer
    span = tokens * steps + 8
    starts = [(i * 37) % (len(text_ids) - span) for i in range(batch)]
    detoks = [IncrementalDetokenizer(decoder, text_ids[s : s + 8]) for s in starts]  # type: ignore[arg-type]
    started = time.perf_counter()
    for step in range(steps):
        items = [(d, text_ids[s + 8 + step * tokens : s + 8 + (step + 1) * tokens]) for d, s in zip(detoks, starts)]
        if way == "batch":
            detokenize_batch(tokenizer, items)
        else:
            for detok, ids in items:
                detok.add_tokens(ids)
    return (time.perf_counter() - started) / steps * 1e3


def run(args: argparse.Namespace) -> dict:
    from inflight.model_store import resolve_model
    from scheduler_svc.tokenizer import Tokenizer

    tokenizer = Tokenizer(resolve_model(args.model, progress=False))
    text_ids = tokenizer.encode(CORPUS * 4)
    ways = ("transformers_per_token", "rust_per_token", "batch")
    rows = []
    for batch in args.batch_sizes:
        for tokens in args.tokens:
            ms = {way: min(step_ms(tokenizer, text_ids, batch, tokens, way, args.steps) for _ in range(3)) for way in ways}
            rows.append({"batch": batch, "tokens_per_request": tokens, "ms_per_step": {k: round(v, 4) for k, v in ms.items()},
                         "us_per_token": {k: round(v * 1e3 / (batch * tokens), 3) for k, v in ms.items()}})
            log(f"batch {batch:4d}, {tokens:2d} tokens a request: " + ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items()))
    return {"model": args.model, "steps_per_timing": args.steps, "best_of": 3, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="whose tokenizer")
    p.add_argument("--batch-sizes", type=lambda s: [int(v) for v in s.split(",")], default=[1, 64, 256])
    p.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",")], default=[1, 2, 4, 16],
                   help="new tokens per request per step")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--output", type=Path, default=Path("bench/results/cpu_detokenize_cost.json"))
    args = p.parse_args(argv)
    write_report("bench/detokenize_cost.py", argv, "cpu", args.output, run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
