"""Programmatic dependent launch (PDL) for the kernels of a decode step.

A batch-1 decode step is about ten kernels per layer, each of them short
(3 to 60 µs on an H200). Launched the ordinary way, a kernel starts only once
the one before it has finished and its writes have been flushed, so every
boundary costs the next kernel's launch and ramp (first loads in flight, SMs
filling up) on top of the previous kernel's tail (its last wave leaving SMs
idle). On Hopper and later, a kernel launched with PDL may start while the
previous one is still running:

* the previous kernel lets it start with ``griddepcontrol.launch_dependents``
  (``enter`` issues it once the program has passed its own wait, so at most one
  kernel ahead is resident and waiting);
* the new kernel does what does not depend on the previous one's results
  (address arithmetic, and in the GEMVs the first tile of weights), then
  ``griddepcontrol.wait``, which returns once the previous kernel has finished
  and its writes are visible.

The rule every kernel here keeps: nothing before ``enter`` reads an activation
or writes anything; weights and other constants may be read, and so may the
step's metadata (positions, cache slots, block tables, context lengths). A
kernel's early part runs only once the kernel before it has passed its own
wait, so every kernel two or more launches back has finished and its writes
are visible; a decode layer's metadata readers (RoPE, attention) come at least
two launches after anything that writes metadata (the host's copies before the
step, or a chained speculative round's bookkeeping before its embedding and
first norm). A kernel launched
without PDL, or one that follows a kernel that never triggers, behaves as
before (the wait returns at once, the trigger is implicit at completion), so
mixing PDL and ordinary kernels on one stream is correct. CUDA graph capture
records the launches as programmatic edges (CUDA 12.3 and later).

``INFLIGHT_PDL=0`` turns it off, for measuring what it gives.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no triton: nothing here is used
    triton = None

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAVE_GDC = True
except ImportError:  # a Triton release without grid dependency control
    HAVE_GDC = False


_forced: bool | None = None  # set by ``forced``: overrides INFLIGHT_PDL (never the hardware check)


@lru_cache(maxsize=None)
def pdl_supported(device: torch.device) -> bool:
    """Whether ``device`` and this Triton can launch with PDL (CUDA, compute capability 9.0 or later)."""
    return device.type == "cuda" and HAVE_GDC and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` are launched with PDL now."""
    wanted = _forced if _forced is not None else os.environ.get("INFLIGHT_PDL", "1") != "0"
    return wanted and pdl_supported(device)


@contextmanager
def forced(enabled: bool) -> Iterator[None]:
    """Launch with PDL on (where supported) or off inside the block, whatever INFLIGHT_PDL says."""
    global _forced
    before, _forced = _forced, enabled
    try:
        yield
    finally:
        _forced = before


def pdl_launch_args(device: torch.device) -> dict:
    """Keyword arguments for a kernel launch: the kernel's ``PDL`` constant, and the launch option with it."""
    return {"PDL": True, "launch_pdl": True} if pdl_enabled(device) else {"PDL": False}


if triton is not None and HAVE_GDC:

    @triton.jit
    def enter(PDL: tl.constexpr):
        """Wait for the previous kernel's results, then let the next kernel start launching."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

elif triton is not None:

    @triton.jit
    def enter(PDL: tl.constexpr):
        """No grid dependency control in this Triton: ``pdl_enabled`` is never true, nothing to do."""
        pass

else:
    enter = None  # no Triton: no kernel here is defined to call it
