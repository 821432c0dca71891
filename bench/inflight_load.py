"""The inflight side of the serving benchmark: the server process and the concurrent gRPC load."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from tqdm import tqdm

from bench_common import MONITOR, REPO, foreign, free_port, log, summarize_ms, wait_idle


# --------------------------------------------------------------------------- the server


class InflightServer:
    """``python -m inflight serve`` in its own process group; stopped on exit, whatever happens."""

    def __init__(self, args: argparse.Namespace, device: str, dtype: str) -> None:
        self.port = args.port or free_port()
        self.executor_port = args.executor_port or free_port()
        while self.executor_port == self.port:
            self.executor_port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.cmd = [
            sys.executable, "-m", "inflight", "serve", "--model", args.model,
            "--port", str(self.port), "--executor-port", str(self.executor_port),
            "--device", device, "--dtype", dtype, "--max-batch-size", str(args.max_batch_size),
            "--max-num-tokens", str(args.max_num_tokens), "--tokens-per-block", str(args.tokens_per_block),
            "--max-seq-len", str(args.max_seq_len), "--kv-cache-gb", str(args.kv_cache_gb),
        ] + list(args.server_arg)
        self.startup_timeout = args.startup_timeout
        self.log_path = Path(args.server_log) if args.server_log else Path(tempfile.mkstemp(prefix="inflight-serve-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> InflightServer:
        log(f"starting server: {' '.join(self.cmd)} (log: {self.log_path})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            self.cmd, cwd=REPO, stdout=self._log_file, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"},
        )
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"server exited with code {self.proc.returncode}; last log lines:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    async def wait_ready(self, client) -> dict:
        """Poll until the client port accepts connections and the executor is attached.

        A plain TCP probe first: a gRPC channel that failed to connect backs off
        exponentially and would notice the server late.
        """
        deadline = time.monotonic() + self.startup_timeout
        with tqdm(desc="server starting", unit="s", file=sys.stderr, leave=False, bar_format="{desc}: {elapsed}", mininterval=5) as bar:
            while True:
                self.check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"server not ready after {self.startup_timeout:.0f} s; last log lines:\n{self.log_tail()}")
                try:
                    with socket.create_connection(("127.0.0.1", self.port), timeout=1.0):
                        pass
                    await client.wait_ready(timeout=5.0)
                    if (await client.stats()).executor_ready:
                        break
                except (OSError, asyncio.TimeoutError, grpc.RpcError):
                    pass
                await asyncio.sleep(0.2)
                bar.update()
        self.startup_s = time.monotonic() - self.started
        info = await client.model_info()
        return {
            "startup_s": self.startup_s,
            "model": info.model, "device": info.device, "max_seq_len": info.max_seq_len,
            "max_batch_size": info.max_batch_size, "max_num_tokens": info.max_num_tokens,
            "tokens_per_block": info.tokens_per_block, "num_kv_blocks": info.num_kv_blocks,
        }

    def stop(self) -> None:
        proc = self.proc
        if proc is None:
            return
        self.proc = None
        try:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # serve stops the scheduler, then its executor child
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    log("server did not stop in 30 s; killing its process group")
        finally:
            try:  # the group is ours (start_new_session): catches an executor child left behind
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            self._log_file.close()
            log(f"server stopped (exit code {proc.returncode})")


# --------------------------------------------------------------------------- inflight measurement


@dataclass
class RequestTrace:
    sent: float = 0.0
    token_times: list[float] = field(default_factory=list)  # one per token-bearing chunk
    chunk_sizes: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str = ""
    usage: dict | None = None


async def one_request(client, prompt: list[int], output_len: int, trace: RequestTrace, bar: tqdm | None) -> None:
    trace.sent = time.perf_counter()
    async for chunk in client.generate_stream(
        token_ids=prompt, max_tokens=output_len, temperature=0.0, ignore_eos=True,
    ):
        now = time.perf_counter()
        if chunk.token_ids:
            trace.token_times.append(now)
            trace.chunk_sizes.append(len(chunk.token_ids))
            trace.token_ids.extend(chunk.token_ids)
            if bar is not None:
                bar.update(len(chunk.token_ids))
        if chunk.finish_reason is not None:
            trace.finish_reason, trace.error = chunk.finish_reason, chunk.error
            if chunk.usage is not None:
                trace.usage = {
                    "prompt_tokens": chunk.usage.prompt_tokens, "completion_tokens": chunk.usage.completion_tokens,
                    "cached_tokens": chunk.usage.cached_tokens,
                }


def trace_metrics(traces: list[RequestTrace], prompts: list[list[int]], output_len: int, wall: float) -> dict:
    """Throughput and latency percentiles of finished requests; raises if any came back short."""
    problems = [
        f"request {i}: finish_reason={t.finish_reason!r} tokens={len(t.token_ids)} error={t.error!r}"
        for i, t in enumerate(traces)
        if t.finish_reason != "length" or len(t.token_ids) != output_len
    ]
    if problems:
        raise RuntimeError("requests did not produce exactly output-len tokens:\n" + "\n".join(problems))

    ttft = [t.token_times[0] - t.sent for t in traces]
    tpot = [(t.token_times[-1] - t.token_times[0]) / (len(t.token_ids) - 1) for t in traces if len(t.token_ids) > 1]
    itl = [b - a for t in traces for a, b in zip(t.token_times, t.token_times[1:])]
    e2e = [t.token_times[-1] - t.sent for t in traces]
    total_out = sum(len(t.token_ids) for t in traces)
    total_in = sum(len(p) for p in prompts)
    metrics = {
        "num_requests": len(prompts),
        "wall_s": wall,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "output_tokens_per_s": total_out / wall,
        "total_tokens_per_s": (total_in + total_out) / wall,
        "requests_per_s": len(prompts) / wall,
        "ttft_ms": summarize_ms(ttft),
        "tpot_ms": summarize_ms(tpot),
        "itl_ms": summarize_ms(itl),
        "e2e_latency_ms": summarize_ms(e2e),
        "max_tokens_per_chunk": max(max(t.chunk_sizes) for t in traces),
        "cached_prompt_tokens": sum((t.usage or {}).get("cached_tokens", 0) for t in traces),
    }
    return metrics


async def run_level(client, prompts: list[list[int]], output_len: int, desc: str) -> tuple[dict, list[RequestTrace]]:
    traces = [RequestTrace() for _ in prompts]
    steps_before = (await client.stats()).num_steps
    with tqdm(total=len(prompts) * output_len, desc=desc, unit="tok", file=sys.stderr, leave=False) as bar:
        cpu_start = MONITOR.snapshot()
        start = time.perf_counter()
        await asyncio.gather(*(one_request(client, p, output_len, t, bar) for p, t in zip(prompts, traces)))
        wall = time.perf_counter() - start
        cpu = MONITOR.report(cpu_start)
    steps = (await client.stats()).num_steps - steps_before

    metrics = trace_metrics(traces, prompts, output_len, wall)
    metrics.update(concurrency=len(prompts), server_steps=steps, cpu=cpu)
    return metrics, traces


async def run_inflight(args, server: InflightServer, prompt_sets: list[list[list[int]]], warmup_prompts: list[list[int]], levels: list[int]):
    """prompt_sets[k]: the prompts of attempt k (a level is measured again, on fresh prompts, when other
    processes took more than --max-foreign of the CPUs during it; the least disturbed attempt is kept)."""
    from inflight.client import AsyncClient

    async with AsyncClient(server.address) as client:
        server_info = await server.wait_ready(client)
        log(f"server ready: {server_info}")
        if args.warmup_tokens > 0:
            # Same batch shapes as the largest level, short outputs, other prompts (no prefix reuse).
            await run_level(client, warmup_prompts, args.warmup_tokens, "inflight warmup")
        results, outputs = {}, {}
        for c in levels:
            tries, best = [], None
            for attempt in range(args.attempts):
                idle = wait_idle(args, f"inflight c={c}")
                metrics, traces = await run_level(client, prompt_sets[attempt][:c], args.output_len, f"inflight c={c}")
                metrics["idle_wait"] = idle
                tries.append({"output_tokens_per_s": metrics["output_tokens_per_s"], "foreign_share": metrics["cpu"]["foreign_share"]})
                if attempt == 0:
                    outputs[c] = [t.token_ids for t in traces]  # attempt 0 has the prompts the peer sees
                if best is None or foreign(metrics["cpu"]) < foreign(best["cpu"]):
                    best = metrics
                    best["attempt"] = attempt
                if foreign(metrics["cpu"]) <= args.max_foreign:
                    break
                log(f"inflight c={c}: other processes took {foreign(metrics['cpu']):.0%} of the CPUs; measuring again")
            best["attempts"] = tries
            results[str(c)] = metrics = best
            log(
                f"inflight c={c}: {metrics['output_tokens_per_s']:.1f} out tok/s, "
                f"TTFT p50 {metrics['ttft_ms']['p50']:.0f} ms, TPOT p50 {metrics['tpot_ms']['p50']:.1f} ms, "
                f"{metrics['server_steps']} steps"
            )
            server.check_alive()
    return server_info, results, outputs
