"""Prefix reuse, the host tier and capacity policies, measured through the real scheduler and executor.

In-process: the scheduler's step loop (AsyncEngine) drives the executor's
ModelRunner in one process, the path the offline LLM API uses, so the numbers
are scheduling and KV reuse without gRPC transport. The engine is loaded once;
every configuration gets a fresh scheduler (and so an empty prefix cache) over
it. Requests are token ids, greedy, EOS ignored.

Workloads:
  ttft            TTFT of a request whose --prefix-len prefix is cached vs not (and, with
                  --host-cache-gb, cached in the host tier only), median over --ttft-trials;
                  the cached case also with its chunk computed as one tile set rather than as
                  graph-replayed rows, and each case's host and GPU time by phase.
  shared          --shared-requests requests with one --shared-prefix-len "system prompt" and
                  distinct suffixes, all at once after one request warmed the prefix (steady
                  state); prefix reuse on vs off: hit rate, throughput, TTFT.
  oversubscribed  --oversub-requests requests at once with the scheduler's KV pool cut to
                  --oversub-kv-fraction of what they need together: MAX_UTILIZATION vs
                  GUARANTEED_NO_EVICT throughput, time per output token, preemptions.

Example (H200, Llama-3.1-8B shape, random weights):
  python bench/prefix_cache.py --shape llama-3.1-8b --device cuda --load-format dummy \\
      --host-cache-gb 16 --output bench/results/h200_prefix_cache_llama8b.json
CPU smoke run:
  python bench/prefix_cache.py --device cpu --prefix-len 64 --suffix-len 8 --ttft-trials 2 \\
      --shared-prefix-len 64 --shared-suffix-len 8 --shared-requests 4 --shared-output-len 4 \\
      --oversub-requests 4 --oversub-input-len 32 --oversub-output-len 16 --tokens-per-block 16 \\
      --kv-cache-gb 0.2 --host-cache-gb 0.05 --output prefix_cache_smoke.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import random
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import device_info, git_info, log, resolve_device_and_dtype, summarize_ms  # noqa: E402
from model_shapes import add_model_source_args, default_load_format, resolve_model_source  # noqa: E402

# --------------------------------------------------------------------------- requests


def random_tokens(rng: random.Random, length: int, vocab: int) -> list[int]:
    """Token ids away from the special tokens at both ends of the vocabulary: no two prompts share a prefix."""
    return [rng.randrange(1000, min(vocab, 32000)) for _ in range(length)]


@dataclass
class Trace:
    sent: float = 0.0
    token_times: list[float] = field(default_factory=list)
    num_tokens: int = 0
    cached_tokens: int = 0
    prompt_tokens: int = 0
    num_preemptions: int = 0


async def one_request(engine, prompt: list[int], output_len: int) -> Trace:
    from scheduler_svc.api_types import GenerationRequest

    trace = Trace(sent=time.perf_counter())
    request = GenerationRequest(token_ids=prompt, max_tokens=output_len, temperature=0.0, ignore_eos=True)
    async for chunk in engine.generate(request):
        if chunk.token_ids:
            trace.token_times.append(time.perf_counter())
            trace.num_tokens += len(chunk.token_ids)
        if chunk.finish_reason is not None:
            if chunk.error or trace.num_tokens != output_len:
                raise RuntimeError(f"request ended with {chunk.finish_reason} after {trace.num_tokens} tokens: {chunk.error}")
            trace.cached_tokens, trace.prompt_tokens = chunk.usage.cached_tokens, chunk.usage.prompt_tokens
            trace.num_preemptions = chunk.usage.num_preemptions
    return trace


async def run_batch(engine, prompts: list[list[int]], output_len: int) -> dict:
    """Every prompt at once; throughput over the wall time from the first submit to the last token."""
    start = time.perf_counter()
    traces = await asyncio.gather(*(one_request(engine, p, output_len) for p in prompts))
    wall = time.perf_counter() - start
    tpot = [(t.token_times[-1] - t.token_times[0]) / (t.num_tokens - 1) for t in traces if t.num_tokens > 1]
    prompt_tokens = sum(t.prompt_tokens for t in traces)
    out = sum(t.num_tokens for t in traces)
    stats = engine.stats()
    return {
        "num_requests": len(prompts), "wall_s": wall,
        "output_tokens_per_s": out / wall, "total_tokens_per_s": (prompt_tokens + out) / wall,
        "ttft_ms": summarize_ms([t.token_times[0] - t.sent for t in traces]), "tpot_ms": summarize_ms(tpot),
        "prompt_tokens": prompt_tokens, "cached_prompt_tokens": sum(t.cached_tokens for t in traces),
        "hit_rate": sum(t.cached_tokens for t in traces) / prompt_tokens,
        "num_preemptions": stats.num_preemptions, "requests_preempted": sum(t.num_preemptions > 0 for t in traces),
        "num_steps": engine.num_steps,
    }


# --------------------------------------------------------------------------- engines


def load(args) -> tuple:
    """Build (once, cached) and load the engine; returns (engine, tokenizer, model config)."""
    from executor_svc.build_config import BuildConfig
    from executor_svc.engine_cache import build_cached
    from executor_svc.engine import RuntimeConfig, load_engine
    from inflight.model_store import default_cache_dir
    from scheduler_svc.tokenizer import Tokenizer

    checkpoint, config = resolve_model_source(args)
    build = BuildConfig(
        max_batch_size=args.max_batch_size, max_num_tokens=args.max_num_tokens, tokens_per_block=args.tokens_per_block,
        max_seq_len=args.max_seq_len, dtype=args.dtype, plugin_config=dict(item.split("=", 1) for item in args.plugin),
    )
    engine_dir = build_cached(checkpoint, build, default_cache_dir(), args.device, args.load_format)
    runtime = RuntimeConfig(
        device=args.device, kv_cache_bytes=int(args.kv_cache_gb * 2**30), host_cache_bytes=int(args.host_cache_gb * 2**30)
    )
    return load_engine(engine_dir, runtime), Tokenizer(engine_dir), config


class Scheduled:
    """A fresh scheduler (own prefix cache, own limits) over the loaded engine, for one configuration."""

    def __init__(self, engine, tokenizer, **limits) -> None:
        from inflight.inprocess import InProcessExecutor
        from scheduler_svc.engine_loop import AsyncEngine, EngineLimits

        self.executor = InProcessExecutor(engine)
        self.async_engine = AsyncEngine(self.executor, tokenizer, EngineLimits(max_queue_size=1 << 20, **limits))

    async def __aenter__(self):
        from inflight.gc_tuning import settle_garbage_collector

        await self.async_engine.start()
        settle_garbage_collector()  # as the LLM API and the services do once loaded
        await one_request(self.async_engine, [1000 + i for i in range(8)], 2)  # first-call costs out of the way
        return self.async_engine

    def host_seconds(self) -> dict[str, float]:
        """Cumulative host seconds by phase: the scheduler loop's and the executor runner's."""
        return {**self.async_engine.host_seconds, **self.executor.runner.host_seconds}

    async def timed_request(self, prompt: list[int]) -> tuple[Trace, dict]:
        """One single-token request alone, with where its time went: host ms by phase and GPU ms of its steps."""
        runner = self.executor.runner
        before, steps_before = self.host_seconds(), self.async_engine.num_steps
        timings_before = len(runner.timeline.steps) if runner.timeline is not None else 0
        trace = await one_request(self.async_engine, prompt, 1)
        after = self.host_seconds()
        split = {f"host_{key}_ms": (after[key] - before[key]) * 1e3 for key in after}
        split["steps"] = self.async_engine.num_steps - steps_before
        if runner.timeline is not None:
            split["gpu_busy_ms"] = sum(t.busy_us for t in list(runner.timeline.steps)[timings_before:]) / 1e3
        return trace, split

    async def __aexit__(self, *exc: object) -> None:
        from inflight.gc_tuning import release_garbage_collector

        await self.async_engine.stop()
        release_garbage_collector()  # pairs with __aenter__'s settle, as the LLM API's shutdown does


# --------------------------------------------------------------------------- workloads


async def ttft_workload(args, engine, tokenizer, vocab: int) -> dict:
    rng = random.Random(1)
    trials = [(random_tokens(rng, args.prefix_len, vocab), [random_tokens(rng, args.suffix_len, vocab) for _ in range(3)])
              for _ in range(args.ttft_trials)]
    uncached, cached, cached_tiles, cached_tokens = [], [], [], []
    splits: dict[str, list[dict]] = {"uncached": [], "cached": [], "cached_tiles": []}
    scheduled = Scheduled(engine, tokenizer)
    async with scheduled:
        runner = scheduled.executor.runner
        rows = runner.max_rows_per_chunk
        for prefix, suffixes in trials:
            cold, split = await scheduled.timed_request(prefix + suffixes[0])
            splits["uncached"].append(split)
            warm, split = await scheduled.timed_request(prefix + suffixes[1])
            splits["cached"].append(split)
            runner.max_rows_per_chunk = 0  # the same hit with the chunk computed as one tile set
            tiles, split = await scheduled.timed_request(prefix + suffixes[2])
            runner.max_rows_per_chunk = rows
            splits["cached_tiles"].append(split)
            uncached.append(cold.token_times[0] - cold.sent)
            cached.append(warm.token_times[0] - warm.sent)
            cached_tiles.append(tiles.token_times[0] - tiles.sent)
            cached_tokens.append(warm.cached_tokens)
    result = {
        "prefix_len": args.prefix_len, "suffix_len": args.suffix_len, "trials": args.ttft_trials,
        "ttft_uncached_ms": summarize_ms(uncached), "ttft_cached_ms": summarize_ms(cached),
        "ttft_cached_chunk_as_tiles_ms": summarize_ms(cached_tiles),
        "cached_tokens_per_request": cached_tokens,
        "ratio_uncached_over_cached_p50": summarize_ms(uncached)["p50"] / summarize_ms(cached)["p50"],
        # Median over trials of each phase: what a request's TTFT is made of.
        "breakdown_p50": {name: {key: statistics.median(s[key] for s in rows_) for key in rows_[0]}
                          for name, rows_ in splits.items()},
    }
    if engine.kv_offload is not None and engine.kv_offload.num_host_blocks:
        result.update(await ttft_from_host(args, engine, tokenizer, vocab, trials))
    return result


async def ttft_from_host(args, engine, tokenizer, vocab: int, trials) -> dict:
    """The prefix evicted to the host tier (a device pool of one request's worth, flushed), then hit."""
    block = engine.tokens_per_block
    per_request = -(-(args.prefix_len + args.suffix_len + 1) // block)
    pool = per_request + 2
    rng = random.Random(2)
    from_host, swapped_in = [], 0
    async with Scheduled(engine, tokenizer, num_kv_blocks=pool) as sched:
        for prefix, suffixes in trials:
            await one_request(sched, prefix + suffixes[0], 1)
            for _ in range(-(-pool // (per_request - 1)) + 1):  # push every prefix block off the device, to the host
                await one_request(sched, random_tokens(rng, args.prefix_len + args.suffix_len, vocab), 1)
            before = sched.stats().kv.num_swapped_in_blocks
            hit = await one_request(sched, prefix + suffixes[2], 1)
            swapped_in += sched.stats().kv.num_swapped_in_blocks - before
            from_host.append(hit.token_times[0] - hit.sent)
    return {"ttft_from_host_ms": summarize_ms(from_host), "host_device_pool_blocks": pool,
            "swapped_in_blocks_per_request": swapped_in / len(trials)}


async def shared_workload(args, engine, tokenizer, vocab: int) -> dict:
    rng = random.Random(3)
    system = random_tokens(rng, args.shared_prefix_len, vocab)
    prompts = [system + random_tokens(rng, args.shared_suffix_len, vocab) for _ in range(args.shared_requests)]
    out = {"prefix_len": args.shared_prefix_len, "suffix_len": args.shared_suffix_len,
           "num_requests": args.shared_requests, "output_len": args.shared_output_len}
    for enable in (True, False):
        async with Scheduled(engine, tokenizer, enable_prefix_caching=enable) as sched:
            await one_request(sched, system + random_tokens(rng, args.shared_suffix_len, vocab), 1)  # steady state
            out["reuse_on" if enable else "reuse_off"] = metrics = await run_batch(sched, prompts, args.shared_output_len)
        log(f"shared prefix, reuse {'on' if enable else 'off'}: hit rate {metrics['hit_rate']:.2f}, "
            f"{metrics['total_tokens_per_s']:.0f} tok/s, TTFT p50 {metrics['ttft_ms']['p50']:.0f} ms")
    out["throughput_ratio_on_over_off"] = out["reuse_on"]["total_tokens_per_s"] / out["reuse_off"]["total_tokens_per_s"]
    return out


async def oversubscribed_workload(args, engine, tokenizer, vocab: int) -> dict:
    from scheduler_svc.scheduler import CapacityPolicy

    rng = random.Random(4)
    prompts = [random_tokens(rng, args.oversub_input_len, vocab) for _ in range(args.oversub_requests)]
    block = engine.tokens_per_block
    per_request = -(-(args.oversub_input_len + args.oversub_output_len) // block)
    pool = max(per_request + 1, int(args.oversub_kv_fraction * per_request * len(prompts)))
    out = {"num_requests": len(prompts), "input_len": args.oversub_input_len, "output_len": args.oversub_output_len,
           "blocks_needed_at_once": per_request * len(prompts), "kv_pool_blocks": pool}
    for policy in (CapacityPolicy.MAX_UTILIZATION, CapacityPolicy.GUARANTEED_NO_EVICT):
        async with Scheduled(engine, tokenizer, num_kv_blocks=pool, capacity_policy=policy) as sched:
            out[policy.value] = metrics = await run_batch(sched, prompts, args.oversub_output_len)
        log(f"oversubscribed, {policy.value}: {metrics['output_tokens_per_s']:.0f} out tok/s, "
            f"TPOT p99 {metrics['tpot_ms']['p99']:.1f} ms, {metrics['num_preemptions']} preemptions")
    mu, gne = out["MAX_UTILIZATION"], out["GUARANTEED_NO_EVICT"]
    out["throughput_ratio_max_utilization_over_guaranteed"] = mu["output_tokens_per_s"] / gne["output_tokens_per_s"]
    return out


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_source_args(p)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--workloads", default="ttft,shared,oversubscribed")
    g = p.add_argument_group("engine")
    g.add_argument("--max-batch-size", type=int, default=256)
    g.add_argument("--max-num-tokens", type=int, default=8192)
    g.add_argument("--max-seq-len", type=int, default=0, help="0 = the longest request of the workloads")
    g.add_argument("--tokens-per-block", type=int, default=32)
    g.add_argument("--kv-cache-gb", type=float, default=0.0, help="0 = the engine's default")
    g.add_argument("--host-cache-gb", type=float, default=0.0, help="host tier of the prefix cache; 0 = none")
    g.add_argument("--plugin", action="append", default=[], metavar="KIND=NAME")
    g = p.add_argument_group("ttft")
    g.add_argument("--prefix-len", type=int, default=2048)
    g.add_argument("--suffix-len", type=int, default=32)
    g.add_argument("--ttft-trials", type=int, default=5)
    g = p.add_argument_group("shared")
    g.add_argument("--shared-prefix-len", type=int, default=1024)
    g.add_argument("--shared-suffix-len", type=int, default=64)
    g.add_argument("--shared-requests", type=int, default=64)
    g.add_argument("--shared-output-len", type=int, default=64)
    g = p.add_argument_group("oversubscribed")
    g.add_argument("--oversub-requests", type=int, default=64)
    g.add_argument("--oversub-input-len", type=int, default=512)
    g.add_argument("--oversub-output-len", type=int, default=256)
    g.add_argument("--oversub-kv-fraction", type=float, default=0.5, help="KV pool as a fraction of what the load needs at once")
    p.add_argument("--output", default="bench/results/prefix_cache.json", help="JSON result path")
    args = p.parse_args(argv)
    default_load_format(args)
    args.workloads = [w for w in args.workloads.split(",") if w]
    unknown = set(args.workloads) - {"ttft", "shared", "oversubscribed"}
    if unknown:
        p.error(f"unknown workloads {sorted(unknown)}")
    if args.max_seq_len == 0:
        args.max_seq_len = max(args.prefix_len + args.suffix_len, args.shared_prefix_len + args.shared_suffix_len
                               + args.shared_output_len, args.oversub_input_len + args.oversub_output_len) + 8
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.device, args.dtype = resolve_device_and_dtype(args.device, args.dtype)
    result: dict = {
        "benchmark": "prefix cache, host tier and capacity policies (in-process scheduler + executor)",
        "command": shlex.join(["bench/prefix_cache.py", *(argv if argv is not None else sys.argv[1:])]),
        "git": git_info(), "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": device_info(args.device), "model": args.shape or args.model, "load_format": args.load_format,
        "dtype": args.dtype,
    }
    engine, tokenizer, config = load(args)
    result["engine"] = {
        "num_kv_blocks": engine.num_kv_blocks, "tokens_per_block": engine.tokens_per_block,
        "num_host_blocks": engine.kv_offload.num_host_blocks if engine.kv_offload is not None else 0,
        "max_batch_size": engine.max_batch_size, "max_num_tokens": engine.max_num_tokens, "max_seq_len": engine.max_seq_len,
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    workloads = {"ttft": ttft_workload, "shared": shared_workload, "oversubscribed": oversubscribed_workload}
    for name in args.workloads:
        log(f"workload {name}")
        result[name] = asyncio.run(workloads[name](args, engine, tokenizer, config["vocab_size"]))
        out.write_text(json.dumps(result, indent=2) + "\n")
    if "ttft" in result:
        log(f"TTFT with a cached {args.prefix_len}-token prefix: {result['ttft']['ratio_uncached_over_cached_p50']:.1f}x faster")
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
