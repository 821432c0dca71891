"""Where one generation step's time goes on the SmolLM2-135M shape (random weights), through the executor's runner.

Batch 1: milliseconds per step and host time per phase with 0, 4 and 8 drafts to
verify, and with 4 and 8 chained rounds of 8 drafts, then the torch profiler (CPU and CUDA activity) over 50 plain steps and 50
steps verifying 4 drafts: which host calls and kernels the time goes to. Batch 256:
a plain step (a CUDA-graph replay) against one with 16 more verification rows,
past the executor's batch size, where the rows leave the graphs.

  python bench/step_profile.py TOKENIZER_DIR cuda > bench/results/h200_step_profile_smollm2.txt
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from model_shapes import shape_folder  # noqa: E402


def main(tokenizer_dir: str, device: str = "cuda") -> None:
    from executor_svc.build_config import BuildConfig
    from executor_svc.engine_cache import build_cached
    from executor_svc.engine import RuntimeConfig, load_engine
    from executor_svc.runner import ModelRunner
    from executor_svc.speculative.proposer import SpeculativeConfig, SpeculativeMode
    from inflight.model_store import default_cache_dir
    from protos.plan import CachedRequest, NewRequest, SamplingConfig, StepPlan

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    reps, profiled = (100, 50) if device == "cuda" else (3, 2)
    folder = shape_folder("smollm2-135m", default_cache_dir(), tokenizer_dir)
    build = BuildConfig(max_batch_size=256, max_num_tokens=8192, max_seq_len=2048, tokens_per_block=16, dtype="auto")
    engine_dir = build_cached(folder, build, default_cache_dir(), device, "dummy")
    engine = load_engine(engine_dir, RuntimeConfig(device=device, kv_cache_fraction=0.5,
                                                   speculative=SpeculativeConfig(SpeculativeMode.NGRAM, 8, max_rounds=8)))
    runner = ModelRunner(engine)
    gen = torch.Generator().manual_seed(0)
    state = {"step": 0, "next_block": 0}

    def admit(ids: list[str], context: int = 400, room: int = 1200) -> None:
        """Prefill ``ids`` with ``context`` random tokens each, with blocks for ``room`` more."""
        blocks = -(-(context + room) // 16)
        first = state["next_block"]
        state["next_block"] += blocks * len(ids)
        state["step"] += 1
        runner.execute(StepPlan(state["step"], new_requests=[
            NewRequest(rid, torch.randint(1000, 30000, (context,), generator=gen).tolist(), context, 0, context,
                       list(range(first + i * blocks, first + (i + 1) * blocks)), SamplingConfig(temperature=0.0))
            for i, rid in enumerate(ids)
        ]))

    def plan(ids: list[str], k: int, with_drafts: int | None = None) -> StepPlan:
        """Every request computes its next token; the first ``with_drafts`` (all: None) also verify k drafts."""
        state["step"] += 1
        cached = []
        for j, rid in enumerate(ids):
            kk = k if with_drafts is None or j < with_drafts else 0
            drafts = torch.randint(1000, 30000, (kk,), generator=gen).tolist()
            cached.append(CachedRequest(rid, runner.requests[rid].num_computed_tokens, 1 + kk, [], draft_token_ids=drafts))
        return StepPlan(state["step"], cached_requests=cached)

    def chained(ids: list[str], k: int, rounds: int) -> StepPlan:
        """Every request runs ``rounds`` chained rounds of k drafts (random ones: each round emits about one token)."""
        state["step"] += 1
        return StepPlan(state["step"], cached_requests=[
            CachedRequest(rid, runner.requests[rid].num_computed_tokens, rounds * (1 + k), [],
                          draft_token_ids=torch.randint(1000, 30000, (k,), generator=gen).tolist(), num_rounds=rounds)
            for rid in ids
        ])

    def timed(ids: list[str], k: int, count: int, with_drafts: int | None = None, rounds: int = 1) -> tuple[float, dict]:
        make = (lambda: chained(ids, k, rounds)) if rounds > 1 else (lambda: plan(ids, k, with_drafts))
        for _ in range(5):
            runner.execute(make())
        sync()
        before, started = dict(runner.host_seconds), time.perf_counter()
        for _ in range(count):
            runner.execute(make())
        sync()
        ms = (time.perf_counter() - started) / count * 1e3
        return ms, {p: round((runner.host_seconds[p] - before[p]) / count * 1e3, 3) for p in ("launch", "finish", "draft")}

    one = ["a"]
    admit(one)
    for k in (0, 4, 8):
        ms, host = timed(one, k, reps)
        print(f"batch 1 k={k}: {ms:.3f} ms/step, host {host}")
    for k, rounds in ((8, 4), (8, 8)):  # chained rounds, drafted on the device
        ms, host = timed(one, k, max(reps // rounds, 2), rounds=rounds)
        print(f"batch 1 k={k} x {rounds} rounds: {ms:.3f} ms/step = {ms / rounds:.3f} ms/round, host {host}")
    for k, rounds in ((0, 1), (4, 1), (8, 4)):
        steps = max(profiled // rounds, 2)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                runner.execute(plan(one, k) if rounds == 1 else chained(one, k, rounds))
            sync()
        print(f"===== profile batch 1 k={k} x {rounds} rounds ({steps} steps)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=16, max_name_column_width=60))
    state["step"] += 1
    runner.execute(StepPlan(state["step"], finished_request_ids=one))
    full = [f"b{i}" for i in range(256)]
    context = 400 if device == "cuda" else 64  # the CPU's default KV budget holds 256 short requests only
    admit(full[:128], context, room=64)
    admit(full[128:], context, room=64)
    for with_drafts, label in ((0, "256 plain (graph)"), (16, "256 + 16 drafts = 272 rows")):
        ms, host = timed(full, 1, max(reps // 5, 1), with_drafts)  # 5 + 20 steps of at most 2 tokens
        print(f"{label}: {ms:.3f} ms/step, host {host}")


if __name__ == "__main__":
    main(*sys.argv[1:])
