"""Host cost of the scheduler <-> executor wire format per step, by batch size (CPU).

In the split deployment (``inflight serve``: scheduler and executor processes)
every step's plan and result cross the executor stream as protobuf. This times
the four conversions of a generation step in which every request computes one
token: the scheduler's plan_to_pb + serialize and parse + result_from_pb, the
executor's parse + plan_from_pb and result_to_pb + serialize. The in-process
path (``LLM``, ``--paths inprocess``) passes the dataclasses and pays none of it.

  python bench/wire_cost.py --output bench/results/cpu_wire_cost.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_common import device_info, git_info, log  # noqa: E402


def time_ms(fn, reps: int) -> float:
    """Best of three means over ``reps`` calls, in ms (the machine may be shared)."""
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - started) / reps * 1e3)
    return best


def measure(batch: int, reps: int, tokens_per_block: int = 32) -> dict:
    from executor_svc.wire import plan_from_pb, result_to_pb
    from protos import executor_pb2 as ex
    from protos.plan import CachedRequest, RequestOutput, StepPlan, StepResult
    from scheduler_svc.wire import plan_to_pb, result_from_pb

    # A generation step: one token each, a new block for one request in tokens_per_block.
    plan = StepPlan(step_id=7, cached_requests=[
        CachedRequest(f"req-{i:08d}", 300 + i, 1, [] if i % tokens_per_block else [i]) for i in range(batch)
    ])
    result = StepResult(step_id=7, outputs=[RequestOutput(f"req-{i:08d}", [1000 + i]) for i in range(batch)])
    plan_bytes, result_bytes = plan_to_pb(plan).SerializeToString(), result_to_pb(result).SerializeToString()
    phases = {
        "scheduler_plan_to_bytes": lambda: plan_to_pb(plan).SerializeToString(),
        "executor_bytes_to_plan": lambda: plan_from_pb(ex.StepPlan.FromString(plan_bytes)),
        "executor_result_to_bytes": lambda: result_to_pb(result).SerializeToString(),
        "scheduler_bytes_to_result": lambda: result_from_pb(ex.StepResult.FromString(result_bytes)),
    }
    ms = {name: time_ms(fn, reps) for name, fn in phases.items()}
    return {
        "ms": ms,
        "us_per_request": {name: value * 1e3 / batch for name, value in ms.items()},
        "scheduler_ms": ms["scheduler_plan_to_bytes"] + ms["scheduler_bytes_to_result"],
        "executor_ms": ms["executor_bytes_to_plan"] + ms["executor_result_to_bytes"],
        "bytes": {"plan": len(plan_bytes), "result": len(result_bytes)},
    }


def main(argv: list[str] | None = None) -> int:
    from google.protobuf.internal import api_implementation

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="64,256,1024")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--output", required=True)
    args = p.parse_args(argv)
    result = {
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        "git": git_info(), "system": device_info("cpu"), "protobuf_backend": api_implementation.Type(), "batches": {},
    }
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        result["batches"][str(batch)] = row = measure(batch, args.reps)
        log(f"batch {batch}: scheduler {row['scheduler_ms']:.2f} ms, executor {row['executor_ms']:.2f} ms per step")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
