"""Runs step plans in order on one thread, overlapping each step with the next.

Plans arrive from another thread (a gRPC handler, or the offline API's event
loop) and results go back through a callback, in plan order. After launching
step N the pipeline does not wait for it: if plan N+1 arrives while the GPU
still runs N, N+1 is launched first (its inputs prepared and its kernels queued
behind N's), and only then does the pipeline wait for N's sampled ids. The GPU
then goes from N to N+1 without waiting for the host. When no plan arrives
before N completes, N's result goes back at once: overlap never delays a result.
A step whose result the next plan needs (it verifies or proposes drafts) is
finished right after its launch, on this thread.
The pipeline's thread never polls: a waiter thread blocks on each launched
step's CUDA event (releasing the GIL) and posts its completion to the same
inbox that plans arrive in, so whichever comes first wakes the pipeline.

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

class _CompletionWaiter:
    """Blocks on launched steps' device events on its own thread; posts ``(DONE, step)`` to the inbox."""

    def __init__(self, inbox: queue.SimpleQueue, done_marker: object) -> None:
        self._inbox = inbox
        self._done = done_marker
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="inflight-step-waiter", daemon=True)
        self._thread.start()

    def watch(self, step: LaunchedStep) -> None:
        self._todo.put(step)

    def stop(self, timeout: float = 30.0) -> None:
        """Let the thread finish the step it waits on, then end it (a daemon thread still inside torch
        when the interpreter exits aborts the process)."""
        self._todo.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _run(self) -> None:
        while (step := self._todo.get()) is not None:
            try:
                if step.done is not None:
                    step.done.synchronize()  # releases the GIL while the device works
            except Exception:  # noqa: BLE001 - finish() reports the step's failure
                pass
            self._inbox.put((self._done, step))


class StepPipeline:
    _RESET = object()
    _STOP = object()
    _DONE = object()  # (_DONE, step): a launched step's results are on the host

    def __init__(self, runner: ModelRunner, overlap: bool = True) -> None:
        self.runner = runner
        # Only an asynchronous device gains: on the CPU, launching a step computes it, so
        # launching N+1 before finishing N would only hold N's result back by a whole step.
        self.overlap = overlap and runner.device.type == "cuda"
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = threading.Event()
        self._waiter = _CompletionWaiter(self._inbox, self._DONE)

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
        self._waiter.stop()

    # -- on the model's thread ---------------------------------------------------

    def run_forever(self) -> None:
        pending: tuple[LaunchedStep, Deliver] | None = None
        while True:
            plan, deliver = self._inbox.get()
            if plan is self._DONE:
                if pending is not None and deliver is pending[0]:  # the launched step finished before another plan came
                    self._finish(pending)
                    pending = None
                continue  # else: a step already finished in order, when the next plan came first
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
            # Nothing to overlap with: finish it now, waiting on this thread (one thread hand-off less
            # than the waiter's, which a speculating scheduler's one-step-at-a-time loop pays every step).
            if not self.overlap or launched.done is None or self.runner.feeds_next_plan(launched):
                self._finish((launched, deliver))
                continue
            pending = (launched, deliver)
            self._waiter.watch(launched)
        # Nobody will run what is still queued: release whoever waits on it.
        while not self._inbox.empty():
            plan, deliver = self._inbox.get()
            if deliver is not None and plan is not self._DONE:
                deliver(RuntimeError("executor is shutting down"))

    def _finish(self, pending: tuple[LaunchedStep, Deliver]) -> None:
        launched, deliver = pending
        try:
            result: StepResult | BaseException = self.runner.finish(launched)
        except BaseException as exc:  # noqa: BLE001
            result = exc
        deliver(result)
