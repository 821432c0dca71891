"""Runs step plans in order on one thread, overlapping each step with the next.

Plans arrive from another thread (a gRPC handler, or the offline API's event
loop) and results go back through a callback, in plan order. After launching
step N the pipeline does not wait for it: if plan N+1 arrives while the GPU
still runs N, N+1 is launched first (its inputs prepared and its kernels queued
behind N's), and only then does the pipeline wait for N's sampled ids. The GPU
then goes from N to N+1 without waiting for the host. When no plan arrives
before N completes, N's result goes back at once: overlap never delays a result.

The model runs on the thread that calls ``run_forever``: for the executor
process that is its main thread, because torch's CPU kernels measurably lose
parallelism when called from a worker thread.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent import futures
from typing import Union

from executor_svc.runner import LaunchedStep, ModelRunner
from protos.plan import StepPlan, StepResult

log = logging.getLogger("inflight.executor")

Deliver = Callable[[Union[StepResult, BaseException]], None]

# How long to wait for the next plan at a time while a launched step is running.
_POLL_S = 0.0002


class StepPipeline:
    _RESET = object()
    _STOP = object()

    def __init__(self, runner: ModelRunner, overlap: bool = True) -> None:
        self.runner = runner
        # Only an asynchronous device gains: on the CPU, launching a step computes it, so
        # launching N+1 before finishing N would only hold N's result back by a whole step.
        self.overlap = overlap and runner.device.type == "cuda"
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = threading.Event()

    # -- from other threads ------------------------------------------------------

    def submit(self, plan: StepPlan, deliver: Deliver) -> None:
        """Queue ``plan``; ``deliver`` is called (on the pipeline's thread) with its result."""
        if self._stopped.is_set():
            deliver(RuntimeError("executor is shutting down"))
            return
        self._inbox.put((plan, deliver))

    def execute(self, plan: StepPlan) -> StepResult:
        """Submit and wait: one plan at a time, no overlap (for simple callers)."""
        done: futures.Future = futures.Future()
        self.submit(plan, lambda r: done.set_exception(r) if isinstance(r, BaseException) else done.set_result(r))
        return done.result()

    def reset(self) -> None:
        """After every submitted plan, forget all requests; returns when done."""
        if self._stopped.is_set():
            return
        done: futures.Future = futures.Future()
        self._inbox.put((self._RESET, lambda r: done.set_result(r)))
        done.result()

    def stop(self) -> None:
        self._stopped.set()
        self._inbox.put((self._STOP, None))

    # -- on the model's thread ---------------------------------------------------

    def run_forever(self) -> None:
        pending: tuple[LaunchedStep, Deliver] | None = None
        while True:
            item = self._next(pending)
            if item is None:  # the launched step finished before another plan came
                self._finish(pending)
                pending = None
                continue
            plan, deliver = item
            if plan is self._STOP or plan is self._RESET:
                if pending is not None:
                    self._finish(pending)
                    pending = None
                if plan is self._STOP:
                    break
                self.runner.reset()
                deliver(None)
                continue
            if pending is not None and (not self.overlap or self.runner.needs_host_history(plan)):
                self._finish(pending)
                pending = None
            try:
                launched = self.runner.launch(plan)
            except BaseException as exc:  # noqa: BLE001 - the caller gets it
                if pending is not None:
                    self._finish(pending)
                    pending = None
                deliver(exc)
                continue
            if pending is not None:
                self._finish(pending)
            pending = (launched, deliver)
        # Nobody will run what is still queued: release whoever waits on it.
        while not self._inbox.empty():
            plan, deliver = self._inbox.get()
            if deliver is not None:
                deliver(RuntimeError("executor is shutting down"))

    def _next(self, pending: tuple[LaunchedStep, Deliver] | None):
        """The next queued item; None when ``pending`` completed first."""
        if pending is None:
            return self._inbox.get()
        while True:
            try:
                return self._inbox.get(timeout=_POLL_S)
            except queue.Empty:
                if pending[0].is_done():
                    return None

    def _finish(self, pending: tuple[LaunchedStep, Deliver]) -> None:
        launched, deliver = pending
        try:
            result: StepResult | BaseException = self.runner.finish(launched)
        except BaseException as exc:  # noqa: BLE001
            result = exc
        deliver(result)
