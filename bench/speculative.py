"""Speculative decoding benchmarks: speedup at batch 1, no loss under load, and the cost of verifying.

Two parts, each with speculation off measured in the same run:

``generate`` (a real model, e.g. SmolLM2): greedy requests through the real
scheduler and executor in one process. Batch 1 runs the prompts one at a time
and reports output tokens/s with each mode against none, the mean accepted
length (tokens a request gets per step) and acceptance by draft position.
It also reports the decode rate alone (tokens after each request's first over
the time after it): the prompt's step, which speculation leaves as it is, is a
large share of a short answer to a long grounded prompt.
Batch N submits N requests at once (EOS ignored, fixed length) and compares
output tokens/s: the load-aware draft length must keep it from dropping.
Plain decoding alone varies by tens of percent between back-to-back runs of a
few hundred milliseconds, so ``--cycles C`` measures every mode C times in
turn (odd cycles in reverse order) and reports each cycle's speedup and their median.
Mode ``ngram`` chains up to ``--speculative-rounds`` verification rounds per
step on the device; ``ngram_one_round`` verifies one round per step, for
comparison. ``draft_heads_tree`` is ``draft_heads`` verifying tree drafts of
``--draft-tree``'s shape instead of chains.

``verify-cost`` (random weights of a target and a draft of its family, e.g.
Llama-3.1-8B and Llama-3.2-1B): step time of verifying k drafts against a
plain generation step, and the draft model's time to propose k, at a few batch
sizes. With random weights acceptance means nothing; these times bound what
any acceptance rate can gain, and the report gives the speedup they imply for
a few rates.

Examples:
  python bench/speculative.py generate --device cuda --modes none,ngram,draft_heads --prompts grounded
  python bench/speculative.py verify-cost --device cuda --shape llama-3.1-8b --draft-shape llama-3.2-1b
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shlex
import statistics
import tempfile
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tqdm import tqdm  # noqa: E402

from bench_common import CORPUS, log, write_report  # noqa: E402
from model_shapes import SHAPES, add_model_source_args, default_load_format, resolve_model_source, shape_folder  # noqa: E402


def _paragraphs(text: str) -> list[str]:
    """The corpus's paragraphs, whole: its lines wrap at about 110 characters, and a paragraph's last line ends
    early with a full stop."""
    paragraphs, lines = [], []
    for line in text.splitlines():
        if line.strip():
            lines.append(line.strip())
        if lines and (not line.strip() or (line.endswith(".") and len(line) < 102)):
            paragraphs.append(" ".join(lines))
            lines = []
    return paragraphs + ([" ".join(lines)] if lines else [])


# Requests whose answers copy from their input: summarise, rewrite, edit code.
_PARAGRAPHS = _paragraphs(CORPUS)
_CODE = [
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        self.items.append(item)\n\n"
    "    def pop(self):\n        return self.items.pop()\n",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
]
GROUNDED = (
    [f"Rewrite this text, keeping every sentence:\n\n{p}" for p in _PARAGRAPHS[0::2]]
    + [f"Summarize the following text.\n\n{p}" for p in _PARAGRAPHS[1::2]]
    + [f"Add a docstring to this Python code and return the whole code:\n\n{c}" for c in _CODE]
    + [f"Rename the variable `total` to `acc` in this code and return the code:\n\n{_CODE[0]}",
       f"Rename the method `push` to `add` in this class and return the whole class:\n\n{_CODE[1]}",
       f"Add type hints to this Python code and return the whole code:\n\n{_CODE[2]}"]
)
# Chat at batch 1 is measured on each mode's own greedy text, and 16-bit verification rows round differently
# from a plain step's single row, so answers may part ways (one falling into a loop that drafts well); 24
# prompts keep one such answer from moving the whole figure. The first 12 are the set the earlier results used
# (--num-prompts 12).
CHAT = [
    "What are three benefits of regular exercise?",
    "Write a short story about a dragon who is afraid of the dark.",
    "Explain how a bicycle stays upright.",
    "Give me a recipe for a simple tomato soup.",
    "What is the difference between weather and climate?",
    "Write a haiku about autumn leaves.",
    "How do I make a good first impression at a job interview?",
    "Explain photosynthesis to a ten-year-old.",
    "What should I pack for a weekend camping trip?",
    "Describe the water cycle in a few sentences.",
    "Why is the sky blue?",
    "Suggest five names for a coffee shop.",
    "How can I improve my sleep?",
    "Write a short thank-you note to a neighbor who watered my plants.",
    "What are some good habits for learning a new language?",
    "Explain what a budget is and how to make one.",
    "Tell me a joke about computers.",
    "What is the capital of Australia, and what is it known for?",
    "Give me three ideas for a rainy day with kids.",
    "How does a refrigerator keep food cold?",
    "Write a two-sentence horror story.",
    "What are the main differences between cats and dogs as pets?",
    "Describe a sunset over the ocean.",
    "How do vaccines work?",
]


# --------------------------------------------------------------------------- generate


# A mode may carry its own settings after colons, so that one run compares them against the same plain
# decoding: ``ngram:k15:min1`` is prompt lookup with up to 15 drafts from suffixes of 1 to --ngram-max tokens.
# ``stop0`` runs every chained round even after every request has finished (what ending them early saves).
# ``draft_heads:lookup3:k8``: draft heads, with prompt lookup's drafts (up to 8) wherever the request's last 3+
# tokens occurred earlier in its own tokens (``--heads-lookup``). ``fused0``: a recurrent head's chain in torch's
# kernels rather than its Triton ones (executor_svc/speculative/heads_triton.py), what those save.
# ``heads1``: draft with heads set 1 (sets 1, 2, ...: those --more-train-draft-args trains, then --more-heads').
# ``adaptive0``: always the most drafts (--fixed-draft-length for this mode alone), against the load-aware policy.
# ``ms0``: chained steps of every round allowed, however long (--max-chained-step-ms for this mode alone).
# ``refresh0``: the load-aware policy never runs a longer K again to re-measure it (scheduler_svc/speculation.py).
# ``vocab0``: the heads draft from every token; ``vocab8192`` from the 8,192 their training answers used most
# (default: what the heads were trained with, --train-draft-args '--draft-vocab N').
_MODE_SETTINGS = {"k": "num_draft_tokens", "min": "ngram_min", "max": "ngram_max", "r": "speculative_rounds",
                  "stop": "end_rounds_early", "lookup": "heads_lookup", "fused": "fused_head_kernels",
                  "heads": "heads_set", "adaptive": "adaptive_draft_length", "vocab": "draft_vocab",
                  "ms": "max_chained_step_ms", "refresh": "policy_refresh"}


def _mode_settings(name: str, args) -> tuple[str, argparse.Namespace]:
    """(the mode's name without settings, ``args`` with the settings the name carries applied)."""
    base, *settings = name.split(":")
    values = {}
    for setting in settings:
        key = setting.rstrip("0123456789")
        if key not in _MODE_SETTINGS or key == setting:
            raise SystemExit(f"mode {name!r}: unknown setting {setting!r} (one of {', '.join(k + 'N' for k in _MODE_SETTINGS)})")
        values[_MODE_SETTINGS[key]] = int(setting[len(key):])
    return base, argparse.Namespace(**{**vars(args), **values})


def _mode_config(name: str, args):
    from executor_svc.speculative.proposer import SpeculativeConfig, SpeculativeMode

    # "none_serial": no speculation and no overlapped scheduling (what speculation gives up);
    # "ngram_one_round": prompt lookup verified one round per step (no rounds chained on the device).
    # "draft_heads_tree": draft heads verifying trees of --draft-tree's shape (greedy requests).
    from executor_svc.speculative.draft_tree import parse_tree

    name, args = _mode_settings(name, args)
    base = {"none_serial": "none", "ngram_one_round": "ngram", "draft_heads_tree": "draft_heads"}.get(name, name)
    mode = SpeculativeMode("" if base == "none" else base)
    rounds = 1 if name == "ngram_one_round" else args.speculative_rounds
    tree = parse_tree(args.draft_tree) if name == "draft_heads_tree" else None
    return SpeculativeConfig(mode, args.num_draft_tokens, args.ngram_min, args.ngram_max, max_rounds=rounds,
                             draft_tree=tree, end_rounds_early=bool(getattr(args, "end_rounds_early", 1)),
                             heads_lookup=getattr(args, "heads_lookup", 0),
                             draft_vocab=getattr(args, "draft_vocab", None))


TRACE_LIMIT = 4000  # policy events kept per run of a mode (--trace-policy)
TRACE_CANDIDATES = 8  # a choice among more candidates than this is traced as a summary


def _trace_policy(policy) -> list[dict]:
    """Record every choice and every step cost the draft-length policy sees, in order (``--trace-policy``)."""
    events: list[dict] = []
    choose, observe = policy.choose, policy.observe

    def traced_choose(candidates, other_tokens, draining=False, chainable=False, asked=False):
        k = choose(candidates, other_tokens, draining=draining, chainable=chainable, asked=asked)
        event = {"at": time.perf_counter(), "choose": k, "trial": policy.trial, "chainable": chainable,
                 "draining": draining, "other_tokens": other_tokens}
        if len(candidates) <= TRACE_CANDIDATES:
            event["candidates"] = [[c.num_drafts, round(c.rate, 3), [round(r, 3) for r in c.position_rates or []]]
                                   for c in candidates]
        else:  # a batch's worth: how many, their most drafts, and their mean first-draft rate
            event["num_candidates"] = len(candidates)
            event["most_drafts"] = max(c.num_drafts for c in candidates)
            event["mean_rate"] = round(sum(c.rate for c in candidates) / len(candidates), 3)
        events.append(event)
        return k

    def traced_observe(num_tokens, wall_seconds, overlapped, executor_seconds, plain=True, chained=False, rounds=1):
        events.append({"at": time.perf_counter(), "tokens": num_tokens, "seconds": wall_seconds, "rounds": rounds,
                       "chained": chained, "plain": plain, "overlapped": overlapped, "executor": executor_seconds})
        observe(num_tokens, wall_seconds, overlapped, executor_seconds, plain=plain, chained=chained, rounds=rounds)

    policy.choose, policy.observe = traced_choose, traced_observe
    return events


async def _run(async_engine, requests, desc: str) -> dict:
    """Submit ``requests`` (all at once); output tokens/s and speculation counts."""
    policy = async_engine.scheduler.draft_policy
    choices_before, refreshes_before = dict(policy.choices), policy.refreshes
    now = async_engine.stats().drafts
    stats_before = dataclasses.replace(now, by_position=list(now.by_position), accepted_by_position=list(now.accepted_by_position))
    steps_before, serial_before = async_engine.num_steps, async_engine.num_serial_steps
    outputs: list[list[int]] = [[] for _ in requests]
    usages = [None] * len(requests)
    first_at: list[float | None] = [None] * len(requests)  # when each request's first token arrived
    gaps: list[float] = []  # seconds between a stream's chunks of tokens, after its first
    with tqdm(desc=desc, unit="tok", file=sys.stderr, mininterval=2) as bar:
        async def one(i, request):
            last = 0.0  # when this stream's last chunk of tokens came
            async for chunk in async_engine.generate(request):
                if chunk.token_ids:
                    now = time.perf_counter()
                    if first_at[i] is None:
                        first_at[i] = now
                    else:
                        gaps.append(now - last)
                    last = now
                outputs[i].extend(chunk.token_ids)
                usages[i] = chunk.usage or usages[i]
                bar.update(len(chunk.token_ids))

        started = time.perf_counter()
        await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
        wall = time.perf_counter() - started
    drafts = async_engine.stats().drafts
    proposed = drafts.num_draft_tokens - stats_before.num_draft_tokens
    accepted = drafts.num_accepted - stats_before.num_accepted
    tokens = sum(map(len, outputs))
    return {
        "outputs": outputs, "wall_s": wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
        # Time to the first token (the prompt's step, which speculation does not change), latest request's.
        "ttft_s": max((t - started for t in first_at if t is not None), default=wall),
        "chunk_gaps_s": gaps,
        "steps": async_engine.num_steps - steps_before,
        "serial_steps": async_engine.num_serial_steps - serial_before,  # planned after the previous result
        "draft_tokens": proposed, "accepted_draft_tokens": accepted,
        "draft_length_choices": {
            k: n - choices_before.get(k, 0) for k, n in policy.choices.items() if n > choices_before.get(k, 0)
        },
        "draft_length_refreshes": policy.refreshes - refreshes_before,
        "drafts_by_position": [b - b0 for b, b0 in zip(drafts.by_position, stats_before.by_position)],
        "accepted_by_position": [a - a0 for a, a0 in zip(drafts.accepted_by_position, stats_before.accepted_by_position)],
    }


ARRIVAL_DELAYS_MS = (0, 3, 6, 9, 12, 15, 18, 21)  # after the running answer's first chunk, probe by probe


async def _arrival_probes(async_engine, texts: list[list[int]], probes: int, max_tokens: int, desc: str) -> dict:
    """Time to first token of a request that arrives while another is generating: each probe starts one answer
    of ``max_tokens`` (EOS ignored), waits for its first chunk and a delay (``ARRIVAL_DELAYS_MS`` in turn, so
    arrivals fall at different points of a chained step), then submits a one-token request. With chained
    rounds the arrival waits for the step in flight: all of its rounds, unless the step ends them early."""
    from scheduler_svc.api_types import GenerationRequest

    ttfts, ended_before = [], async_engine.num_rounds_ended
    for i in tqdm(range(probes), desc=desc, file=sys.stderr, mininterval=2):
        running = GenerationRequest(token_ids=texts[i % len(texts)], max_tokens=max_tokens, temperature=0.0,
                                    ignore_eos=True)
        arriving = GenerationRequest(token_ids=texts[(i + 1) % len(texts)], max_tokens=1, temperature=0.0)
        first_chunk = asyncio.Event()

        async def run_answer() -> None:
            async for _ in async_engine.generate(running):
                first_chunk.set()

        answer = asyncio.create_task(run_answer())
        await first_chunk.wait()
        await asyncio.sleep(ARRIVAL_DELAYS_MS[i % len(ARRIVAL_DELAYS_MS)] / 1e3)
        started = time.perf_counter()
        async for _ in async_engine.generate(arriving):
            ttfts.append(time.perf_counter() - started)
        await answer
    ms = _ms_summary(ttfts)
    return {
        "probes": probes, "running_max_tokens": max_tokens, "delays_ms": list(ARRIVAL_DELAYS_MS),
        "ttft_ms": [round(t * 1e3, 3) for t in ttfts], "median_ttft_ms": ms["median"],
        "p90_ttft_ms": ms["p90"], "max_ttft_ms": ms["max"],
        "steps_ended_early": async_engine.num_rounds_ended - ended_before,
    }


def _decode_rate(runs: list[dict]) -> float:
    """Output tokens after the first per second after the first, over one-request runs."""
    return sum(r["output_tokens"] - 1 for r in runs) / max(sum(r["wall_s"] - r["ttft_s"] for r in runs), 1e-9)


def _cost_points(policy) -> dict:
    """What the draft-length policy has learned of step costs (seconds): single, overlapped and executor-side
    steps by their tokens, and chained steps as a host share a step plus a cost a round by its tokens."""
    host, rounds = policy.chained_costs.fit() if policy.chained_costs.recent else (None, [])
    return {
        "serial": policy.costs.points(), "overlapped": policy.overlapped_costs.points(),
        "executor": policy.executor_costs.points(), "chained_host_per_step": host, "chained_per_round": rounds,
    }


def _ms_summary(seconds: list[float]) -> dict | None:
    """How many, and the median, 90th percentile and largest, in ms, of ``seconds`` (None when empty)."""
    if not seconds:
        return None
    ms = sorted(t * 1e3 for t in seconds)
    return {"count": len(ms), "median": statistics.median(ms), "p90": ms[min(len(ms) - 1, int(0.9 * len(ms)))],
            "max": ms[-1]}


def _rates(drafted: list[int], accepted: list[int]) -> list[float | None]:
    return [a / d if d else None for d, a in zip(drafted, accepted)]


def run_generate(args) -> dict:
    from executor_svc.build_config import BuildConfig
    from executor_svc.engine_cache import build_cached
    from executor_svc.engine import RuntimeConfig, load_engine
    from inflight.gc_tuning import release_garbage_collector, settle_garbage_collector
    from inflight.inprocess import InProcessExecutor
    from inflight.model_store import default_cache_dir
    from scheduler_svc.api_types import GenerationRequest
    from scheduler_svc.engine_loop import AsyncEngine, EngineLimits
    from scheduler_svc.tokenizer import Tokenizer

    checkpoint, _ = resolve_model_source(args)
    # The largest batch, and at least one request's verification rows: an engine built for fewer rows
    # verifies outside its CUDA graphs and never chains rounds (h200_spec_ngram_max_batch1_smollm2.json).
    rows = 1 + max(_mode_config(mode, args).num_draft_tokens for mode in args.modes)
    if "draft_heads_tree" in args.modes:  # a round of the tree is 1 + its nodes down to the draft length
        from executor_svc.speculative.draft_tree import DraftTree, parse_tree

        depth = _mode_config("draft_heads_tree", args).num_draft_tokens
        rows = 1 + DraftTree(parse_tree(args.draft_tree)).nodes_within(depth)
    max_batch = args.max_batch_size or max(max(args.batch_sizes), rows)
    build = BuildConfig(max_batch_size=max_batch, max_num_tokens=args.max_num_tokens, max_seq_len=args.max_seq_len,
                        tokens_per_block=args.tokens_per_block, dtype=args.dtype)
    engine_dir = Path(args.engine_dir) if args.engine_dir else build_cached(checkpoint, build, default_cache_dir(), args.device, args.load_format)
    if args.more_train_draft_args and not args.train_heads:
        raise SystemExit("--more-train-draft-args trains heads beside --train-heads' own: pass --train-heads too")
    from executor_svc.speculative.draft_heads import HEADS_META_NAME, heads_meta_path, read_heads_meta

    for folder in args.more_heads:  # before any training: a folder without heads fails at once
        if not heads_meta_path(folder).is_file():
            raise SystemExit(f"--more-heads {folder}: no {HEADS_META_NAME} there (train-draft --output writes one)")
    num_sets = len(args.more_train_draft_args) + len(args.more_heads)
    for mode in args.modes:  # a mode naming a set that will not exist fails at once too
        heads_set = getattr(_mode_settings(mode, args)[1], "heads_set", 0)
        if heads_set > num_sets:
            raise SystemExit(f"mode {mode!r}: no draft heads set {heads_set} (sets 0 to {num_sets}: "
                             "--more-train-draft-args trains sets 1, 2, ..., --more-heads adds sets after them)")
    # Set 0 of draft heads is the engine's own; sets 1, 2, ... (--more-train-draft-args, then --more-heads) live in
    # folders of their own, served by modes with the setting headsN.
    heads_dirs: dict[int, Path] = {0: engine_dir}
    first_given = 1 + (len(args.more_train_draft_args) if args.train_heads else 0)
    for i, folder in enumerate(args.more_heads, start=first_given):
        heads_dirs[i] = Path(folder)
    train_seconds: dict[int, float] = {}
    if args.train_heads:  # `inflight train-draft` with its defaults (self-distillation on the built-in corpus)
        from inflight.cli import main as inflight_main

        device = "cuda" if args.device.startswith("cuda") else "cpu"
        for i, extra in enumerate([args.train_draft_args, *args.more_train_draft_args]):
            if i:
                heads_dirs[i] = Path(tempfile.mkdtemp(prefix=f"inflight-heads{i}-"))
            started = time.perf_counter()
            output = ["--output", str(heads_dirs[i])] if i else []
            if inflight_main(["train-draft", str(engine_dir), "--device", device, *output, *shlex.split(extra)]):
                raise SystemExit(f"training draft heads (set {i}) failed")
            train_seconds[i] = time.perf_counter() - started
    base = load_engine(engine_dir, RuntimeConfig(device=args.device, kv_cache_fraction=args.kv_cache_fraction))
    tokenizer = Tokenizer(engine_dir)
    prompts = {"grounded": GROUNDED, "chat": CHAT}[args.prompts][: args.num_prompts or None]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in prompts]
    vocab = base.model_config.vocab_size  # a random-weight shape (--shape tiny-host) may have fewer ids than the tokenizer
    texts = [[t % vocab for t in ids] for ids in texts]
    report: dict = {
        "engine_dir": engine_dir.name, "prompts": args.prompts, "num_prompts": len(texts),
        "engine": {"max_batch_size": base.max_batch_size, "cuda_graphs": base.decode_graphs is not None,
                   "kernels": {kind: choice.name for kind, choice in base.manifest.plugins.items()},
                   "kernel_timings_us": {kind: choice.timings_us for kind, choice in base.manifest.plugins.items()}},
        "modes": {},
    }
    for i, folder in heads_dirs.items():  # every set of heads, trained here or given (the engine's own too)
        if heads_meta_path(folder).is_file():
            key = "draft_heads" + (str(i) if i else "")
            report[key] = {"train_seconds": train_seconds.get(i), **read_heads_meta(folder)}

    graphs_with_masks: dict = {}

    async def measure(mode: str) -> dict:
        from executor_svc.speculative.draft_heads import RecurrentDraftHead

        spec = _mode_config(mode, args)
        settings = _mode_settings(mode, args)[1]
        heads_set = getattr(settings, "heads_set", 0)
        if heads_set:
            spec = dataclasses.replace(spec, draft_heads_dir=heads_dirs[heads_set])
        # Set on the class before the executor loads its heads and captures their chains' graphs.
        RecurrentDraftHead.fused = bool(getattr(settings, "fused_head_kernels", 1))
        engine = dataclasses.replace(base, speculative=spec)
        if spec.draft_tree is not None and base.decode_graphs is not None:
            # Tree rows need graphs whose attention reads tree masks; the other modes keep the plain ones.
            if "tree" not in graphs_with_masks:
                from executor_svc.engine import capture_graphs

                graphs_with_masks["tree"] = capture_graphs(base, tree_masks=True)
            engine.decode_graphs = graphs_with_masks["tree"]
        adaptive = bool(getattr(settings, "adaptive_draft_length", not args.fixed_draft_length))
        limits = EngineLimits(max_queue_size=1 << 20, adaptive_draft_length=adaptive,
                              overlap_scheduling=mode != "none_serial",
                              max_chained_step_ms=settings.max_chained_step_ms)
        executor = InProcessExecutor(engine)
        async_engine = AsyncEngine(executor, tokenizer, limits)
        await async_engine.start()
        policy = async_engine.scheduler.draft_policy
        policy.refresh = bool(getattr(settings, "policy_refresh", 1))
        settle_garbage_collector()  # as the LLM API and the services do once loaded
        trace = _trace_policy(policy) if args.trace_policy else None
        out: dict = {}
        try:
            warm = [GenerationRequest(token_ids=texts[0], max_tokens=16, temperature=0.0)]
            await _run(async_engine, warm, f"{mode} warm-up")
            # Batch 1: one request at a time, to EOS or max_tokens.
            runs = []
            host_before = {**async_engine.host_seconds, **executor.runner.host_seconds}
            for i, text in enumerate(texts):
                request = GenerationRequest(token_ids=text, max_tokens=args.max_tokens, temperature=0.0)
                runs.append(await _run(async_engine, [request], f"{mode} batch 1 [{i + 1}/{len(texts)}]"))
            wall = sum(r["wall_s"] for r in runs)
            tokens = sum(r["output_tokens"] for r in runs)
            # Tokens a request gets per generation step (its first token comes from the prompt's step).
            steps = sum(r["steps"] - 1 for r in runs)
            drafted = [sum(col) for col in zip(*(r["drafts_by_position"] for r in runs))]
            accepted_at = [sum(col) for col in zip(*(r["accepted_by_position"] for r in runs))]
            proposed = sum(r["draft_tokens"] for r in runs)
            accepted = sum(r["accepted_draft_tokens"] for r in runs)
            host_after = {**async_engine.host_seconds, **executor.runner.host_seconds}
            total_steps = sum(r["steps"] for r in runs)
            out["batch1"] = {
                "wall_ms_per_step": wall * 1e3 / max(total_steps, 1),
                # Where the host's time goes per step: the scheduler's loop and the executor's runner.
                "host_ms_per_step": {k: (v - host_before[k]) * 1e3 / max(total_steps, 1) for k, v in host_after.items()},
                "output_tokens": tokens, "wall_s": wall, "output_tokens_per_s": tokens / wall,
                "mean_accepted_length": (tokens - len(runs)) / max(steps, 1),  # tokens per step (all its rounds)
                # Tokens per verification (round): the accepted drafts plus the target's own token.
                "mean_tokens_per_verification": 1 + accepted / drafted[0] if drafted and drafted[0] else None,
                "draft_tokens": proposed, "accepted_draft_tokens": accepted,
                "acceptance_rate": accepted / proposed if proposed else None, "acceptance_by_position": _rates(drafted, accepted_at),
                "outputs": [r["outputs"][0] for r in runs],
                "per_prompt": [{"output_tokens": r["output_tokens"], "wall_s": r["wall_s"], "ttft_s": r["ttft_s"]}
                               for r in runs],
                # Generation alone, which is what speculation speeds up: tokens after each request's first over
                # the time after it (a long grounded prompt's step weighs on output_tokens_per_s; not on this).
                "decode_tokens_per_s": _decode_rate(runs),
                # How smoothly answers stream: time between a stream's chunks (a chained step's tokens come at once).
                "chunk_gap_ms": _ms_summary([g for r in runs for g in r["chunk_gaps_s"]]),
            }
            choices: dict[int, int] = {}
            for r in runs:
                for k, n in r["draft_length_choices"].items():
                    choices[k] = choices.get(k, 0) + n
            out["batch1"]["draft_length_choices"] = choices
            out["batch1"]["draft_length_refreshes"] = sum(r["draft_length_refreshes"] for r in runs)
            if trace is not None:
                out["batch1"]["policy_trace"] = trace[:TRACE_LIMIT]
            out["batch1"]["step_cost_points"] = _cost_points(policy)
            per_round = out["batch1"]["mean_tokens_per_verification"]
            log(f"{mode}: batch 1 {tokens / wall:.1f} tok/s, {(tokens - len(runs)) / max(steps, 1):.2f} tokens a step"
                + (f" (its rounds {per_round:.2f} tokens each: the mean accepted length)" if per_round else ""))
            if args.arrival_probes:
                out["arrivals"] = await _arrival_probes(async_engine, texts, args.arrival_probes, args.max_tokens,
                                                        f"{mode} arrivals")
                arrivals = out["arrivals"]
                log(f"{mode}: a request arriving during another's answer: first token in "
                    f"{arrivals['median_ttft_ms']:.1f} ms (median), {arrivals['max_ttft_ms']:.1f} ms at most")
            for batch in [b for b in args.batch_sizes if b > 1]:
                def requests_of(max_tokens: int) -> list[GenerationRequest]:
                    return [
                        GenerationRequest(token_ids=texts[i % len(texts)], max_tokens=max_tokens, temperature=0.0,
                                          ignore_eos=True)
                        for i in range(batch)
                    ]

                # A short run of the same batch first: kernels that compile on a step of a new shape
                # (the batch's prompts as one context step) are not timed, in any mode.
                await _run(async_engine, requests_of(8), f"{mode} batch {batch} warm-up")
                host_before = {**async_engine.host_seconds, **executor.runner.host_seconds}
                cpu_before = {**async_engine.host_cpu_seconds, **executor.runner.host_cpu_seconds}
                traced_from = len(trace) if trace is not None else 0
                run = await _run(async_engine, requests_of(args.batch_max_tokens), f"{mode} batch {batch}")
                if trace is not None:
                    run["policy_trace"] = trace[traced_from : traced_from + TRACE_LIMIT]
                run.pop("outputs")
                run["chunk_gap_ms"] = _ms_summary(run.pop("chunk_gaps_s"))
                host_after = {**async_engine.host_seconds, **executor.runner.host_seconds}
                cpu_after = {**async_engine.host_cpu_seconds, **executor.runner.host_cpu_seconds}
                # Wall time per phase, and the thread's CPU time (wall minus waits for the interpreter lock).
                run["host_ms_per_step"] = {k: (v - host_before[k]) * 1e3 / max(run["steps"], 1)
                                           for k, v in host_after.items()}
                run["host_cpu_ms_per_step"] = {k: (v - cpu_before[k]) * 1e3 / max(run["steps"], 1)
                                               for k, v in cpu_after.items()}
                run["step_cost_points"] = _cost_points(policy)
                run["acceptance_by_position"] = _rates(run.pop("drafts_by_position"), run.pop("accepted_by_position"))
                out[f"batch{batch}"] = run
                log(f"{mode}: batch {batch} {run['output_tokens_per_s']:.0f} tok/s")
        finally:
            await async_engine.stop()
            RecurrentDraftHead.fused = True
            release_garbage_collector()  # pairs with the settle above, as the LLM API's shutdown does
        return out

    # Output tokens/s per cycle, mode and batch: every cycle measures every mode again, in turn, so
    # drift of the machine within a run reaches all modes alike (the first cycle's details are kept).
    # Odd cycles take the modes in reverse order (A B, B A, ...): over an even number of cycles every mode
    # runs as often first as last, so a steady drift (warming, a growing heap) favours none of them.
    by_cycle: dict[str, list[dict[str, float]]] = {mode: [] for mode in args.modes}
    prompts_by_cycle: dict[str, list[list[dict]]] = {mode: [] for mode in args.modes}  # batch 1's per_prompt

    async def main() -> None:
        for cycle in range(args.cycles):
            for mode in (args.modes if cycle % 2 == 0 else args.modes[::-1]):
                result = await measure(mode)
                rates = {key: res["output_tokens_per_s"] for key, res in result.items() if key.startswith("batch")}
                by_cycle[mode].append({**rates, "batch1_decode": result["batch1"]["decode_tokens_per_s"]})
                prompts_by_cycle[mode].append(result["batch1"]["per_prompt"])
                if cycle == 0:
                    report["modes"][mode] = result

    report["mode_order"] = "each cycle in turn, odd cycles (counting from 0) in reverse"

    asyncio.run(main())
    plain = report["modes"].get("none")
    if plain is not None:
        for mode, res in report["modes"].items():
            res["batch1"]["speedup"] = res["batch1"]["output_tokens_per_s"] / plain["batch1"]["output_tokens_per_s"]
            res["batch1"]["decode_speedup"] = res["batch1"]["decode_tokens_per_s"] / plain["batch1"]["decode_tokens_per_s"]
            res["batch1"]["same_tokens_as_none"] = res["batch1"]["outputs"] == plain["batch1"]["outputs"]
            res["batch1"]["identical_prompts"] = _identical_prompts(res["batch1"], plain["batch1"])
            res["batch1"]["by_prompt"] = _by_prompt(prompts_by_cycle[mode], prompts_by_cycle["none"])
            for key in [k for k in res if k.startswith("batch") and k != "batch1"]:
                res[key]["speedup"] = res[key]["output_tokens_per_s"] / plain[key]["output_tokens_per_s"]
            if args.cycles > 1:
                for key in [k for k in res if k.startswith("batch")]:
                    ratios = [c[key] / p[key] for c, p in zip(by_cycle[mode], by_cycle["none"])]
                    res[key]["cycles"] = {
                        "output_tokens_per_s": [c[key] for c in by_cycle[mode]], "speedup": ratios,
                        "median_speedup": statistics.median(ratios),
                    }
                    log(f"{mode}: {key} speedup by cycle {', '.join(f'{r:.3f}' for r in ratios)} "
                        f"(median {statistics.median(ratios):.3f})")
                decode = [c["batch1_decode"] / p["batch1_decode"] for c, p in zip(by_cycle[mode], by_cycle["none"])]
                res["batch1"]["cycles"].update({
                    "decode_tokens_per_s": [c["batch1_decode"] for c in by_cycle[mode]], "decode_speedup": decode,
                    "median_decode_speedup": statistics.median(decode),
                })
                log(f"{mode}: batch1 decode speedup by cycle {', '.join(f'{r:.3f}' for r in decode)} "
                    f"(median {statistics.median(decode):.3f})")
    for mode, res in report["modes"].items():
        res["batch1"].pop("outputs")
        by_prompt = res["batch1"].get("by_prompt", {})
        if by_prompt.get("median_speedup") is not None and mode != "none":
            log(f"{mode}: batch1 median over prompts of each prompt's speedup: {by_prompt['median_speedup']:.3f}x")
        same = res["batch1"].get("identical_prompts", {})
        if "speedup" in same and mode != "none":
            log(f"{mode}: batch1 over the {same['count']} of {same['of']} prompts whose output matched plain "
                f"decoding: {same['speedup']:.3f}x")
    return report


