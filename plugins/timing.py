"""GPU time of kernel calls as a CUDA-graph replay sees it: what build-time choices are timed by."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch

# Rounds of timing every candidate in turn when choosing among several (kernels, GEMV tiles); each keeps its
# fastest round, so a slowdown that lasts a moment (a GPU clocked down while the host compiled a kernel,
# another process) costs a candidate one round, not the choice. One H100 build timed the Triton SwiGLU at
# 10.8 us against its usual 1.5 (torch's at 5.4) in a single pass, and served torch's.
TIMING_ROUNDS = 3


def fastest_in_rounds(
    names: Sequence[str], time_one: Callable[[str], float], skips: Callable[[str, Exception], bool],
) -> tuple[dict[str, float], dict[str, Exception]]:
    """Each of ``names`` timed by ``time_one`` in turn, ``TIMING_ROUNDS`` rounds (one when there is nothing to
    choose between), keeping its fastest: (name -> time, name -> the exception that dropped it). A timing that
    raises drops its name, earlier rounds included, where ``skips(name, exc)`` says so, and raises otherwise."""
    timings: dict[str, float] = {}
    failed: dict[str, Exception] = {}
    for _ in range(TIMING_ROUNDS if len(names) > 1 else 1):
        for name in names:
            if name in failed:
                continue
            try:
                took = time_one(name)
            except Exception as exc:  # noqa: BLE001 - the caller's ``skips`` decides which ones end the choice
                if not skips(name, exc):
                    raise
                failed[name] = exc
                timings.pop(name, None)  # dropped in a later round: not chosen either
                continue
            timings[name] = min(took, timings.get(name, took))
    return timings, failed


def graph_time_us(calls: list[Callable[[], object]], device: torch.device, repeats: int = 10, warmup: int = 2) -> float:
    """GPU time per call of ``calls`` run back to back from one CUDA graph (median of ``repeats`` replays).

    Decode steps run from graphs, so launch overhead is gone and only the kernels and the gaps between
    them count. Give calls that read different copies of a weight, more of them than L2 holds, to time
    what a decode step sees: every weight read from HBM. The first ``warmup`` calls run eagerly first
    (compiling outside the capture). Raises whatever capture raises for a call that cannot be captured.
    """
    for call in calls[:warmup]:
        call()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize(device)
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(samples)
