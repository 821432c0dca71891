"""Offline throughput in the style of trtllm-bench, batch-1 decode against the bandwidth limit,
and GPU idle time between steps; Hugging Face ``generate`` as the peer in the same run.

Every scenario (fixed input/output lengths, all requests submitted at once, greedy,
EOS ignored) runs through the real scheduler and executor:
  * ``inprocess``: the scheduler's step loop and the executor's runner in one process,
    joined by the in-process executor connection (what the offline LLM API uses);
  * ``grpc``: ``inflight serve`` (scheduler + executor processes, gRPC between them and
    to the client), driven by the async Python client.
Clients take each completion whole (one answer per request, as trtllm-bench's default
and the offline ``LLM.generate`` do); ``--stream`` makes them stream every step's
tokens instead and adds TTFT and time per output token. Batch 1 always streams.

Example (H200, Llama-3.1-8B shape, random weights):
  python bench/offline_throughput.py --shape llama-3.1-8b --device cuda --output bench/results/h200_offline_llama8b.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_common import REPO, device_info, free_port, git_info, log, measure_copy_bandwidth, pct  # noqa: E402
from model_shapes import (  # noqa: E402
    add_model_source_args, default_load_format, engine_weight_bytes, kv_bytes_per_token, resolve_model_source,
)


def parse_scenarios(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in item.split("x")) for item in text.split(",") if item]  # type: ignore[misc]


def synthetic_prompts(count: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    """Deterministic token ids away from the special tokens at both ends of the vocabulary."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1000, min(vocab, 32000), (count, length), generator=gen).tolist()


# --------------------------------------------------------------------------- engine


def add_engine_build_args(p: argparse.ArgumentParser) -> None:
    """The flags ``build_engine_dir`` reads (besides the model source's, the device and the dtype), for every
    benchmark that builds its engine with it: one list, so that no parser can miss one."""
    p.add_argument("--max-batch-size", type=int, default=256)
    p.add_argument("--max-num-tokens", type=int, default=8192)
    p.add_argument("--tokens-per-block", type=int, default=32)
    p.add_argument("--plugin", action="append", default=[], metavar="KIND=NAME")
    p.add_argument("--quant-algo", default="none", help="weight quantization of the engine (FP8, W8A16, ...)")
    p.add_argument("--kv-cache-quant-algo", default="none", help="KV cache quantization (FP8, INT8)")
    p.add_argument("--group-size", type=int, default=128, help="input channels per INT4 scale (W4A16_AWQ)")
    p.add_argument("--exclude-modules", default=None,
                   help="Linear layers kept in 16 bits, comma-separated patterns (default: the build's, embed_tokens,lm_head)")


def build_engine_dir(args) -> tuple[Path, dict]:
    from executor_svc.build_config import BuildConfig, QuantConfig
    from executor_svc.engine_cache import build_cached
    from inflight.model_store import default_cache_dir

    checkpoint, config = resolve_model_source(args)
    longest = max(i + o for i, o in parse_scenarios(args.scenarios) + [tuple(args.batch1)])
    build = BuildConfig(
        max_batch_size=args.max_batch_size, max_num_tokens=args.max_num_tokens, tokens_per_block=args.tokens_per_block,
        max_seq_len=args.max_seq_len or longest, dtype=args.dtype,
        plugin_config=dict(item.split("=", 1) for item in args.plugin),
        quant_config=QuantConfig(args.quant_algo, args.kv_cache_quant_algo, group_size=args.group_size, **(
            {"exclude_modules": [m for m in args.exclude_modules.split(",") if m]} if args.exclude_modules is not None else {}
        )),
    )
    engine_dir = build_cached(checkpoint, build, default_cache_dir(), args.device, args.load_format)
    return engine_dir, config


# --------------------------------------------------------------------------- in-process