def _identical_prompts(res: dict, plain: dict) -> dict:
    """Batch 1 over only the prompts whose output equals plain decoding's (first cycle).

    In bfloat16 on a GPU, verification GEMMs of several rows round differently from a plain step's, so
    greedy outputs can drift apart, and tokens/s over different texts compares different work. Over the
    prompts that stayed identical the two modes produced the same tokens, so their speedup is exact.
    """
    same = [i for i, (a, b) in enumerate(zip(res["outputs"], plain["outputs"])) if a == b]
    common = [
        next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        for a, b in zip(res["outputs"], plain["outputs"])
    ]
    out: dict = {"count": len(same), "of": len(res["outputs"]), "common_prefix_tokens": common}
    if same:
        def rate(r: dict) -> float:
            picked = [r["per_prompt"][i] for i in same]
            return sum(p["output_tokens"] for p in picked) / max(sum(p["wall_s"] for p in picked), 1e-9)

        out["speedup"] = rate(res) / rate(plain)
    return out


def _by_prompt(cycles: list[list[dict]], plain_cycles: list[list[dict]]) -> dict:
    """Batch 1 prompt by prompt: each prompt's tokens/s against plain decoding's on it in the same cycle, the
    median over cycles per prompt, and the median of those over prompts.

    The aggregate speedup weighs prompts by their tokens, so an answer that parts ways with plain decoding's
    and loops (hundreds of tokens that draft almost for free) can carry it; the median over prompts cannot.
    """
    def rate(p: dict) -> float:
        return p["output_tokens"] / max(p["wall_s"], 1e-9)

    per_cycle = [[rate(a) / rate(b) for a, b in zip(mine, plain)] for mine, plain in zip(cycles, plain_cycles)]
    ratios = [statistics.median(values) for values in zip(*per_cycle)]
    return {"speedup": [round(r, 3) for r in ratios], "median_speedup": statistics.median(ratios) if ratios else None,
            "cycles": len(per_cycle)}


