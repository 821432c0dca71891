"""Engine folders: round trip, device and version checks, loud plugin fallback, inspect."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from executor_svc.build_config import BuildConfig, BuildConfigError, QuantConfig
from executor_svc.builder import build_cached, build_engine
from executor_svc.engine import RuntimeConfig, load_engine
from executor_svc.engine_file import MANIFEST_NAME, EngineMismatchError, read_manifest
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
    assert set(manifest.plugins) == {"attention", "rmsnorm", "rope", "activation", "gemm"}
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
    import executor_svc.builder as builder

    build = BuildConfig(max_seq_len=256, tokens_per_block=16, dtype="float32")
    key = builder.engine_cache_key(model_dir, build, "cpu", "auto")
    assert builder.engine_code_fingerprint() == builder.engine_code_fingerprint.__wrapped__()  # stable in a process
    monkeypatch.setattr(builder, "engine_code_fingerprint", lambda: "other code")
    assert builder.engine_cache_key(model_dir, build, "cpu", "auto") != key


def test_dummy_engine_has_no_weights_file_and_loads(model_dir, tmp_path):
    manifest = build_engine(model_dir, tmp_path / "dummy", BuildConfig(max_seq_len=256, dtype="float32"), device="cpu", load_format="dummy", progress=False)
    assert manifest.load_format == "dummy" and not (tmp_path / "dummy" / "rank0.safetensors").exists()
    engine = load_engine(tmp_path / "dummy", RuntimeConfig(kv_cache_bytes=64 << 20))
    assert engine.model.embed_tokens.weight.std() > 0
