"""Shared pieces of the quantization benchmarks: building engines, greedy decoding through
the ModelRunner (no scheduler, no gRPC), perplexity of a loaded engine."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from executor_svc.engine import Engine  # noqa: E402
from executor_svc.runner import ModelRunner  # noqa: E402
from protos.plan import CachedRequest, NewRequest, SamplingConfig, StepPlan  # noqa: E402

# Prompts of the greedy-agreement check: varied kinds, short enough for a CPU run.
AGREEMENT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a land far away,",
    "Here are three tips for writing clear documentation:",
    "Q: What is 12 times 12?\nA:",
    "Translate to French: The cat sits on the mat.",
    "The printing press changed Europe because",
    "A paged KV cache stores keys and values in fixed-size blocks so that",
)


@dataclass(slots=True)
class Request:
    token_ids: list[int]
    block_ids: list[int]


def _requests(prompts: list[list[int]], max_new_tokens: int, tokens_per_block: int, num_blocks: int) -> list[Request]:
    """Disjoint block ranges for each prompt, enough for its prompt and every new token."""
    requests, next_block = [], 0
    for ids in prompts:
        blocks = -(-(len(ids) + max_new_tokens) // tokens_per_block)
        if next_block + blocks > num_blocks:
            raise ValueError(f"the KV cache holds {num_blocks} blocks, the prompts need more; raise its size")
        requests.append(Request(list(ids), list(range(next_block, next_block + blocks))))
        next_block += blocks
    return requests


def greedy_generate(
    engine: Engine, prompts: list[list[int]], max_new_tokens: int, step_times: list[float] | None = None
) -> list[list[int]]:
    """Greedy continuations of all ``prompts`` at once (one context step, then one token per step).

    ``step_times``: when given, receives the seconds of each generation step
    (CUDA events on a GPU, so queued work is counted to its end).
    """
    runner = ModelRunner(engine)
    requests = _requests(prompts, max_new_tokens, engine.tokens_per_block, engine.num_kv_blocks)
    greedy = SamplingConfig(temperature=0.0)
    plan = StepPlan(step_id=0, new_requests=[
        NewRequest(str(i), r.token_ids, len(r.token_ids), 0, len(r.token_ids), r.block_ids, greedy)
        for i, r in enumerate(requests)
    ])
    outputs: list[list[int]] = [[] for _ in prompts]
    computed = [len(r.token_ids) for r in requests]
    for step in range(max_new_tokens):
        timer = _StepTimer(engine.device) if step > 0 and step_times is not None else None
        result = runner.execute(plan)
        if timer is not None:
            step_times.append(timer.elapsed())
        if result.request_errors:
            raise RuntimeError(f"step {step} failed: {result.request_errors}")
        for out in result.outputs:
            outputs[int(out.request_id)].extend(out.token_ids)
        cached = []
        for i in range(len(prompts)):
            cached.append(CachedRequest(str(i), computed[i], 1))
            computed[i] += 1
        plan = StepPlan(step_id=step + 1, cached_requests=cached)
    runner.execute(StepPlan(step_id=max_new_tokens + 1, finished_request_ids=[str(i) for i in range(len(prompts))]))
    return outputs


class _StepTimer:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        if self.device.type == "cuda":
            self.end.record()
            self.end.synchronize()
            return self.start.elapsed_time(self.end) / 1e3
        return time.perf_counter() - self.t0


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    """How far greedy outputs match: tokens before the first divergence, and whole prompts."""
    prefixes = []
    for ref, out in zip(reference, other):
        same = 0
        while same < min(len(ref), len(out)) and ref[same] == out[same]:
            same += 1
        prefixes.append(same)
    total = sum(len(ref) for ref in reference)
    return {
        "prefix_match_fraction": round(sum(prefixes) / total, 4) if total else None,
        "prompts_identical": sum(1 for p, ref in zip(prefixes, reference) if p == len(ref)),
        "num_prompts": len(reference),
        "matching_prefix_per_prompt": prefixes,
    }


def scratch_dir(path: str | None) -> Path:
    return Path(path) if path else Path(tempfile.mkdtemp(prefix="inflight-quant-bench-"))


def environment() -> dict[str, str]:
    """Environment variables that change what or how fast a run computes."""
    names = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")
    return {name: os.environ[name] for name in names if name in os.environ}
