"""The cache of engines built on the fly: ``<cache>/engines/<checkpoint>-<key>/``.

``inflight serve --model NAME`` and the Python API build an engine the first time a
checkpoint, build config, device and engine code meet, and reuse it after. The key
covers everything the engine depends on, so an upgrade or a changed build setting
gets a new folder rather than a stale engine; the folders it leaves behind are
never read again. The cache is therefore bounded: once the engines in it add up to
more than ``INFLIGHT_ENGINE_CACHE_GB`` (default 20 GiB), the least recently used
ones are removed, as ccache or pip do with their caches. The engine asked for, and
any looked up within the last minute (another server may be loading it), stay. A
server that has loaded an engine does not read its folder again, so removing it
costs only a rebuild at that server's next start.
Servers that ask for the same engine at once (several executors on one cache
volume) build it once: the others wait on a lock file beside it, then reuse it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from executor_svc.build_config import BuildConfig
from executor_svc.builder import build_engine
from executor_svc.engine import resolve_device
from executor_svc.engine_file import DeviceSignature, is_engine_dir

log = logging.getLogger("inflight.build")

# The packages whose code decides what a build writes: the model, its kernels and their tactics,
# quantization, the KV-cache layout.
ENGINE_CODE_PACKAGES = ("executor_svc", "plugins", "kvcache")

BUDGET_ENV = "INFLIGHT_ENGINE_CACHE_GB"
DEFAULT_BUDGET_GB = 20.0
# An engine looked up this recently may be loading in another process: never removed.
RECENT_USE_SECONDS = 60.0
# A build stages its folder as ".<name>.XXXX" beside the target; one this old was left by a build that died.
STALE_STAGING_SECONDS = 24 * 3600.0


@lru_cache(maxsize=1)
def engine_code_fingerprint() -> str:
    """Short hash of the source of ``ENGINE_CODE_PACKAGES``: an engine cached by other code (an upgrade,
    a local change) is rebuilt rather than served with that code's kernel choices and tactics."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for package in ENGINE_CODE_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(path.relative_to(root).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def engine_cache_key(checkpoint: Path, build: BuildConfig, device: str, load_format: str) -> str:
    """Short hash of what an engine depends on: the checkpoint, the build, the device, the code that builds it."""
    target = resolve_device(device)
    files = sorted((p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in checkpoint.iterdir() if p.is_file())
    calib = Path(build.quant_config.calib_data)
    if build.quant_config.calib_data and calib.is_file():  # the file's content, not just its name, shapes the engine
        files.append((str(calib.resolve()), calib.stat().st_size, int(calib.stat().st_mtime)))
    payload = json.dumps(
        [str(checkpoint.resolve()), files, build.to_dict(), DeviceSignature.of(target).describe(), load_format,
         torch.__version__, engine_code_fingerprint()], sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def engine_cache_budget() -> int:
    """Bytes the cached engines may take (``INFLIGHT_ENGINE_CACHE_GB``, in GiB; default 20)."""
    raw = os.environ.get(BUDGET_ENV, "").strip()
    if not raw:
        return int(DEFAULT_BUDGET_GB * 2**30)
    try:
        gib = float(raw)
    except ValueError:
        gib = math.nan
    if not (math.isfinite(gib) and gib >= 0):
        raise ValueError(f"{BUDGET_ENV} must be a finite number of GiB, 0 or more, got {raw!r}")
    return int(gib * 2**30)


def build_cached(
    checkpoint: Path, build: BuildConfig, cache_root: Path, device: str = "auto", load_format: str = "auto",
    progress: bool = True,
) -> Path:
    """The engine folder for ``checkpoint``, built on the first call and reused after.

    Each call marks the engine as used and then trims the cache to its budget (``prune_engine_cache``).
    """
    build.validate()  # bad settings fail before any lookup, lock or log of a build
    budget = engine_cache_budget()
    key = engine_cache_key(checkpoint, build, device, load_format)
    engine_dir = cache_root / "engines" / f"{checkpoint.name}-{key}"
    _mark_used(engine_dir)  # before the check, so that another process trimming the cache now keeps it
    if is_engine_dir(engine_dir):
        log.info("using cached engine %s", engine_dir)
    else:
        with _build_lock(engine_dir):
            if is_engine_dir(engine_dir):
                log.info("using %s, which another process built while this one waited", engine_dir)
            else:
                log.info("building an engine for %s (cached at %s)", checkpoint, engine_dir)
                build_engine(checkpoint, engine_dir, build, device, load_format, progress)
        _mark_used(engine_dir)
    prune_engine_cache(engine_dir.parent, budget, keep=engine_dir)
    return engine_dir


@contextmanager
def _build_lock(engine_dir: Path) -> Iterator[None]:
    """Held while one process builds ``engine_dir``; another process asking for the same engine waits here."""
    engine_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(_lock_path(engine_dir), "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is building %s; waiting for it", engine_dir)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _lock_path(engine_dir: Path) -> Path:
    return engine_dir.parent / f".{engine_dir.name}.lock"


@dataclass(frozen=True)
class CachedEngine:
    path: Path
    size_bytes: int
    last_used: float  # seconds since the epoch


def cached_engines(engines_root: Path) -> list[CachedEngine]:
    """The engines under ``engines_root``, least recently used first."""
    engines = [
        CachedEngine(child, _folder_bytes(child), _last_used(child))
        for child in _children(engines_root) if not child.name.startswith(".") and is_engine_dir(child)
    ]
    return sorted(engines, key=lambda e: (e.last_used, e.path))


def prune_engine_cache(engines_root: Path, budget_bytes: int, keep: Path | None = None) -> list[Path]:
    """Remove the least recently used engines under ``engines_root`` until the engines there take at most
    ``budget_bytes``; returns the folders removed.

    ``keep`` (the engine just asked for) and engines used in the last ``RECENT_USE_SECONDS`` stay even when
    the cache is then still over its budget. Staging folders of builds that died are removed once stale.
    """
    now = time.time()
    _remove_dead_builds(engines_root, now)
    engines = cached_engines(engines_root)
    total = sum(e.size_bytes for e in engines)
    removed = []
    for engine in engines:
        if total <= budget_bytes:
            break
        if engine.path == keep or now - engine.last_used < RECENT_USE_SECONDS:
            continue
        log.info(
            "engine cache over its %.1f GiB budget (%s): removing the least recently used engine %s (%.2f GiB)",
            budget_bytes / 2**30, BUDGET_ENV, engine.path, engine.size_bytes / 2**30,
        )
        shutil.rmtree(engine.path, ignore_errors=True)
        if not engine.path.exists():
            _lock_path(engine.path).unlink(missing_ok=True)  # nobody builds an engine that existed a minute ago
            total -= engine.size_bytes
            removed.append(engine.path)
    return removed


def _remove_dead_builds(engines_root: Path, now: float) -> None:
    for child in _children(engines_root):
        if child.name.startswith(".") and now - _last_used(child) > STALE_STAGING_SECONDS:
            log.info("removing %s, left by an engine build that did not finish", child)
            shutil.rmtree(child, ignore_errors=True)


def _children(folder: Path) -> list[Path]:
    try:
        return [child for child in folder.iterdir() if child.is_dir() and not child.is_symlink()]
    except FileNotFoundError:
        return []


def _mark_used(engine_dir: Path) -> None:
    """An engine's last use is its folder's modification time (a build's rename sets it at creation)."""
    try:
        os.utime(engine_dir)
    except OSError:  # a read-only cache (a mounted volume) is served as it is and never trimmed by its readers
        pass


def _last_used(engine_dir: Path) -> float:
    try:
        return engine_dir.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _folder_bytes(folder: Path) -> int:
    total = 0
    for path in folder.rglob("*"):
        try:
            if path.is_file() and not path.is_symlink():
                total += path.stat().st_size
        except FileNotFoundError:  # removed under us by another process's prune
            pass
    return total
