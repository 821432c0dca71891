"""Garbage-collector settings for a process that runs the step loop or the executor.

Every step allocates many small containers (plans, outputs, per-request
lists) while the process holds a great many long-lived objects: the model's
modules and parameters, the tokenizer, imported libraries, every running
request. With the interpreter's default thresholds the cyclic collector runs
a collection every few hundred net allocations, and now and then a full one
that walks every tracked object, so per request the host time of a step grew
with the batch. With 512 running requests (``bench/results/cpu_host_gc_tiny.json``),
scheduling, applying results and finishing a step took 2.0, 1.7 and 0.8 ms
of CPU per step settled against 5.2, 3.5 and 5.2 ms with the defaults.

Freezing what exists once the engine is loaded moves those objects out of
every later collection, and a larger first-generation threshold makes
collections rarer; reference cycles are still collected.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger("inflight")

# Net allocations between first-generation collections (the interpreter's default is 700).
MIN_GEN0_THRESHOLD = 20_000
_DEFAULT_THRESHOLD = gc.get_threshold()
_engines = 0  # engines in this process that settled the collector and have not released it


def settle_garbage_collector() -> None:
    """Collect once, freeze every object alive now, and make young collections rarer.

    Call when the process's long-lived state is built (engine loaded, tokenizer
    ready), before serving. Process-wide; each engine that calls it calls
    ``release_garbage_collector`` when it goes away (a service never does).
    """
    global _engines
    _engines += 1
    gc.collect()
    gc.freeze()
    gen0, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(max(gen0, MIN_GEN0_THRESHOLD), gen1, gen2)
    log.info("garbage collector: %d objects frozen, thresholds %s", gc.get_freeze_count(), gc.get_threshold())


def release_garbage_collector() -> None:
    """Undo ``settle_garbage_collector`` when an embedded engine shuts down.

    Frozen objects are never collected as cycles: when the last engine of the
    process goes away (the in-process API's ``shutdown``), they go back to the
    collector.
    """
    global _engines
    _engines = max(0, _engines - 1)
    if _engines:
        return
    gc.unfreeze()
    gc.set_threshold(*_DEFAULT_THRESHOLD)
