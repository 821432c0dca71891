"""Per-shape tile choices ("tactics") of the decode GEMVs: timed at build, recorded, installed at load.

A batch-1 GEMV is a read of its weight, and which tile streams a given
(N, K) weight fastest depends on the shape (how many output tiles there are
to spread over the SMs, how long K is) in ways a heuristic gets wrong by 5 to
15%. So, like a GEMM library's heuristic cache, the build times each
candidate tile on each of the model's weight shapes, keeps the fastest per
shape in the engine (``plugins.<kind>.tactics``), and a load installs it
again. One table per weight format ("dense" for 16-bit weights, "fp8"),
process-wide, because a weight's shape is all the kernel is called with.
Shapes not in the table run the format's default tile.

A format may also be timed at more rows than one (the 16-bit GEMM at two
rows, a verification of one draft, and at sixteen, the class of 3 to 16
rows): those entries are keyed ``NxK@rows``, and a row count without an
entry is the caller's to route.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

import torch

from plugins.timing import fastest_in_rounds, graph_time_us

log = logging.getLogger("inflight.build")

TUNE_BYTES = 256 << 20  # weight copies a shape is timed over: well past an H200's 60 MB of L2

_tables: dict[str, dict[tuple[int, int, int], str]] = {}


def shape_key(n: int, k: int, rows: int = 1) -> str:
    return f"{n}x{k}" if rows == 1 else f"{n}x{k}@{rows}"


def _parse_key(key: str) -> tuple[int, int, int]:
    shape, _, rows = key.partition("@")
    n, k = (int(v) for v in shape.split("x"))
    return n, k, int(rows) if rows else 1


def install(fmt: str, tactics: dict[str, str], known: Iterable[str]) -> None:
    """Install ``shape_key`` -> tactic name for weights of format ``fmt``; names must be in ``known``."""
    known = list(known)
    parsed = {}
    for key, name in tactics.items():
        if name not in known:
            raise ValueError(f"unknown {fmt} GEMV tactic {name!r} for {key}; known: {known}")
        parsed[_parse_key(key)] = name
    _tables.setdefault(fmt, {}).update(parsed)


def lookup(fmt: str, n: int, k: int, rows: int = 1) -> str | None:
    """The tactic installed for ``rows`` rows times an (N, K) weight of format ``fmt``, or None."""
    return _tables.get(fmt, {}).get((n, k, rows))


def tune(
    fmt: str, shapes: Iterable[tuple[int, int]], device: torch.device, bytes_per_weight: float,
    make_weight: Callable[[int, int, torch.Generator], tuple], make_x: Callable[[int, torch.Generator], torch.Tensor],
    candidates: dict[str, Callable[..., torch.Tensor]], rows: Sequence[int] = (1,),
) -> dict[str, dict]:
    """Time every candidate at each of ``rows`` rows on each (N, K) shape (``fastest_in_rounds``: in turn,
    each keeping its fastest); install the fastest per shape and row count and return ``shape_key`` ->
    {"tactic": the fastest, "timings_us": {name: microseconds}}.

    ``make_weight(n, k, generator)`` gives the weight's arguments as the candidates take them after x;
    ``make_x(k, generator)`` one row of x; ``candidates[name](x, *weight)`` runs one. A candidate that
    raises (a tile this GPU cannot compile) is skipped, and named under the entry's "failed".
    """
    gen = torch.Generator(device=device).manual_seed(0)
    report = {}
    for n, k in dict.fromkeys(shapes):
        copies = max(1, -(-TUNE_BYTES // int(bytes_per_weight * n * k)))
        weights = [make_weight(n, k, gen) for _ in range(copies)]
        reps = max(1, 8 // copies)  # at least 8 calls a graph
        for count in rows:
            x = torch.cat([make_x(k, gen) for _ in range(count)])
            timings, errors = fastest_in_rounds(  # any error: a tile this GPU cannot compile (too much shared memory)
                list(candidates),
                lambda name, copies=weights: graph_time_us(
                    [lambda w=w, run=candidates[name]: run(x, *w) for w in copies] * reps, device),
                skips=lambda name, exc: True,
            )
            failed = {name: f"{type(exc).__name__}: {exc}"[:300] for name, exc in errors.items()}
            for name, why in failed.items():
                log.warning("%s GEMV tactic %s failed on %s: %s", fmt, name, shape_key(n, k, count), why)
            if not timings:
                raise RuntimeError(f"no {fmt} GEMV candidate ran on {shape_key(n, k, count)}: {failed}")
            best = min(timings, key=timings.__getitem__)
            entry = {"tactic": best, "timings_us": {name: round(t, 2) for name, t in timings.items()}}
            if failed:
                entry["failed"] = failed
            report[shape_key(n, k, count)] = entry
        del weights
    install(fmt, {key: entry["tactic"] for key, entry in report.items()}, candidates)
    return report
