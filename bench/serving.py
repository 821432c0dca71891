"""Serving benchmark: inflight over its real gRPC path vs. Hugging Face ``generate``.

Starts ``python -m inflight serve`` as a subprocess on free ports, waits until
it answers, sends N concurrent streaming requests of exactly ``--input-len``
prompt tokens and ``--output-len`` output tokens (greedy, ``ignore_eos``),
measures throughput, TTFT, TPOT and inter-token latency, and stops the server
(always, also on error or Ctrl-C). With ``--peer`` it then loads the same model
in transformers and times ``generate`` on the same prompts, one at a time and
as one left-padded batch, after the server is gone so the two never share CPU.

    python bench/serving.py --concurrency 1,16 --input-len 128 --output-len 128 \\
        --device cpu --plot --output bench/results/cpu_smollm2_128x128.json

See bench/README.md for the JSON fields.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import grpc  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

# Source text for the prompts (original prose, no dataset needed). Each request
# gets a different rotation of its token stream, so no two prompts are equal
# and no two share a prefix.
CORPUS = """\
The lighthouse keeper kept a ledger of every ship that passed the point, and over forty years the ledger grew
into eleven volumes bound in cracked green leather. Most entries were short: a name, a flag, the hour, the
direction of the wind. Some were longer. In the winter of the great storm he wrote three pages about a coal
barge that lost its rudder off the northern reef and drifted for two days while the crew burned furniture to
stay warm. The barge came ashore on the sand below the cliffs, and the keeper carried soup down the stairs cut
into the rock, two pots at a time, until his knees gave out and his daughter took over.
Engineers who design bridges talk about loads in a language that sounds almost moral. A structure must carry
its own weight, which they call the dead load, and the weight of whatever crosses it, the live load. It must
also survive things nobody planned for: wind that sets the deck swaying at its natural frequency, a truck
that brakes hard in the middle of the span, the slow creep of concrete under years of stress. Good design is
less about strength than about knowing where the forces go and giving each one a path to the ground.
In the market on Thursdays an old man sold honey from a folding table. He kept the jars sorted by the flowers
the bees had visited: clover, heather, linden, buckwheat so dark it looked like motor oil. Children were allowed
to taste from a wooden spoon, and he would watch their faces to guess which jar their parents would buy. He
said the heather honey was the hardest to harvest because it sets like jelly in the comb, and each frame has to
be pressed by hand, slowly, on cold mornings when the kitchen smells of wax.
A compiler reads a program several times before it writes a single instruction. The first pass turns characters
into tokens, the second arranges tokens into a tree, and later passes walk that tree again and again, checking
types, folding constants, moving work out of loops, and deciding which values deserve a register and which can
wait in memory. By the end the program has been rewritten so many times that the original author would barely
recognize it, yet it still does exactly what they asked, only faster.
The river changes its course every few centuries, and the old channels remain as crescent lakes in the fields.
Farmers plough around them. Herons stand in the shallows at dawn, and in late summer the water turns green
with algae and smells of iron. Surveyors once tried to straighten the river with dikes and cuts, but each flood
found the weak places and the water went back to the long slow curves it preferred.
"""

TARGETS = {  # acceptance criteria (CPU, SmolLM2): ratio name -> minimum
    "inflight_c16_over_hf_one_at_a_time": 3.0,
    "inflight_c16_over_hf_padded_batch_16": 1.0,
    "inflight_c1_over_hf_one_at_a_time": 1.0,  # batch 1 vs batch 1
}


# --------------------------------------------------------------------------- helpers


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize_ms(values_s: list[float]) -> dict:
    ms = [v * 1e3 for v in values_s]
    return {
        "mean": float(np.mean(ms)) if ms else None,
        "p50": pct(ms, 50),
        "p99": pct(ms, 99),
        "min": float(min(ms)) if ms else None,
        "max": float(max(ms)) if ms else None,
    }


def git_info() -> dict:
    def run(*cmd: str) -> str:
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()

    try:
        return {"commit": run("git", "rev-parse", "HEAD"), "dirty": bool(run("git", "status", "--porcelain"))}
    except Exception as exc:  # not a checkout, git missing
        return {"commit": None, "dirty": None, "error": str(exc)}


def device_info(device: str) -> dict:
    import torch

    info: dict = {
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
        info["cuda"] = torch.version.cuda
    cpu_model = platform.processor() or None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info["cpu_model"] = cpu_model
    info["cpu_count"] = os.cpu_count()
    try:
        info["cpu_affinity"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    info["torch_threads"] = torch.get_num_threads()
    try:
        info["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    return info


def resolve_device_and_dtype(device: str, dtype: str) -> tuple[str, str]:
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":  # the engine's own rule: bfloat16 on GPU, float32 on CPU
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    return device, dtype


def build_prompts(tokenizer, count: int, input_len: int, offset: int = 0) -> list[list[int]]:
    """``count`` different prompts of exactly ``input_len`` token ids, rotations of CORPUS."""
    base = tokenizer(CORPUS, add_special_tokens=False)["input_ids"]
    stride = 61  # prime, coprime with len(base): offsets below len(base) give distinct rotations
    prompts = []
    for i in range(count):
        start = ((offset + i) * stride) % len(base)
        stream = base[start:] + base[:start]
        while len(stream) < input_len:
            stream = stream + base
        prompts.append(stream[:input_len])
    assert len({tuple(p) for p in prompts}) == len(prompts), "prompts are not distinct"
    return prompts


# --------------------------------------------------------------------------- CPU contention


class CpuMonitor:
    """CPU seconds spent during a phase by the whole machine, by us (this process and its
    children: the server and its executor), and by everything else ("foreign").

    The machine may be shared; foreign CPU during a timed phase means the numbers
    are not clean, and the JSON says so instead of hiding it.
    """

    def __init__(self) -> None:
        try:
            import psutil

            self.psutil = psutil
        except ImportError:  # then only the machine-wide figure is reported
            self.psutil = None
        self.ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.tick = os.sysconf("SC_CLK_TCK")

    def machine_busy_s(self) -> float:
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except OSError:
            return float("nan")
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return (sum(fields[:8]) - idle) / self.tick

    # Our processes by depth below this one: the benchmark itself (client, or the peer),
    # `inflight serve` (the scheduler), and its child (the executor).
    ROLES = ("benchmark", "scheduler", "executor")

    def own_cpu_s(self) -> dict[str, float] | None:
        if self.psutil is None:
            return None
        by_role: dict[str, float] = {}
        try:
            level = [self.psutil.Process()]
        except self.psutil.Error:
            return None
        depth = 0
        while level:
            role = self.ROLES[min(depth, len(self.ROLES) - 1)]
            children = []
            for proc in level:
                try:
                    t = proc.cpu_times()
                    by_role[role] = by_role.get(role, 0.0) + t.user + t.system
                    children += proc.children()
                except self.psutil.Error:
                    pass
            level, depth = children, depth + 1
        return by_role

    def snapshot(self) -> tuple[float, float, dict[str, float] | None]:
        return time.perf_counter(), self.machine_busy_s(), self.own_cpu_s()

    def report(self, start: tuple[float, float, dict[str, float] | None]) -> dict:
        end = self.snapshot()
        wall = end[0] - start[0]
        busy = end[1] - start[1]
        by_role = None
        if start[2] is not None and end[2] is not None:
            by_role = {role: end[2][role] - start[2].get(role, 0.0) for role in end[2] if role in start[2]}
        own = None if by_role is None else sum(by_role.values())
        foreign = None if own is None else max(0.0, busy - own)
        return {
            "wall_s": wall,
            "cpus": self.ncpu,
            "machine_busy_cpu_s": busy,
            "own_cpu_s": own,
            # CPU seconds per process of ours (the executor's torch threads count together)
            "own_cpu_s_by_process": by_role,
            "foreign_cpu_s": foreign,
            # share of the machine's CPU capacity used by other processes during the phase
            "foreign_share": None if foreign is None or wall <= 0 else foreign / (wall * self.ncpu),
        }

    def merge(self, reports: list[dict]) -> dict:
        """Several timed windows as one (e.g. the requests of a one-at-a-time run, not the gaps)."""
        total = {"wall_s": 0.0, "cpus": self.ncpu, "machine_busy_cpu_s": 0.0, "own_cpu_s": 0.0, "own_cpu_s_by_process": {},
                 "foreign_cpu_s": 0.0}
        for r in reports:
            for k in ("wall_s", "machine_busy_cpu_s", "own_cpu_s", "foreign_cpu_s"):
                total[k] = None if total[k] is None or r[k] is None else total[k] + r[k]
            for role, v in (r.get("own_cpu_s_by_process") or {}).items():
                total["own_cpu_s_by_process"][role] = total["own_cpu_s_by_process"].get(role, 0.0) + v
        total["foreign_share"] = (
            None if total["foreign_cpu_s"] is None or not total["wall_s"] else total["foreign_cpu_s"] / (total["wall_s"] * self.ncpu)
        )
        return total

    def wait_idle(self, max_wait_s: float, threshold: float, what: str) -> dict:
        """Wait (up to max_wait_s) until others use under ``threshold`` of the machine over 2 s."""
        started = time.monotonic()
        share = None
        while True:
            snap = self.snapshot()
            time.sleep(2.0)
            share = self.report(snap)["foreign_share"]
            if share is None or share < threshold or time.monotonic() - started >= max_wait_s:
                break
            log(f"machine busy with other processes ({share:.0%} of {self.ncpu} CPUs); waiting before {what}")
        waited = time.monotonic() - started
        return {"waited_s": round(waited, 1), "foreign_share_at_start": share, "idle": share is None or share < threshold}


MONITOR = CpuMonitor()


def foreign(cpu: dict) -> float:
    return cpu.get("foreign_share") or 0.0


def wait_idle(args, what: str) -> dict | None:
    return MONITOR.wait_idle(args.wait_idle, args.idle_threshold, what) if args.wait_idle > 0 else None


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
        "concurrency": len(prompts),
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
        "server_steps": steps,
        "max_tokens_per_chunk": max(max(t.chunk_sizes) for t in traces),
        "cached_prompt_tokens": sum((t.usage or {}).get("cached_tokens", 0) for t in traces),
        "cpu": cpu,
    }
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


# --------------------------------------------------------------------------- the peer


def run_peer(args, model_dir: Path, device: str, dtype: str, prompts: list[list[int]], batch_sizes: list[int], pad_token_id: int) -> tuple[dict, list[list[int]]]:
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    log(f"loading transformers peer ({dtype} on {device})")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype).to(device).eval()
    gen_kwargs = dict(
        max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False,
        temperature=None, top_p=None, top_k=None, pad_token_id=pad_token_id,
    )

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def generate(batch: list[list[int]], max_new: int | None = None) -> torch.Tensor:
        # Left padding + attention mask (all prompts have the same length here, so nothing is padded,
        # but the code path is the general one).
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, p in enumerate(batch):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        kwargs = dict(gen_kwargs)
        if max_new is not None:
            kwargs.update(max_new_tokens=max_new, min_new_tokens=max_new)
        with torch.inference_mode():
            out = model.generate(ids.to(device), attention_mask=mask.to(device), **kwargs)
        sync()
        return out[:, width:]

    if args.warmup_tokens > 0:
        generate(prompts[: max(batch_sizes)], args.warmup_tokens)
        generate(prompts[:1], args.warmup_tokens)

    def timed(fn, what: str) -> tuple:
        """fn() timed after an idle wait; again (up to --attempts) while others took > --max-foreign of the CPUs."""
        best, tries = None, []
        for attempt in range(args.attempts):
            idle = wait_idle(args, what)
            snap = MONITOR.snapshot()
            t0 = time.perf_counter()
            out = fn()
            seconds = time.perf_counter() - t0
            cpu = MONITOR.report(snap)
            tries.append({"seconds": seconds, "foreign_share": cpu["foreign_share"]})
            if best is None or foreign(cpu) < foreign(best[2]):
                best = (out, seconds, cpu, idle)
            if foreign(cpu) <= args.max_foreign:
                break
            log(f"{what}: other processes took {foreign(cpu):.0%} of the CPUs; measuring again")
        return (*best, tries)

    n = max(batch_sizes)
    latencies, outputs, cpu_windows, waited, retried = [], [], [], 0.0, 0
    # Only the requests are timed (throughput = tokens / sum of request times), so the
    # idle wait and any repeat can be per request.
    for i, p in enumerate(tqdm(prompts[:n], desc="hf one-at-a-time", unit="req", file=sys.stderr, leave=False)):
        out, seconds, cpu, idle, tries = timed(lambda: generate([p]), f"hf one-at-a-time request {i}")
        latencies.append(seconds)
        cpu_windows.append(cpu)
        waited += (idle or {}).get("waited_s", 0.0)
        retried += len(tries) - 1
        assert out.shape[1] == args.output_len, out.shape
        outputs.append(out[0].tolist())
    cpu = MONITOR.merge(cpu_windows)
    clean = [i for i, w in enumerate(cpu_windows) if foreign(w) <= args.max_foreign]
    idle = {
        "waited_s": round(waited, 1), "repeated_requests": retried,
        "per_request_foreign_share": [None if w["foreign_share"] is None else round(w["foreign_share"], 3) for w in cpu_windows],
    }
    total = n * args.output_len
    peer: dict = {
        "library": "transformers",
        "transformers_version": __import__("transformers").__version__,
        "dtype": dtype,
        "one_at_a_time": {
            "num_requests": n,
            "wall_s": sum(latencies),
            "total_output_tokens": total,
            "output_tokens_per_s": total / sum(latencies),
            # the same over the requests during which others took <= --max-foreign of the CPUs
            "num_clean_requests": len(clean),
            "output_tokens_per_s_clean_requests": len(clean) * args.output_len / sum(latencies[i] for i in clean) if clean else None,
            "request_latency_ms": summarize_ms(latencies),
            "cpu": cpu,
            "idle_wait": idle,
        },
        "padded_batch": {},
    }
    log(f"hf one-at-a-time: {peer['one_at_a_time']['output_tokens_per_s']:.1f} out tok/s")
    for b in batch_sizes:
        if b == 1:
            continue
        with tqdm(total=1, desc=f"hf padded batch {b}", unit="batch", file=sys.stderr, leave=False) as bar:
            out, wall, cpu, idle, tries = timed(lambda: generate(prompts[:b]), f"hf padded batch {b}")
            bar.update()
        assert out.shape == (b, args.output_len), out.shape
        peer["padded_batch"][str(b)] = {
            "batch_size": b, "wall_s": wall, "total_output_tokens": b * args.output_len,
            "output_tokens_per_s": b * args.output_len / wall, "cpu": cpu, "idle_wait": idle, "attempts": tries,
        }
        log(f"hf padded batch {b}: {b * args.output_len / wall:.1f} out tok/s")
    del model
    return peer, outputs


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How closely inflight's greedy outputs match transformers' one-at-a-time ones (sanity, not a target)."""
    prefix = []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefix.append(n)
    return {
        "num_requests": len(prefix),
        "identical_outputs": sum(1 for x, y in zip(a, b) if x == y),
        "mean_matching_prefix_tokens": float(np.mean(prefix)) if prefix else None,
        "min_matching_prefix_tokens": min(prefix) if prefix else None,
    }