async def _run_requests(submit, prompts: list[list[int]], output_len: int, desc: str, stream: bool = True) -> dict:
    """Submit every prompt at once; wall time from the first submit to the last token.

    ``stream``: each request's tokens come one chunk per step (TTFT and time per output
    token are measured); otherwise each request answers once, when it finishes (as
    trtllm-bench does by default), and only its latency is measured.
    """
    first_token_at: list[float] = []
    token_times: list[list[float]] = []
    with tqdm(total=len(prompts) * output_len, desc=desc, unit="tok", file=sys.stderr, mininterval=2) as bar:
        async def one(prompt: list[int]) -> int:
            times: list[float] = []
            count = 0
            async for token_ids in submit(prompt, output_len, stream):
                now = time.perf_counter()
                times.extend([now] * len(token_ids))
                count += len(token_ids)
                bar.update(len(token_ids))
            first_token_at.append(times[0] - started)
            token_times.append(times)
            return count

        started = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - started
    total = sum(counts)
    assert total == len(prompts) * output_len, f"expected {len(prompts) * output_len} tokens, got {total}"
    measured = {
        "num_requests": len(prompts), "input_len": len(prompts[0]), "output_len": output_len, "streaming": stream,
        "wall_s": wall, "output_tokens_per_s": total / wall,
        "total_tokens_per_s": (total + sum(map(len, prompts))) / wall,
    }
    if not stream:
        latency = [(t[-1] - started) * 1e3 for t in token_times]
        return {**measured, "latency_ms": {"p50": pct(latency, 50), "p99": pct(latency, 99)}}
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in token_times if len(t) > 1]
    return {
        **measured,
        "ttft_ms": {"p50": pct([x * 1e3 for x in first_token_at], 50), "p99": pct([x * 1e3 for x in first_token_at], 99)},
        "tpot_ms": {"p50": pct([x * 1e3 for x in tpot], 50), "p99": pct([x * 1e3 for x in tpot], 99)},
    }


def _limits(args, **fields):
    """The scheduler limits every path runs with: an unbounded queue and the asked capacity policy."""
    from scheduler_svc.engine_loop import EngineLimits
    from scheduler_svc.scheduler_config import CapacityPolicy

    return EngineLimits(max_queue_size=1 << 20, capacity_policy=CapacityPolicy(args.capacity_policy.upper()), **fields)


