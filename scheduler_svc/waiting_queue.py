"""The queue of requests waiting for admission: higher priority first, then arrival.

A request preempted to make room goes back to the front of its priority, so it
resumes before later arrivals of the same priority.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from scheduler_svc.request import Request


class WaitingQueue:
    """Per-priority FIFOs; the highest non-empty priority is served first."""

    __slots__ = ("_levels", "_size")

    def __init__(self) -> None:
        self._levels: dict[int, deque[Request]] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[Request]:
        """In admission order."""
        for priority in sorted(self._levels, reverse=True):
            yield from self._levels[priority]

    def append(self, request: Request) -> None:
        """A new arrival: behind every request of its priority."""
        self._levels.setdefault(request.priority, deque()).append(request)
        self._size += 1

    def append_front(self, request: Request) -> None:
        """A preempted request: ahead of every request of its priority."""
        self._levels.setdefault(request.priority, deque()).appendleft(request)
        self._size += 1

    def peek(self) -> Request:
        return self._levels[max(self._levels)][0]

    def popleft(self) -> Request:
        priority = max(self._levels)
        level = self._levels[priority]
        request = level.popleft()
        if not level:
            del self._levels[priority]
        self._size -= 1
        return request

    def remove(self, request: Request) -> None:
        level = self._levels[request.priority]
        level.remove(request)
        if not level:
            del self._levels[request.priority]
        self._size -= 1