# --------------------------------------------------------------------------- report


def ratios(inflight: dict, peer: dict | None) -> tuple[dict, dict]:
    if not peer:
        return {}, {}
    one = peer["one_at_a_time"]
    # Other processes only slow the peer down, which would flatter inflight: when some of its
    # requests were disturbed, compare with the undisturbed ones.
    if 0 < one["num_clean_requests"] < one["num_requests"]:
        hf_one, basis = one["output_tokens_per_s_clean_requests"], f"{one['num_clean_requests']} undisturbed requests"
    else:
        hf_one, basis = one["output_tokens_per_s"], f"all {one['num_requests']} requests"
    out: dict = {"hf_one_at_a_time_output_tokens_per_s_used": hf_one, "hf_one_at_a_time_basis": basis}
    for c, m in inflight.items():
        tps = m["output_tokens_per_s"]
        out[f"inflight_c{c}_over_hf_one_at_a_time"] = tps / hf_one
        if c in peer["padded_batch"]:
            out[f"inflight_c{c}_over_hf_padded_batch_{c}"] = tps / peer["padded_batch"][c]["output_tokens_per_s"]
    acceptance = {
        name: {"value": out[name], "target": f">= {target:g}", "met": bool(out[name] >= target)}
        for name, target in TARGETS.items()
        if name in out
    }
    return out, acceptance


