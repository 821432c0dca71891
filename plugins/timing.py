"""GPU time of kernel calls as a CUDA-graph replay sees it: what build-time choices are timed by."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

# Rounds of timing every candidate in turn when choosing among several (kernels, GEMV tiles); each keeps its
# fastest round, so a slowdown that lasts a moment (a GPU clocked down while the host compiled a kernel,
# another process) costs a candidate one round, not the choice. One H100 build timed the Triton SwiGLU at
# 10.8 us against its usual 1.5 (torch's at 5.4) in a single pass, and served torch's.
TIMING_ROUNDS = 3


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
