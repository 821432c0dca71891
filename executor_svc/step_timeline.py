"""How busy the GPU is across steps, measured with CUDA events.

Each step records an event before its first copy or launch and one after its
last launch. Both execute on the GPU's own timeline, so ``end - start`` is the
GPU time the step took and ``start - previous end`` is the time the GPU sat
idle between two steps, waiting for the host (scheduling, gRPC, input
preparation). Reading them needs no extra synchronisation: the step already
waits for its sampled token ids, after which both events are complete.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class StepTiming:
    num_requests: int
    num_tokens: int
    busy_us: float  # GPU time from the step's first to its last operation
    idle_before_us: float  # GPU idle since the previous step ended (0 for the first step)


class StepTimeline:
    """Recent steps' GPU busy and idle times (CUDA only)."""

    def __init__(self, device: torch.device, keep: int = 100_000) -> None:
        self.device = device
        self.steps: deque[StepTiming] = deque(maxlen=keep)
        self._start: torch.cuda.Event | None = None
        self._end: torch.cuda.Event | None = None
        self._previous_end: torch.cuda.Event | None = None

    def begin(self) -> None:
        self._start = torch.cuda.Event(enable_timing=True)
        self._start.record(torch.cuda.current_stream(self.device))

    def end(self) -> None:
        self._end = torch.cuda.Event(enable_timing=True)
        self._end.record(torch.cuda.current_stream(self.device))

    def collect(self, num_requests: int, num_tokens: int) -> StepTiming | None:
        """Call after the step's results reached the host: both events are done."""
        if self._start is None or self._end is None:
            return None
        idle = self._previous_end.elapsed_time(self._start) * 1e3 if self._previous_end is not None else 0.0
        timing = StepTiming(num_requests, num_tokens, self._start.elapsed_time(self._end) * 1e3, max(idle, 0.0))
        self.steps.append(timing)
        self._previous_end, self._start, self._end = self._end, None, None
        return timing

    def discard(self) -> None:
        """Drop the current step's events unread (reading them would wait for the GPU)."""
        self._start = self._end = self._previous_end = None

    def summary(self, min_requests: int = 1) -> dict:
        """Busy/idle totals over recorded steps with at least ``min_requests`` requests."""
        chosen = [s for s in self.steps if s.num_requests >= min_requests]
        busy = sum(s.busy_us for s in chosen)
        idle = sum(s.idle_before_us for s in chosen)
        return {
            "steps": len(chosen),
            "busy_ms": busy / 1e3,
            "idle_ms": idle / 1e3,
            "idle_fraction": idle / (busy + idle) if busy + idle else None,
            "mean_step_ms": busy / len(chosen) / 1e3 if chosen else None,
        }
