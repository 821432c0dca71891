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
    """Recent steps' GPU busy and idle times (CUDA only).

    A step calls ``mark`` before its first operation and after its last, and
    ``collect`` with both marks once its results are on the host. Steps may be
    launched before the previous one is collected (overlapped execution); the
    idle time is then measured against the previous step's end, which comes
    first on the GPU's single stream.
    """

    def __init__(self, device: torch.device, keep: int = 100_000) -> None:
        self.device = device
        self.steps: deque[StepTiming] = deque(maxlen=keep)
        self._previous_end: torch.cuda.Event | None = None

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def collect(self, start: torch.cuda.Event, end: torch.cuda.Event, num_requests: int, num_tokens: int) -> StepTiming:
        """Call once the step's results reached the host. ``end`` may be recorded after the event the host
        waited on (a step queues a copy or two after its results); the wait for it is then that short."""
        end.synchronize()  # elapsed_time raises on an event still pending, and that took a server down
        # Negative when this step was queued before the previous one finished: no idle time.
        idle = self._previous_end.elapsed_time(start) * 1e3 if self._previous_end is not None else 0.0
        timing = StepTiming(num_requests, num_tokens, start.elapsed_time(end) * 1e3, max(idle, 0.0))
        self.steps.append(timing)
        self._previous_end = end
        return timing

    def discard(self) -> None:
        """A step whose marks are not read (it never waited for the GPU): the next gap is unknown."""
        self._previous_end = None

    def summary(self, min_requests: int = 1) -> dict:
        """Busy/idle totals over recorded steps with at least ``min_requests`` requests."""
        return summarize([s for s in self.steps if s.num_requests >= min_requests])

    def by_kind(self) -> dict[str, dict]:
        """``summary`` of the steps where every request computed one token (plain decoding) and of
        the others (prompt tokens, or drafts to verify): where the idle time sits."""
        return {
            "one_token_per_request": summarize([s for s in self.steps if s.num_tokens <= s.num_requests]),
            "more_tokens": summarize([s for s in self.steps if s.num_tokens > s.num_requests]),
        }

    def trace(self) -> list[list[int]]:
        """Every recorded step in order: [requests, tokens, busy us, idle us before it]."""
        return [[s.num_requests, s.num_tokens, round(s.busy_us), round(s.idle_before_us)] for s in self.steps]


def summarize(steps: list[StepTiming]) -> dict:
    """Busy/idle totals of ``steps`` (milliseconds), the idle share and the mean step."""
    busy = sum(s.busy_us for s in steps)
    idle = sum(s.idle_before_us for s in steps)
    return {
        "steps": len(steps),
        "busy_ms": busy / 1e3,
        "idle_ms": idle / 1e3,
        "idle_fraction": idle / (busy + idle) if busy + idle else None,
        "mean_step_ms": busy / len(steps) / 1e3 if steps else None,
    }