# --------------------------------------------------------------------------- verify-cost


def _engine_for(source: str, args, max_batch: int):
    """An engine of a known shape (random weights), or of a checkpoint (its weights)."""
    from executor_svc.build_config import BuildConfig
    from executor_svc.engine_cache import build_cached
    from inflight.model_store import default_cache_dir, resolve_model

    if source in SHAPES:
        folder, load_format = shape_folder(source, default_cache_dir(), args.tokenizer_from), "dummy"
    else:
        folder, load_format = resolve_model(source), "auto"
    build = BuildConfig(max_batch_size=max_batch, max_num_tokens=args.max_num_tokens, max_seq_len=args.max_seq_len,
                        tokens_per_block=args.tokens_per_block, dtype=args.dtype)
    return build_cached(folder, build, default_cache_dir(), args.device, load_format)


def run_verify_cost(args) -> dict:
    import torch

    from executor_svc.engine import RuntimeConfig, load_engine
    from executor_svc.runner import ModelRunner
    from executor_svc.speculative.proposer import DraftRequest, SpeculativeConfig, SpeculativeMode
    from protos.plan import CachedRequest, NewRequest, SamplingConfig, StepPlan
    from scheduler_svc.speculation import expected_accepted

    max_batch = max(args.batch_sizes) * (1 + max(args.ks))
    target_dir = _engine_for(args.shape, args, max_batch)
    if args.draft_shape == "none":  # verification cost only (prompt lookup drafts cost next to nothing)
        spec = SpeculativeConfig(SpeculativeMode.NGRAM, max(args.ks))
    else:
        spec = SpeculativeConfig(SpeculativeMode.DRAFT_MODEL, max(args.ks), draft_engine_dir=_engine_for(args.draft_shape, args, max_batch))
    engine = load_engine(target_dir, RuntimeConfig(device=args.device, kv_cache_fraction=args.kv_cache_fraction, speculative=spec))
    runner = ModelRunner(engine)
    tpb = engine.tokens_per_block
    gen = torch.Generator().manual_seed(0)
    def sync() -> None:
        if engine.device.type == "cuda":
            torch.cuda.synchronize()

    report: dict = {"target": Path(args.shape).name, "draft": Path(args.draft_shape).name, "context_len": args.context_len, "batches": {}}
    step_id = 0

    def timed(plan_for, reps: int) -> float:
        nonlocal step_id
        for _ in range(3):  # warm-up (graph buckets, allocator)
            step_id += 1
            runner.execute(plan_for(step_id))
        sync()
        started = time.perf_counter()
        for _ in range(reps):
            step_id += 1
            result = runner.execute(plan_for(step_id))
            assert not result.request_errors, result.request_errors
        sync()
        return (time.perf_counter() - started) / reps

    for batch in args.batch_sizes:
        ids = [f"b{batch}-{i}" for i in range(batch)]
        blocks_per = -(-(args.context_len + 1024) // tpb)
        tables = [list(range(i * blocks_per, (i + 1) * blocks_per)) for i in range(batch)]
        prompts = torch.randint(1000, 30000, (batch, args.context_len), generator=gen).tolist()
        step_id += 1
        runner.execute(StepPlan(step_id, new_requests=[
            NewRequest(rid, prompts[i], args.context_len, 0, args.context_len, tables[i], SamplingConfig(temperature=0.0))
            for i, rid in enumerate(ids)
        ]))
        row: dict = {}
        for k in args.ks:
            def plan_for(sid: int, k=k) -> StepPlan:
                cached = []
                for rid in ids:
                    state = runner.requests[rid]
                    drafts = torch.randint(1000, 30000, (k,), generator=gen).tolist()
                    cached.append(CachedRequest(rid, state.num_computed_tokens, 1 + k, [], draft_token_ids=drafts))
                return StepPlan(sid, cached_requests=cached)

            launch_before = runner.host_seconds["launch"]
            seconds = timed(plan_for, args.reps)
            launch_ms = (runner.host_seconds["launch"] - launch_before) * 1e3 / (args.reps + 3)
            draft_s = None
            if k > 0 and spec.mode is SpeculativeMode.DRAFT_MODEL:
                requests = [DraftRequest(rid, runner.requests[rid].token_ids, tables[i], k) for i, rid in enumerate(ids)]
                runner.proposer.propose(requests)  # warm-up
                sync()
                started = time.perf_counter()
                for _ in range(args.reps):
                    runner.proposer.propose(requests)
                sync()
                draft_s = (time.perf_counter() - started) / args.reps
            row[f"k{k}"] = {"verify_step_ms": seconds * 1e3, "host_launch_ms": launch_ms,
                            "draft_propose_ms": None if draft_s is None else draft_s * 1e3}
            log(f"batch {batch} k={k}: verify step {seconds * 1e3:.2f} ms (host launch {launch_ms:.2f})" + (f", drafting {draft_s * 1e3:.2f} ms" if draft_s else ""))
        plain = row["k0"]["verify_step_ms"]
        for k in args.ks:
            entry = row[f"k{k}"]
            entry["verify_over_plain"] = entry["verify_step_ms"] / plain
            cost = entry["verify_step_ms"] + (entry["draft_propose_ms"] or 0.0)
            entry["speedup_at_acceptance"] = {
                str(rate): (1 + expected_accepted(rate, k)) * plain / cost for rate in (0.5, 0.7, 0.9)
            }
        step_id += 1
        runner.execute(StepPlan(step_id, finished_request_ids=ids))
        report["batches"][str(batch)] = row
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="part", required=True)
    gen = sub.add_parser("generate", help="speedup at batch 1 and throughput under load on a real model")
    add_model_source_args(gen)
    gen.add_argument("--engine-dir", default=None, help="use this engine folder instead of building one")
    gen.add_argument("--modes", default="none,ngram", type=lambda s: s.split(","))
    gen.add_argument("--cycles", type=int, default=1,
                     help="measure every mode this many times, in turn, and report each speedup's spread and median")
    gen.add_argument("--prompts", default="grounded", choices=["grounded", "chat"])
    gen.add_argument("--num-prompts", type=int, default=0, help="use the first N prompts of the set (0 = all)")
    gen.add_argument("--max-tokens", type=int, default=256, help="batch 1: most output tokens (EOS ends earlier)")
    gen.add_argument("--batch-sizes", default="1,64,256", type=lambda s: [int(x) for x in s.split(",")])
    gen.add_argument("--max-batch-size", type=int, default=0,
                     help="the engine's batch size (0: the largest of --batch-sizes, at least 1 + the draft tokens)")
    gen.add_argument("--batch-max-tokens", type=int, default=128, help="batch N: output tokens per request (EOS ignored)")
    gen.add_argument("--switch-interval-ms", type=float, default=0.0,
                     help="Python's GIL switch interval for this run (0 = leave the default, 5 ms)")
    gen.add_argument("--train-heads", action="store_true", help="run `inflight train-draft` on the engine first")
    gen.add_argument("--train-draft-args", default="", help="extra arguments for `inflight train-draft`, one string")
    gen.add_argument("--more-train-draft-args", action="append", default=[], metavar="ARGS",
                     help="with --train-heads: train another set of heads with these arguments, in a folder of its "
                          "own; a mode with the setting headsN serves the N-th such set (repeatable)")
    gen.add_argument("--more-heads", action="append", default=[], metavar="DIR",
                     help="serve the heads in this folder (train-draft --output DIR) as another set, numbered after "
                          "--more-train-draft-args' sets (repeatable)")
    gen.add_argument("--fixed-draft-length", action="store_true", help="always the most drafts (no load-aware policy)")
    gen.add_argument("--arrival-probes", type=int, default=0, metavar="N",
                     help="after batch 1, N times: a request arrives while another answers; its time to first token")
    gen.add_argument("--trace-policy", action="store_true",
                     help="record every draft length the policy chose and every step cost it learned from, at batch "
                          "1 and in each larger batch's run (choices among many requests as a summary)")
    cost = sub.add_parser("verify-cost", help="verify-k step time against a plain step (random weights)")
    cost.add_argument("--shape", default="llama-3.1-8b", help="target: a known shape (random weights) or a checkpoint")
    cost.add_argument("--draft-shape", default="llama-3.2-1b", help="draft: a known shape or checkpoint; none = verify only")
    cost.add_argument("--tokenizer-from", default="smollm2-135m-instruct")
    cost.add_argument("--ks", default="0,1,2,4", type=lambda s: [int(x) for x in s.split(",")])
    cost.add_argument("--batch-sizes", default="1,8", type=lambda s: [int(x) for x in s.split(",")])
    cost.add_argument("--context-len", type=int, default=512)
    cost.add_argument("--reps", type=int, default=30)
    for p in (gen, cost):
        p.add_argument("--device", default="cuda")
        p.add_argument("--dtype", default="auto")
        p.add_argument("--num-draft-tokens", type=int, default=None, help="default: the mode's (15 for ngram, 4 otherwise)")
        p.add_argument("--ngram-min", type=int, default=1)
        p.add_argument("--ngram-max", type=int, default=4)
        p.add_argument("--speculative-rounds", type=int, default=32,
                       help="ngram and draft heads: most verification rounds chained per step")
        p.add_argument("--max-chained-step-ms", type=float, default=50.0,
                       help="a step chains no more rounds than its measured costs fit in this (0 = no limit)")
        p.add_argument("--draft-tree", default="default", help="mode draft_heads_tree: the tree's shape (see inflight serve)")
        p.add_argument("--max-num-tokens", type=int, default=8192)
        p.add_argument("--max-seq-len", type=int, default=4096)
        p.add_argument("--tokens-per-block", type=int, default=16)
        p.add_argument("--kv-cache-fraction", type=float, default=0.85)
        p.add_argument("--output", required=True)
        p.add_argument("--trace", action="store_true", help="log the scheduler's draft-length choices")
    args = parser.parse_args(argv)
    if args.trace:
        import logging

        logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
        logging.getLogger("inflight.scheduler").setLevel(logging.DEBUG)
    if args.part == "generate":
        default_load_format(args)
        if args.switch_interval_ms:
            sys.setswitchinterval(args.switch_interval_ms / 1e3)
        payload = run_generate(args)
    else:
        payload = run_verify_cost(args)
    write_report("bench/speculative.py", argv if argv is not None else sys.argv[1:], args.device, Path(args.output), payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
