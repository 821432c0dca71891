"""Engine folders: round trip, device and version checks, loud plugin fallback, inspect."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from executor_svc.build_config import BuildConfig, BuildConfigError, QuantConfig
from executor_svc.builder import build_engine
from executor_svc.engine_cache import build_cached, prune_engine_cache
from executor_svc.engine import RuntimeConfig, load_engine
from executor_svc.engine_file import MANIFEST_NAME, EngineMismatchError, is_engine_dir, read_manifest
from executor_svc.kernel_selection import PluginUnavailableError, choose
from plugins.registry import KernelSpec


def _edit_manifest(engine_dir, tmp_path, **changes):
    copy = tmp_path / "edited"
    shutil.copytree(engine_dir, copy)
    data = json.loads((copy / MANIFEST_NAME).read_text())
    for key, value in changes.items():
        data[key] = value
    (copy / MANIFEST_NAME).write_text(json.dumps(data))
    return copy


def test_manifest_records_build(engine_dir):
    manifest = read_manifest(engine_dir)
    assert manifest.dtype == "float32" and manifest.max_seq_len == 2048
    assert manifest.build_config.tokens_per_block == 16
    assert set(manifest.plugins) == {"attention", "rmsnorm", "rope", "activation", "gemm", "argmax"}
    assert all(c.timings_us[c.name] > 0 for c in manifest.plugins.values())
    assert manifest.versions["torch"] == torch.__version__
    assert (engine_dir / "rank0.safetensors").exists() and (engine_dir / "tokenizer.json").exists()
    assert manifest.quantization is None  # built without quantization or --validate: nothing to record


def test_gpu_engine_refused_on_cpu(engine_dir, tmp_path):
    edited = _edit_manifest(engine_dir, tmp_path, device={"type": "cuda", "name": "NVIDIA H200", "compute_capability": [9, 0]})
    with pytest.raises(EngineMismatchError, match=r"built for NVIDIA H200 \(compute capability 9.0\).*inflight build"):
        load_engine(edited, RuntimeConfig(device="cpu"))


def test_other_format_version_refused(engine_dir, tmp_path):
    edited = _edit_manifest(engine_dir, tmp_path, format_version=99)
    with pytest.raises(EngineMismatchError, match="version 99.*Rebuild"):
        load_engine(edited)


def test_invalid_build_configs_are_rejected():
    for bad, field in [
        (BuildConfig(max_batch_size=0), "max_batch_size"),
        (BuildConfig(max_num_tokens=16, tokens_per_block=32), "max_num_tokens"),
        (BuildConfig(tp_size=2), "tp_size"),
        (BuildConfig(plugin_config={"softmax": "torch"}), "unknown plugin kinds"),
        (BuildConfig(dtype="float8"), "dtype"),
        (BuildConfig(quant_config=QuantConfig("INT2")), "quant_algo"),
        (BuildConfig(quant_config=QuantConfig(kv_cache_quant_algo="FP4")), "kv_cache_quant_algo"),
    ]:
        with pytest.raises(BuildConfigError, match=field):
            bad.validate()


def _rmsnorm_candidates() -> list[KernelSpec]:
    from plugins import list_kernels

    return [spec for spec in list_kernels() if spec.kind == "rmsnorm"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal of a CUDA-only kernel")
def test_requested_plugin_that_cannot_run_fails_or_falls_back_loudly(caplog):
    pytest.importorskip("triton")
    args = lambda: (torch.randn(4, 8), torch.ones(8), 1e-5)  # noqa: E731
    cpu = torch.device("cpu")
    with pytest.raises(PluginUnavailableError, match="'triton' cannot run on cpu.*--allow-fallback"):
        choose("rmsnorm", "triton", _rmsnorm_candidates(), cpu, torch.float32, args, allow_fallback=False)
    with caplog.at_level("WARNING"):
        choice = choose("rmsnorm", "triton", _rmsnorm_candidates(), cpu, torch.float32, args, allow_fallback=True)
    assert choice.fallback and choice.name == "torch" and "triton" in choice.note
    assert "FALLBACK" in caplog.text


def test_auto_picks_the_fastest_runnable_candidate():
    import time

    from plugins.norm_torch import rms_norm

    def slow_rms_norm(*args):
        time.sleep(0.002)
        return rms_norm(*args)

    # A correct but deliberately slow candidate next to the registered ones.
    candidates = [*_rmsnorm_candidates(), KernelSpec("rmsnorm", "slow", slow_rms_norm)]
    args = lambda: (torch.randn(4, 8), torch.ones(8), 1e-5)  # noqa: E731
    choice = choose("rmsnorm", "auto", candidates, torch.device("cpu"), torch.float32, args, allow_fallback=False)
    assert choice.name == "torch" and "slow" in choice.timings_us and "triton" not in choice.timings_us


def test_auto_choice_keeps_each_candidates_fastest_round(monkeypatch):
    """One slow timing (a GPU clocked down while the host compiled the kernel) no longer decides the choice."""
    import executor_svc.kernel_selection as selection
    from plugins.timing import TIMING_ROUNDS

    def fast(*args):
        return None

    def steady(*args):
        return None

    rounds = {fast: iter([10.8, 1.5, 1.6]), steady: iter([5.4, 5.3, 5.5])}
    calls = []

    def timed(fn, args, device):
        calls.append(fn)
        return next(rounds[fn])

    monkeypatch.setattr(selection, "time_kernel", timed)
    candidates = [KernelSpec("activation", "torch", steady), KernelSpec("activation", "triton", fast)]
    choice = choose("activation", "auto", candidates, torch.device("cpu"), torch.float32, lambda: (), False)
    assert choice.name == "triton" and choice.timings_us == {"torch": 5.3, "triton": 1.5}
    assert calls == [steady, fast] * TIMING_ROUNDS  # in turn, round after round
    calls.clear()
    rounds[steady] = iter([5.4])
    alone = choose("activation", "auto", candidates[:1], torch.device("cpu"), torch.float32, lambda: (), False)
    assert alone.name == "torch" and calls == [steady]  # nothing to choose between: timed once


def test_cli_build_errors_and_inspect(model_dir, engine_dir, tmp_path):
    run = lambda *a: subprocess.run([sys.executable, "-m", "inflight", *a], capture_output=True, text=True, timeout=300)  # noqa: E731
    bad = run("build", "--model", str(model_dir), "--output", str(tmp_path / "e"), "--device", "cpu", "--plugin", "attention=nope")
    assert bad.returncode == 2 and "no attention plugin named 'nope'" in bad.stderr
    if not torch.cuda.is_available():
        gpu_only = run("build", "--model", str(model_dir), "--output", str(tmp_path / "e"), "--device", "cpu", "--plugin", "rmsnorm=triton")
        assert gpu_only.returncode == 2 and "cannot run on cpu" in gpu_only.stderr and not (tmp_path / "e").exists()
    info = run("inspect", str(engine_dir), "--layer-info")
    assert info.returncode == 0
    chosen = read_manifest(engine_dir).plugins["attention"].name  # triton on a GPU, torch on the CPU
    assert "layers.29.attention" in info.stdout and f"[Plugin] attention ({chosen}, float32)" in info.stdout
    assert "kernel selection" in info.stdout
    plugins = run("inspect", "--plugins")
    assert "rmsnorm" in plugins.stdout and "runs here" in plugins.stdout


def test_engines_built_on_the_fly_are_cached(model_dir, tmp_path):
    build = BuildConfig(max_seq_len=256, tokens_per_block=16, dtype="float32")
    first = build_cached(model_dir, build, tmp_path, device="cpu", progress=False)
    mtime = (first / MANIFEST_NAME).stat().st_mtime
    assert build_cached(model_dir, build, tmp_path, device="cpu", progress=False) == first
    assert (first / MANIFEST_NAME).stat().st_mtime == mtime
    other = build_cached(model_dir, BuildConfig(max_seq_len=512, tokens_per_block=16, dtype="float32"), tmp_path, device="cpu", progress=False)
    assert other != first


def test_cached_engines_are_rebuilt_for_other_engine_code(model_dir, tmp_path, monkeypatch):
    import executor_svc.engine_cache as engine_cache

    build = BuildConfig(max_seq_len=256, tokens_per_block=16, dtype="float32")
    key = engine_cache.engine_cache_key(model_dir, build, "cpu", "auto")
    assert engine_cache.engine_code_fingerprint() == engine_cache.engine_code_fingerprint.__wrapped__()  # stable
    monkeypatch.setattr(engine_cache, "engine_code_fingerprint", lambda: "other code")
    assert engine_cache.engine_cache_key(model_dir, build, "cpu", "auto") != key


def _fake_engine(root: Path, name: str, size: int, last_used: float) -> Path:
    """A folder that passes for a cached engine: a manifest and ``size`` bytes of weights, last used then."""
    folder = root / name
    folder.mkdir(parents=True)
    (folder / MANIFEST_NAME).write_text("{}")
    (folder / "weights.bin").write_bytes(b"w" * size)
    os.utime(folder, (last_used, last_used))
    return folder


def test_engine_cache_removes_the_least_recently_used_engines_beyond_its_budget(tmp_path):
    now = time.time()
    root = tmp_path / "engines"
    oldest = _fake_engine(root, "m-1", 1000, now - 3000)
    older = _fake_engine(root, "m-2", 1000, now - 2000)
    kept = _fake_engine(root, "m-3", 1000, now - 1000)
    recent = _fake_engine(root, "m-4", 1000, now - 5)  # another server may be loading it
    asked = _fake_engine(root, "m-5", 1000, now - 4000)  # the engine being served stays, however old
    dead_build = root / ".m-6.abcd"
    dead_build.mkdir()
    os.utime(dead_build, (now - 2 * 86400, now - 2 * 86400))
    live_build = root / ".m-7.efgh"
    live_build.mkdir()
    stranger = root / "notes"  # not an engine: left alone
    stranger.mkdir()

    budget = 3 * 1000 + 3 * len("{}")
    removed = prune_engine_cache(root, budget, keep=asked)
    assert removed == [oldest, older]
    assert all(p.is_dir() for p in (kept, recent, asked, live_build, stranger))
    assert not oldest.exists() and not older.exists() and not dead_build.exists()
    assert prune_engine_cache(root, budget, keep=asked) == []  # within budget now
    # Over budget with nothing but the kept and the recent engine: both stay.
    assert prune_engine_cache(root, 0, keep=asked) == [kept]
    assert recent.is_dir() and asked.is_dir()


def test_cache_command_lists_and_trims_the_engines(model_dir, tmp_path, capsys, monkeypatch):
    from inflight.cli import main

    monkeypatch.delenv("INFLIGHT_ENGINE_CACHE_GB", raising=False)
    now = time.time()
    root = tmp_path / "engines"
    old = _fake_engine(root, "m-old", 3000, now - 2 * 86400)  # its manifest is not one this version reads
    new = root / "smol-dummy"
    build_engine(model_dir, new, BuildConfig(max_batch_size=8, max_seq_len=256, dtype="float32"), device="cpu",
                 load_format="dummy", progress=False)
    os.utime(new, (now - 600, now - 600))
    new_bytes = sum(p.stat().st_size for p in new.rglob("*") if p.is_file())
    conversion = tmp_path / "m-checkpoint"  # a model conversion beside engines/: never the cache command's
    conversion.mkdir()

    assert main(["cache", "--cache-dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "used 10 min ago  smol-dummy  float32, random weights, batch 8, 256 tokens, on cpu (" in lines[0]
    assert "used 2 d ago  m-old  (unreadable here: " in lines[1]
    assert lines[2].startswith("2 engine(s)") and "of a 20.00 GiB budget" in lines[2]

    assert main(["cache", "prune", "--cache-dir", str(tmp_path), "--max-gb", str((new_bytes + 100) / 2**30)]) == 0
    assert capsys.readouterr().out.splitlines() == [f"removed {old}", "1 engine(s) removed; 1 left, 0.00 GiB"]
    assert main(["cache", "prune", "--cache-dir", str(tmp_path), "--all"]) == 0
    assert not old.exists() and not new.exists() and conversion.is_dir()
    for bad in ("-1", "inf", "nan"):
        with pytest.raises(SystemExit, match="--max-gb must be a finite number of GiB, 0 or more"):
            main(["cache", "prune", "--cache-dir", str(tmp_path), "--max-gb", bad])


def test_build_cached_trims_the_cache_to_its_budget(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("INFLIGHT_ENGINE_CACHE_GB", "0")
    small = BuildConfig(max_seq_len=256, tokens_per_block=16, dtype="float32")
    first = build_cached(model_dir, small, tmp_path, device="cpu", load_format="dummy", progress=False)
    long_ago = time.time() - 3600
    os.utime(first, (long_ago, long_ago))
    # A cache hit marks the engine used, so it is not the one removed.
    assert build_cached(model_dir, small, tmp_path, device="cpu", load_format="dummy", progress=False) == first
    assert first.stat().st_mtime > long_ago
    os.utime(first, (long_ago, long_ago))
    larger = BuildConfig(max_seq_len=512, tokens_per_block=16, dtype="float32")
    second = build_cached(model_dir, larger, tmp_path, device="cpu", load_format="dummy", progress=False)
    assert is_engine_dir(second) and not first.exists()

    monkeypatch.setenv("INFLIGHT_ENGINE_CACHE_GB", "lots")
    with pytest.raises(ValueError, match="INFLIGHT_ENGINE_CACHE_GB must be a finite number of GiB"):
        build_cached(model_dir, small, tmp_path, device="cpu", load_format="dummy", progress=False)
    assert not first.exists()  # refused before building


_BUILD_CACHED_SCRIPT = """
import logging, sys
from pathlib import Path
from executor_svc.build_config import BuildConfig
from executor_svc.engine_cache import build_cached
logging.basicConfig(level=logging.INFO, format="%(message)s")
build = BuildConfig(max_seq_len=256, tokens_per_block=16, dtype="float32")
print(build_cached(Path(sys.argv[1]), build, Path(sys.argv[2]), device="cpu", load_format="dummy", progress=False))
"""


def test_processes_asking_for_the_same_engine_at_once_build_it_once(model_dir, tmp_path):
    import fcntl

    import executor_svc.engine_cache as engine_cache

    build = BuildConfig(max_seq_len=256, tokens_per_block=16, dtype="float32")
    key = engine_cache.engine_cache_key(model_dir, build, "cpu", "dummy")
    engine_dir = tmp_path / "cache" / "engines" / f"{model_dir.name}-{key}"
    engine_dir.parent.mkdir(parents=True)
    logs = [tmp_path / f"server{i}.log" for i in range(2)]
    # Hold the build lock until both processes wait on it, so that they certainly ask at the same time.
    with open(engine_cache._lock_path(engine_dir), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        procs = [
            subprocess.Popen([sys.executable, "-c", _BUILD_CACHED_SCRIPT, str(model_dir), str(tmp_path / "cache")],
                             stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
            for log in logs
        ]
        deadline = time.monotonic() + 120
        while not all("is building" in log.read_text() for log in logs):
            running = all(p.poll() is None for p in procs)
            assert time.monotonic() < deadline and running, [log.read_text() for log in logs]
            time.sleep(0.1)
        fcntl.flock(lock, fcntl.LOCK_UN)
    outputs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs) and outputs == [str(engine_dir)] * 2
    text = "".join(log.read_text() for log in logs)
    assert text.count("building an engine") == 1
    assert text.count("which another process built while this one waited") == 1
    assert is_engine_dir(engine_dir)


def test_dummy_engine_has_no_weights_file_and_loads(model_dir, tmp_path):
    manifest = build_engine(model_dir, tmp_path / "dummy", BuildConfig(max_seq_len=256, dtype="float32"), device="cpu", load_format="dummy", progress=False)
    assert manifest.load_format == "dummy" and not (tmp_path / "dummy" / "rank0.safetensors").exists()
    engine = load_engine(tmp_path / "dummy", RuntimeConfig(kv_cache_bytes=64 << 20))
    assert engine.model.embed_tokens.weight.std() > 0