def run_inprocess(args, engine_dir: Path, config: dict, result: dict) -> None:
    import torch

    from executor_svc.engine import RuntimeConfig, load_engine
    from inflight.gc_tuning import release_garbage_collector, settle_garbage_collector
    from inflight.inprocess import InProcessExecutor
    from scheduler_svc.api_types import GenerationRequest
    from scheduler_svc.engine_loop import AsyncEngine
    from scheduler_svc.tokenizer import Tokenizer

    t0 = time.perf_counter()
    engine = load_engine(engine_dir, RuntimeConfig(device=args.device, kv_cache_fraction=args.kv_cache_fraction,
                                                    cuda_graphs=not args.enforce_eager))
    result["engine"] = {
        "load_s": time.perf_counter() - t0, "num_kv_blocks": engine.num_kv_blocks, "tokens_per_block": engine.tokens_per_block,
        "kernels": {k: c.name for k, c in engine.manifest.plugins.items()},
        "kernel_timings_us": {k: c.timings_us for k, c in engine.manifest.plugins.items()},
        "kernel_tactics": {k: c.tactics for k, c in engine.manifest.plugins.items() if c.tactics},
        "kernel_tactic_timings_us": {k: c.tactic_timings_us for k, c in engine.manifest.plugins.items() if c.tactic_timings_us},
        "cuda_graphs": engine.decode_graphs is not None,
        "max_batch_size": engine.max_batch_size, "max_num_tokens": engine.max_num_tokens, "max_seq_len": engine.max_seq_len,
    }
    tokenizer = Tokenizer(engine_dir)

    async def start(overlap: bool) -> tuple[AsyncEngine, InProcessExecutor]:
        executor = InProcessExecutor(engine)
        async_engine = AsyncEngine(executor, tokenizer, _limits(args, overlap_scheduling=overlap))
        await async_engine.start()
        if not args.keep_gc_defaults:
            settle_garbage_collector()  # as the LLM API and the services do once loaded
        return async_engine, executor

    async def stop(async_engine: AsyncEngine) -> None:
        await async_engine.stop()
        if not args.keep_gc_defaults:
            # As the LLM API's shutdown does: frozen objects are never collected as cycles, so
            # whatever GPU memory a frozen cycle reaches would outlive this engine.
            release_garbage_collector()

    def submitter(async_engine: AsyncEngine):
        async def submit(prompt: list[int], output_len: int, stream: bool):
            request = GenerationRequest(token_ids=prompt, max_tokens=output_len, temperature=0.0, ignore_eos=True,
                                        final_only=not stream)
            async for chunk in async_engine.generate(request):
                yield chunk.token_ids

        return submit

    async def scenario(submit, timeline, in_len: int, out_len: int, label: str, loop_engine, runner) -> dict:
        count = args.num_requests if out_len <= 256 else args.num_requests_long
        prompts = synthetic_prompts(count, in_len, in_len * 7 + out_len, config["vocab_size"])
        if timeline is not None:
            timeline.steps.clear()

        def host(kind: str) -> dict[str, float]:
            return {**getattr(loop_engine, kind), **getattr(runner, kind)}

        before = host("host_seconds"), host("host_cpu_seconds"), loop_engine.num_steps
        result_ = await _run_requests(submit, prompts, out_len, f"{label} {in_len}/{out_len}", args.stream)
        steps = loop_engine.num_steps - before[2]
        # Where the host's time goes, per step (ms): scheduler loop and executor runner. Wall time
        # includes waits for the interpreter lock while the other thread runs; CPU time does not.
        result_["host_ms_per_step"] = {k: (v - before[0][k]) * 1e3 / max(steps, 1) for k, v in host("host_seconds").items()}
        result_["host_cpu_ms_per_step"] = {k: (v - before[1][k]) * 1e3 / max(steps, 1) for k, v in host("host_cpu_seconds").items()}
        result_["steps"] = steps
        log(f"{label} {in_len}/{out_len}: host ms per step (wall/CPU) " + ", ".join(
            f"{k} {v:.2f}/{result_['host_cpu_ms_per_step'][k]:.2f}" for k, v in result_["host_ms_per_step"].items()))
        if timeline is not None:
            result_["gpu_timeline_full_batch"] = timeline.summary(min_requests=engine.max_batch_size)
            result_["gpu_timeline_all_steps"] = timeline.summary()
            result_["gpu_timeline_by_kind"] = timeline.by_kind()
            # [requests, tokens, busy us, idle us before it] per step: where the ramp and the tail idle
            result_["gpu_timeline_steps"] = timeline.trace()
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")  # keep what is measured so far
        log(f"{label} {in_len}/{out_len}: {result_['output_tokens_per_s']:.0f} output tok/s" + (
            f", GPU idle {result_['gpu_timeline_full_batch']['idle_fraction']:.1%} of full-batch steps"
            if timeline is not None and result_["gpu_timeline_full_batch"]["idle_fraction"] is not None else ""))
        return result_

    async def main() -> None:
        async_engine, executor = await start(overlap=True)
        submit, timeline = submitter(async_engine), executor.runner.timeline
        try:
            # Warm-up: compiles whatever the first real steps would.
            await _run_requests(submit, synthetic_prompts(8, args.batch1[0], 99, config["vocab_size"]), 4, "warm-up")
            # Batch 1: time per output token against the memory-bandwidth limit.
            in_len, out_len = args.batch1
            if timeline is not None:
                timeline.steps.clear()
            one = await _run_requests(submit, synthetic_prompts(1, in_len, 1, config["vocab_size"]), out_len, "batch 1")
            if timeline is not None:
                # The GPU's idle time between decode steps: what the host adds to a token's time.
                one["gpu_timeline_by_kind"] = timeline.by_kind()
            if args.device.startswith("cuda"):
                bandwidth = measure_copy_bandwidth(args.device)
                mean_context = in_len + out_len / 2
                # As the engine stores them: an FP8 or INT4 engine reads fewer bytes, a 1-byte cache half.
                step_weight_bytes = engine_weight_bytes(engine.model)
                kv_step_bytes = kv_bytes_per_token(config, engine.kv_cache.element_size()) * mean_context
                limit_ms = (step_weight_bytes + kv_step_bytes) / bandwidth * 1e3
                one["bandwidth_limit"] = {
                    "copy_bandwidth_tb_s": bandwidth / 1e12, "weight_bytes": step_weight_bytes,
                    "kv_bytes_per_step_mean": kv_step_bytes,
                    "limit_ms_per_token": limit_ms, "tpot_over_limit": one["tpot_ms"]["p50"] / limit_ms,
                }
            result["batch1"] = one
            decode = one.get("gpu_timeline_by_kind", {}).get("one_token_per_request", {})
            log(f"batch 1: {one['tpot_ms']['p50']:.2f} ms/token" + (
                f" ({one['bandwidth_limit']['tpot_over_limit']:.2f}x the bandwidth limit)" if "bandwidth_limit" in one else "")
                + (f", GPU idle {decode['idle_fraction']:.1%} of decode steps" if decode.get("idle_fraction") is not None
                   else ""))
            for in_len, out_len in parse_scenarios(args.scenarios):
                result["inprocess"][f"{in_len}x{out_len}"] = await scenario(
                    submit, timeline, in_len, out_len, "inprocess", async_engine, executor.runner)
                Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
        finally:
            await stop(async_engine)
        # The same scenarios one step at a time: what overlapping the host work with the GPU's buys.
        if args.no_overlap_scenarios:
            async_engine, executor = await start(overlap=False)
            try:
                for in_len, out_len in parse_scenarios(args.no_overlap_scenarios):
                    result["inprocess_no_overlap"][f"{in_len}x{out_len}"] = await scenario(
                        submitter(async_engine), executor.runner.timeline, in_len, out_len, "inprocess, no overlap",
                        async_engine, executor.runner)
            finally:
                await stop(async_engine)

    asyncio.run(main())
    if engine.decode_graphs is not None:
        result["engine"]["graph_replays"] = engine.decode_graphs.num_replays
    engine.model = engine.kv_cache = engine.decode_graphs = None  # free the GPU for the next phase
    gc.collect()
    torch.cuda.empty_cache() if args.device.startswith("cuda") else None