def contention_warnings(result: dict, limit: float = 0.05) -> list[str]:
    """Phases during which other processes took more than ``limit`` of the machine's CPU."""
    phases = [(f"inflight c={c}", m["cpu"]) for c, m in result["inflight"].items()]
    if result.get("peer"):
        phases.append(("hf one-at-a-time", result["peer"]["one_at_a_time"]["cpu"]))
        phases += [(f"hf padded batch {b}", m["cpu"]) for b, m in result["peer"]["padded_batch"].items()]
    return [
        f"{name}: other processes used {cpu['foreign_share']:.0%} of the machine's CPU during the timed phase"
        for name, cpu in phases
        if cpu.get("foreign_share") is not None and cpu["foreign_share"] > limit
    ]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, values, colors = [], [], []
    for c, m in result["inflight"].items():
        labels.append(f"inflight\n{c} concurrent")
        values.append(m["output_tokens_per_s"])
        colors.append("tab:blue")
    peer = result.get("peer")
    if peer:
        labels.append("HF generate\none at a time")
        values.append(peer["one_at_a_time"]["output_tokens_per_s"])
        colors.append("tab:orange")
        for b, m in peer["padded_batch"].items():
            labels.append(f"HF generate\npadded batch {b}")
            values.append(m["output_tokens_per_s"])
            colors.append("tab:red")
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(labels)), 4.5))
    bars = ax.bar(range(len(values)), values, color=colors)
    ax.bar_label(bars, labels=[f"{v:.0f}" for v in values], padding=2)
    ax.set_xticks(range(len(values)), labels)
    ax.set_ylabel("output tokens / s")
    dev = result["device"]
    where = dev.get("gpu") or f"{dev.get('cpu_model')}, {dev.get('cpu_affinity', dev.get('cpu_count'))} cores"
    ax.set_title(f"{Path(result['model']).name}: {result['input_len']} in / {result['output_len']} out tokens\n{where}", fontsize=10)
    ax.margins(y=0.15)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--concurrency", default="1,16", help="comma-separated concurrency levels, run in order")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    p.add_argument("--model", default="smollm2-135m-instruct", help="model name, HF folder or .gguf (as `inflight serve`)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto = float32 on CPU, bfloat16 on GPU (server and peer alike)")
    p.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True, help="also time transformers generate")
    p.add_argument("--output", default="bench/results/serving.json", help="JSON result path")
    p.add_argument("--plot", action="store_true", help="also write a PNG bar chart next to the JSON")
    p.add_argument("--wait-idle", type=float, default=300.0,
                   help="before each timed phase, wait up to this many seconds for other processes to leave the CPUs; 0 = don't")
    p.add_argument("--idle-threshold", type=float, default=0.10,
                   help="'idle' = other processes use less than this share of the machine's CPUs")
    p.add_argument("--attempts", type=int, default=3,
                   help="measure a phase up to this many times while other processes took more than --max-foreign of the CPUs "
                        "during it; the least disturbed attempt is kept, all are listed")
    p.add_argument("--max-foreign", type=float, default=0.05, help="see --attempts")
    p.add_argument("--warmup-tokens", type=int, default=8,
                   help="output tokens of the untimed warmup batch (max-concurrency requests, other prompts); 0 = none")
    g = p.add_argument_group("server")
    g.add_argument("--port", type=int, default=0, help="client port (0 = a free one)")
    g.add_argument("--executor-port", type=int, default=0, help="executor port (0 = a free one)")
    g.add_argument("--max-batch-size", type=int, default=256)
    g.add_argument("--max-num-tokens", type=int, default=8192)
    g.add_argument("--max-seq-len", type=int, default=0, help="0 = input-len + output-len")
    g.add_argument("--tokens-per-block", type=int, default=32)
    g.add_argument("--kv-cache-gb", type=float, default=0.0, help="0 = the server's default")
    g.add_argument("--server-arg", action="append", default=[], help="extra argument for `inflight serve` (repeatable)")
    g.add_argument("--server-log", default="", help="keep the server's log here (default: a temp file)")
    g.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for the server")
    args = p.parse_args(argv)
    args.levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    if not args.levels or min(args.levels) < 1:
        p.error("--concurrency needs positive integers")
    if args.input_len < 1 or args.output_len < 1:
        p.error("--input-len and --output-len must be positive")
    if args.max_seq_len == 0:
        args.max_seq_len = args.input_len + args.output_len
    args.warmup_tokens = max(0, min(args.warmup_tokens, args.output_len))
    args.attempts = max(1, args.attempts)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM -> SystemExit, so the server is stopped by the finally/with blocks below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from transformers import AutoTokenizer

    from inflight.model_store import resolve_model

    device, dtype = resolve_device_and_dtype(args.device, args.dtype)
    model_dir = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    n = max(args.levels)
    prompt_sets = [build_prompts(tokenizer, n, args.input_len, offset=k * (n + 3)) for k in range(args.attempts + 1)]
    prompts, warmup_prompts = prompt_sets[0], prompt_sets.pop()
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    result: dict = {
        "benchmark": "inflight serving (gRPC)",
        "command": shlex.join(sys.argv if argv is None else ["bench/serving.py", *argv]),
        "git": git_info(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": device_info(device),
        "model": args.model,
        "dtype": dtype,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "concurrency_levels": args.levels,
        "sampling": {"temperature": 0.0, "ignore_eos": True, "max_tokens": args.output_len},
        "warmup_tokens": args.warmup_tokens,
    }

    server = InflightServer(args, device, dtype)
    # The server as `python -m inflight ...`: no paths of the machine that ran it.
    result["server_command"] = shlex.join(["python", *server.cmd[1:]])
    with server:
        server_info, inflight, inflight_outputs = asyncio.run(run_inflight(args, server, prompt_sets, warmup_prompts, args.levels))
    result["server"] = server_info
    result["inflight"] = inflight

    peer = None
    if args.peer:  # the server is stopped: the peer has the machine to itself
        peer, hf_outputs = run_peer(args, model_dir, device, dtype, prompts, args.levels, pad_token_id)
        peer["agreement_with_inflight"] = agreement(inflight_outputs[n], hf_outputs)
    result["peer"] = peer
    result["ratios"], result["acceptance"] = ratios(inflight, peer)
    result["contention_warnings"] = contention_warnings(result)
    for w in result["contention_warnings"]:
        log(f"WARNING: {w}")

    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {out}")
    if args.plot:
        png = out.with_suffix(".png")
        plot(result, png)
        log(f"wrote {png}")
    for name, r in result["ratios"].items():
        if not name.startswith("inflight_"):
            continue
        target = result["acceptance"].get(name)
        log(f"{name} = {r:.2f}" + (f"  (target {target['target']}: {'met' if target['met'] else 'MISSED'})" if target else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
