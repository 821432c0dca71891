"""Serving under load: Poisson arrivals at several request rates through the gRPC API.

For each rate, requests arrive with exponential gaps (seeded) and stream their tokens
back; the report gives TTFT, time per output token and inter-token latency (p50, p99)
and the throughput achieved, and plots latency against throughput.

Example (H200, Llama-3.1-8B shape, random weights):
  python bench/serving_rates.py --shape llama-3.1-8b --device cuda --rates 2,8,16,32,64 \\
      --output bench/results/h200_serving_rates_llama8b.json --plot
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import device_info, git_info, log  # noqa: E402
from inflight_load import InflightServer, RequestTrace, one_request, trace_metrics  # noqa: E402
from offline_throughput import add_engine_build_args, build_engine_dir, synthetic_prompts  # noqa: E402
from model_shapes import add_model_source_args, default_load_format  # noqa: E402


async def run_rate(client, rate: float, prompts: list[list[int]], output_len: int, seed: int) -> dict:
    """Send ``prompts`` at Poisson arrivals of ``rate`` requests/s; wait for all to finish."""
    rng = random.Random(seed)
    traces = [RequestTrace() for _ in prompts]
    tasks = []
    with tqdm(total=len(prompts) * output_len, desc=f"rate {rate:g}/s", unit="tok", file=sys.stderr, mininterval=2) as bar:
        start = time.perf_counter()
        next_at = start
        for prompt, trace in zip(prompts, traces):
            delay = next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one_request(client, prompt, output_len, trace, bar)))
            next_at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    metrics = trace_metrics(traces, prompts, output_len, wall)
    metrics["request_rate"] = rate
    metrics["offered_rate_achieved"] = len(prompts) / (traces[-1].sent - traces[0].sent) if len(prompts) > 1 else None
    return metrics


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = result["rates"]
    x = [r["output_tokens_per_s"] for r in rates]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for key, ax, title in (("ttft_ms", axes[0], "time to first token"), ("tpot_ms", axes[1], "time per output token")):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(x, [r[key][q] for r in rates], style, label=q)
        for r in rates:
            ax.annotate(f"{r['request_rate']:g}/s", (r["output_tokens_per_s"], r[key]["p50"]), fontsize=7,
                        textcoords="offset points", xytext=(4, 4))
        ax.set_xlabel("achieved output tokens/s")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"inflight serving: {result['model']}, {result['input_len']}/{result['output_len']} tokens, Poisson arrivals")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_source_args(p)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--rates", default="2,8,32", help="requests per second, comma-separated")
    p.add_argument("--num-requests", type=int, default=200, help="requests per rate")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    add_engine_build_args(p)
    p.add_argument("--kv-cache-gb", type=float, default=0.0)
    p.add_argument("--server-arg", action="append", default=[])
    p.add_argument("--server-log", default="")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--output", required=True)
    p.add_argument("--plot", action="store_true")
    args = p.parse_args(argv)
    default_load_format(args)
    # What the shared engine/server helpers expect.
    args.scenarios, args.batch1, args.max_seq_len = f"{args.input_len}x{args.output_len}", [1, 1], 0
    args.port = args.executor_port = 0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    engine_dir, config = build_engine_dir(args)
    args.model, args.max_seq_len = str(engine_dir), args.input_len + args.output_len
    result: dict = {
        "benchmark": "inflight serving, Poisson arrivals (gRPC)",
        "command": shlex.join(["bench/serving_rates.py", *(argv if argv is not None else sys.argv[1:])]),
        "git": git_info(), "device": device_info(args.device), "model": args.shape or args.model,
        "input_len": args.input_len, "output_len": args.output_len, "rates": [],
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)

    async def run() -> None:
        from inflight.client import AsyncClient

        with InflightServer(args, args.device, args.dtype) as server:
            async with AsyncClient(server.address) as client:
                result["server"] = await server.wait_ready(client)
                warm = synthetic_prompts(8, args.input_len, 99, config["vocab_size"])
                await asyncio.gather(*(one_request(client, p, 4, RequestTrace(), None) for p in warm))
                for k, rate in enumerate(float(r) for r in args.rates.split(",")):
                    prompts = synthetic_prompts(args.num_requests, args.input_len, 1000 + k, config["vocab_size"])
                    metrics = await run_rate(client, rate, prompts, args.output_len, seed=k)
                    result["rates"].append(metrics)
                    out.write_text(json.dumps(result, indent=2) + "\n")
                    log(f"rate {rate:g}/s: {metrics['output_tokens_per_s']:.0f} out tok/s, TTFT p50 {metrics['ttft_ms']['p50']:.0f} ms "
                        f"p99 {metrics['ttft_ms']['p99']:.0f} ms, TPOT p50 {metrics['tpot_ms']['p50']:.1f} ms p99 {metrics['tpot_ms']['p99']:.1f} ms")

    asyncio.run(run())
    out.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {out}")
    if args.plot:
        plot(result, out.with_suffix(".png"))
        log(f"wrote {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
