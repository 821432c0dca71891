"""``inflight cache``: list the engines built on the fly, or trim them.

    inflight cache                  each engine: size, last use; the total against the budget
    inflight cache prune            trim to INFLIGHT_ENGINE_CACHE_GB now, as the next build would
    inflight cache prune --max-gb 5
    inflight cache prune --all      every engine not looked up in the last minute

Model conversions (the folders next to ``engines/``) are not touched: they are the
checkpoints engines are built from.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from executor_svc.engine_cache import (
    BUDGET_ENV, RECENT_USE_SECONDS, cached_engines, engine_cache_budget, prune_engine_cache,
)
from executor_svc.engine_file import EngineMismatchError, read_manifest
from inflight.model_store import default_cache_dir


def add_cache_parser(sub: argparse._SubParsersAction) -> None:
    cache = sub.add_parser("cache", help="list or trim the engines built on the fly")
    cache.add_argument("action", nargs="?", default="list", choices=["list", "prune"])
    cache.add_argument("--cache-dir", default=None,
                       help="cache root (default: INFLIGHT_CACHE, else ~/.cache/inflight)")
    limit = cache.add_mutually_exclusive_group()
    limit.add_argument("--max-gb", type=float, default=None,
                       help=f"prune: GiB to keep (default: {BUDGET_ENV}, else 20)")
    limit.add_argument("--all", action="store_true", help="prune: every engine not looked up in the last minute")


def run_cache(args: argparse.Namespace) -> int:
    root = Path(args.cache_dir).expanduser() if args.cache_dir else default_cache_dir()
    engines_root = root / "engines"
    try:
        budget = engine_cache_budget()
    except ValueError as exc:
        raise SystemExit(f"inflight cache: {exc}") from None
    if args.action == "prune":
        if args.max_gb is not None and not (math.isfinite(args.max_gb) and args.max_gb >= 0):
            raise SystemExit(f"inflight cache: --max-gb must be a finite number of GiB, 0 or more, got {args.max_gb}")
        keep_bytes = 0 if args.all else budget if args.max_gb is None else int(args.max_gb * 2**30)
        removed = prune_engine_cache(engines_root, keep_bytes)
        for path in removed:
            print(f"removed {path}")
        left = cached_engines(engines_root)
        print(f"{len(removed)} engine(s) removed; {len(left)} left, {_gib(sum(e.size_bytes for e in left))}")
        return 0
    engines = cached_engines(engines_root)
    now = time.time()
    for engine in reversed(engines):  # most recently used first
        print(f"{_gib(engine.size_bytes):>10}  {_ago(now - engine.last_used):>16}  {engine.path.name}  "
              f"{_what(engine.path)}")
    total = sum(e.size_bytes for e in engines)
    print(f"{len(engines)} engine(s) in {engines_root}: {_gib(total)} of a {_gib(budget)} budget ({BUDGET_ENV}); "
          f"engines looked up within {RECENT_USE_SECONDS:.0f} s are never removed")
    return 0


def _what(engine_dir: Path) -> str:
    """The engine's dtype, quantization, limits and device, or why its manifest cannot be read."""
    try:
        manifest = read_manifest(engine_dir)
    except (EngineMismatchError, ValueError, KeyError, TypeError) as exc:  # another version's format
        return f"(unreadable here: {str(exc).splitlines()[0][:80]})"
    build = manifest.build_config
    quant = build.quant_config.describe()
    weights = manifest.dtype + (f", {quant}" if quant != "none" else "")
    if manifest.load_format == "dummy":
        weights += ", random weights"
    return (f"{weights}, batch {build.max_batch_size}, {manifest.max_seq_len} tokens, "
            f"on {manifest.device.describe()}")


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"


def _ago(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    for unit, span in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= span:
            return f"used {seconds / span:.0f} {unit} ago"
    return f"used {seconds:.0f} s ago"