# --------------------------------------------------------------------------- gRPC


@contextlib.contextmanager
def service_process(cmd: list[str], log_path: Path) -> Iterator[subprocess.Popen]:
    """Run an inflight service (serve, executor) for the block, its output in ``log_path``; stopped after."""
    log(f"starting {' '.join(cmd)} (log {log_path})")
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            yield proc
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def run_grpc(args, engine_dir: Path, config: dict, result: dict) -> None:
    from inflight.client import AsyncClient

    port, executor_port = free_port(), free_port()
    cmd = [
        sys.executable, "-m", "inflight", "serve", "--model", str(engine_dir), "--device", args.device,
        "--port", str(port), "--executor-port", str(executor_port), "--max-queue-size", str(1 << 20),
        "--capacity-policy", args.capacity_policy,
        "--kv-cache-fraction", str(args.kv_cache_fraction), *(["--enforce-eager"] if args.enforce_eager else []),
    ]
    log_path = Path(args.server_log)
    with service_process(cmd, log_path) as proc:
        async def main() -> None:
            async with AsyncClient(f"127.0.0.1:{port}") as client:
                deadline = time.monotonic() + args.startup_timeout
                while True:
                    if proc.poll() is not None:
                        raise RuntimeError(f"server exited: {log_path.read_text()[-3000:]}")
                    try:
                        await client.wait_ready(timeout=2.0)
                        if (await client.stats()).executor_ready:
                            break
                    except Exception:
                        if time.monotonic() > deadline:
                            raise
                    await asyncio.sleep(1.0)

                async def submit(prompt: list[int], output_len: int, stream: bool):
                    async for chunk in client.generate_stream(token_ids=prompt, max_tokens=output_len, temperature=0.0,
                                                              ignore_eos=True, final_only=not stream):
                        yield chunk.token_ids

                await _run_requests(submit, synthetic_prompts(8, args.batch1[0], 99, config["vocab_size"]), 4, "grpc warm-up")
                for in_len, out_len in parse_scenarios(args.grpc_scenarios):
                    count = args.num_requests if out_len <= 256 else args.num_requests_long
                    prompts = synthetic_prompts(count, in_len, in_len * 7 + out_len, config["vocab_size"])
                    scenario = await _run_requests(submit, prompts, out_len, f"grpc {in_len}/{out_len}", args.stream)
                    result["grpc"][f"{in_len}x{out_len}"] = scenario
                    log(f"grpc {in_len}/{out_len}: {scenario['output_tokens_per_s']:.0f} output tok/s")

        asyncio.run(main())


# --------------------------------------------------------------------------- split


