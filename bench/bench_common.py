"""Shared pieces of the serving benchmark: prompts, statistics, machine facts, CPU accounting."""

from __future__ import annotations

import functools
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np


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


@functools.cache
def git_info() -> dict:
    """Commit and uncommitted-changes flag of the checkout as the run started: the first call is made
    when this module is imported, so a long benchmark does not report commits made while it ran."""

    def run(*cmd: str) -> str:
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()

    # A tree copied to another machine may carry no history, or a stale one: whoever copied it
    # names its commit.
    source = os.environ.get("INFLIGHT_SOURCE_COMMIT")
    if source:
        return {"commit": source, "dirty": None, "note": "a copied tree; its commit as given by INFLIGHT_SOURCE_COMMIT"}
    try:
        return {"commit": run("git", "rev-parse", "HEAD"), "dirty": bool(run("git", "status", "--porcelain"))}
    except Exception as exc:  # not a checkout, or git missing
        return {"commit": None, "dirty": None, "error": str(exc)}


git_info()  # the state the run starts from


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
        try:
            import triton

            from plugins.pdl import pdl_enabled
        except ImportError:  # no Triton: no Triton kernel runs, none with PDL
            info["triton"], info["programmatic_dependent_launch"] = None, False
        else:
            info["triton"] = triton.__version__
            info["programmatic_dependent_launch"] = pdl_enabled(torch.device(device))
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


def measure_copy_bandwidth(device: str, gib: float = 4.0) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted, as memory traffic)."""
    import torch

    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    reps = 10
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / reps
    del src, dst
    return 2 * n * 2 / seconds


def time_us(fn, device, warmup: int, repeats: int, before_each=None) -> float:
    """Median time of one call in microseconds: CUDA events on a GPU, wall clock on the CPU.

    ``before_each`` runs before every timed call, outside the events on a GPU (e.g. to evict
    the previous call's data from L2 so each call reads from memory as a real step does).
    """
    import torch

    for _ in range(warmup):
        fn()
    samples = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
        for start, end in events:
            if before_each is not None:
                before_each()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        samples = [start.elapsed_time(end) * 1e3 for start, end in events]
    else:
        for _ in range(repeats):
            if before_each is not None:
                before_each()
            begin = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - begin) * 1e6)
    return float(np.median(samples))


def kernel_rows(prof, per: int, top: int = 30) -> list[dict]:
    """Device time by kernel from a finished torch profiler ``prof``, divided by ``per`` (the steps or forwards
    it ran): ``[{"kernel", "calls", "us"}]``, longest first, the first ``top``. aten ops and CUDA runtime calls
    are left out (an aten op repeats its kernels' time)."""
    rows = []
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(event, "self_cuda_time_total", 0)
        if device_us <= 0 or event.key.startswith(("aten::", "cuda")):
            continue
        rows.append({"kernel": event.key[:120], "calls": round(event.count / per, 2), "us": round(device_us / per, 2)})
    rows.sort(key=lambda r: -r["us"])
    return rows[:top]


def write_report(script: str, argv: list[str] | None, device: str, output: Path, payload: dict) -> None:
    """The JSON result: command, commit, date and machine first, then ``payload``."""
    import datetime as dt
    import shlex

    result = {
        "command": shlex.join(sys.argv if argv is None else [script, *argv]),
        "git": git_info(), "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": device_info(device), **payload,
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {output}", file=sys.stderr)