def run_split(args, engine_dir: Path, config: dict, result: dict) -> None:
    """The scheduler's step loop in this process, the executor in its own, over the executor gRPC stream.

    The in-process path runs both in one interpreter, whose lock they share; this
    path keeps the scheduler's Python (planning, updates, streaming) and the
    executor's (inputs, launches) from waiting on each other."""
    from inflight.gc_tuning import release_garbage_collector, settle_garbage_collector
    from scheduler_svc.api_types import GenerationRequest
    from scheduler_svc.engine_loop import AsyncEngine
    from scheduler_svc.executor_client import GrpcExecutorConnection
    from scheduler_svc.tokenizer import Tokenizer

    executor_port = free_port()
    cmd = [
        sys.executable, "-m", "inflight", "executor", "--model", str(engine_dir), "--device", args.device,
        "--port", str(executor_port), "--kv-cache-fraction", str(args.kv_cache_fraction),
        *(["--kv-cache-gb", str(args.split_kv_cache_gb)] if args.split_kv_cache_gb else []),
        *(["--enforce-eager"] if args.enforce_eager else []),
    ]
    log_path = Path(args.server_log)
    with service_process(cmd, log_path) as proc:
        async def main() -> None:
            connection = GrpcExecutorConnection(f"127.0.0.1:{executor_port}", connect_timeout_s=2.0)
            deadline = time.monotonic() + args.startup_timeout
            while True:  # the executor is loading: wait for it, unless it died
                if proc.poll() is not None:
                    raise RuntimeError(f"executor exited: {log_path.read_text()[-3000:]}")
                try:
                    await connection.info()
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise
            async_engine = AsyncEngine(connection, Tokenizer(engine_dir), _limits(args))
            await async_engine.start()
            settle_garbage_collector()
            try:
                async def submit(prompt: list[int], output_len: int, stream: bool):
                    request = GenerationRequest(token_ids=prompt, max_tokens=output_len, temperature=0.0, ignore_eos=True,
                                                final_only=not stream)
                    async for chunk in async_engine.generate(request):
                        yield chunk.token_ids

                await _run_requests(submit, synthetic_prompts(8, args.batch1[0], 99, config["vocab_size"]), 4, "split warm-up")
                for in_len, out_len in parse_scenarios(args.split_scenarios):
                    count = args.num_requests if out_len <= 256 else args.num_requests_long
                    prompts = synthetic_prompts(count, in_len, in_len * 7 + out_len, config["vocab_size"])
                    before, steps = dict(async_engine.host_seconds), async_engine.num_steps
                    scenario = await _run_requests(submit, prompts, out_len, f"split {in_len}/{out_len}", args.stream)
                    steps = async_engine.num_steps - steps
                    scenario["steps"] = steps
                    scenario["scheduler_host_ms_per_step"] = {
                        k: (v - before[k]) * 1e3 / max(steps, 1) for k, v in async_engine.host_seconds.items()}
                    result["split"][f"{in_len}x{out_len}"] = scenario
                    log(f"split {in_len}/{out_len}: {scenario['output_tokens_per_s']:.0f} output tok/s")
            finally:
                await async_engine.stop()
                release_garbage_collector()

        asyncio.run(main())


# --------------------------------------------------------------------------- peer


def run_peer(args, checkpoint_config: dict, result: dict) -> None:
    """transformers ``generate`` (eager, bf16, random weights of the same shape) at the peer batch sizes."""
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(**{k: v for k, v in checkpoint_config.items() if k != "architectures"})
    dtype = {"auto": torch.bfloat16, "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    with torch.device(args.device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    in_len, out_len = args.peer_lengths
    peer = {"library": "transformers", "version": transformers.__version__, "input_len": in_len, "output_len": out_len, "batches": {}}
    for batch in args.peer_batches:
        ids = torch.tensor(synthetic_prompts(batch, in_len, 5, config.vocab_size), device=args.device)
        kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, eos_token_id=None)
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=8, min_new_tokens=8, **kwargs)  # warm-up
            torch.cuda.synchronize() if args.device.startswith("cuda") else None
            t0 = time.perf_counter()
            out = model.generate(ids, max_new_tokens=out_len, min_new_tokens=out_len, **kwargs)
            torch.cuda.synchronize() if args.device.startswith("cuda") else None
            wall = time.perf_counter() - t0
        assert out.shape[1] - in_len == out_len
        peer["batches"][str(batch)] = {"wall_s": wall, "output_tokens_per_s": batch * out_len / wall}
        log(f"transformers batch {batch} {in_len}/{out_len}: {batch * out_len / wall:.0f} output tok/s")
    result["peer"] = peer
    del model
    gc.collect()
    torch.cuda.empty_cache() if args.device.startswith("cuda") else None


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_source_args(p)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--scenarios", default="128x128,128x2048,2048x128,2048x2048", help="INPUTxOUTPUT,...")
    p.add_argument("--grpc-scenarios", default="128x128,2048x2048", help="scenarios also run through gRPC")
    p.add_argument("--split-scenarios", default="128x128",
                   help="scenarios of the split path: this process schedules, an executor process runs the model")
    p.add_argument("--split-kv-cache-gb", type=float, default=0.0,
                   help="the split path's executor KV cache; 0 = its --kv-cache-fraction of what is free")
    p.add_argument("--paths", default="inprocess,grpc", help="any of inprocess, split, grpc")
    p.add_argument("--no-overlap-scenarios", default="128x128", help="scenarios also run in-process without overlap")
    p.add_argument("--num-requests", type=int, default=1024, help="requests per scenario with short outputs")
    p.add_argument("--num-requests-long", type=int, default=512, help="requests per scenario with outputs > 256 tokens")
    p.add_argument("--batch1", type=int, nargs=2, default=[128, 256], metavar=("IN", "OUT"))
    p.add_argument("--peer-batches", type=int, nargs="*", default=[1, 64])
    p.add_argument("--peer-lengths", type=int, nargs=2, default=[128, 128], metavar=("IN", "OUT"))
    add_engine_build_args(p)
    p.add_argument("--max-seq-len", type=int, default=0, help="default: the longest scenario")
    p.add_argument("--kv-cache-fraction", type=float, default=0.9)
    p.add_argument(
        "--capacity-policy", default="guaranteed_no_evict", choices=["guaranteed_no_evict", "max_utilization"],
        help="admit a request only with KV blocks for all its tokens, or optimistically (preempting when short)",
    )
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--server-log", default="/tmp/inflight-offline-serve.log")
    p.add_argument("--switch-interval-ms", type=float, default=0.0,
                   help="the interpreter's thread switch interval (sys.setswitchinterval); 0 = Python's default (5 ms)")
    p.add_argument("--keep-gc-defaults", action="store_true",
                   help="leave the garbage collector as the interpreter starts it (to measure what settling it buys)")
    p.add_argument("--stream", action="store_true",
                   help="clients stream every step's tokens (TTFT, TPOT) instead of taking each completion whole")
    p.add_argument("--output", required=True)
    args = p.parse_args(argv)
    default_load_format(args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.switch_interval_ms > 0:  # how long a thread waiting for the GIL waits before forcing a switch
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    result: dict = {
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        "git": git_info(), "system": device_info(args.device), "model": args.shape or args.model,
        "load_format": args.load_format, "gc_settled": not args.keep_gc_defaults, "quant_algo": args.quant_algo,
        "kv_cache_quant_algo": args.kv_cache_quant_algo, "group_size": args.group_size,
        "exclude_modules": args.exclude_modules, "capacity_policy": args.capacity_policy,
        "inprocess": {}, "inprocess_no_overlap": {}, "split": {}, "grpc": {},
    }
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        output.write_text(json.dumps(result, indent=2) + "\n")

    engine_dir, config = build_engine_dir(args)
    paths = args.paths.split(",")
    try:
        if args.peer_batches:
            run_peer(args, config, result)
            save()
        # The paths that start service processes go first: their processes give the whole GPU back
        # when they exit, while this one keeps at least its CUDA context after the in-process path
        # (and once, on an H200, kept so much that the gRPC executor found no room for a KV cache).
        if "grpc" in paths:
            run_grpc(args, engine_dir, config, result)
            save()
        if "split" in paths:
            run_split(args, engine_dir, config, result)
            save()
        if "inprocess" in paths:
            run_inprocess(args, engine_dir, config, result)
    finally:
        peer64 = result.get("peer", {}).get("batches", {}).get("64")
        inproc = result["inprocess"].get("128x128")
        if peer64 and inproc:
            result["ratio_128x128_over_hf_batch64"] = inproc["output_tokens_per_s"] / peer64["output_tokens_per_s"]
        save()
        log(f"wrote {output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
