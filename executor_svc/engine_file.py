"""The engine folder: a versioned manifest, prepared weights, the tokenizer.

    ENGINE_DIR/
      engine.json           manifest: model, build config, target device, chosen kernels, versions,
                            and for quantized engines what each Linear got (+ calibration, perplexity)
      rank0.safetensors     weights as the runtime wants them (fused, in the engine's dtype; quantized
                            layers as their packed weights and scales)
      tokenizer.json, tokenizer_config.json, chat_template.jinja, generation_config.json, config.json

Loading checks the format version and that the device matches what the engine
was built for; a mismatch is an error that says what was built for what and
how to rebuild, never a silent slow path.
"""

from __future__ import annotations

import json
import platform
import shutil
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from executor_svc.build_config import BuildConfig
from executor_svc.model.config import ModelConfig
from executor_svc.quantization.records import QuantizationRecord

ENGINE_FORMAT = "inflight-engine"
ENGINE_FORMAT_VERSION = 1
MANIFEST_NAME = "engine.json"
WEIGHTS_NAME = "rank0.safetensors"
# Files of the source checkpoint the scheduler needs (tokenizer, EOS ids).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "tokenizer.model", "generation_config.json", "config.json",
)


class EngineMismatchError(RuntimeError):
    """The engine cannot run here (other device, other format version)."""


@dataclass(slots=True)
class DeviceSignature:
    type: str  # "cpu" or "cuda"
    name: str
    compute_capability: list[int] = field(default_factory=list)  # [major, minor] on CUDA

    @classmethod
    def of(cls, device: torch.device) -> DeviceSignature:
        if device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            return cls("cuda", torch.cuda.get_device_name(device), [major, minor])
        return cls(device.type, platform.processor() or platform.machine())

    def describe(self) -> str:
        if self.type == "cuda":
            return f"{self.name} (compute capability {'.'.join(map(str, self.compute_capability))})"
        return f"{self.type} ({self.name})"


@dataclass(slots=True)
class PluginChoice:
    """Which implementation runs a layer kind, and why."""

    name: str
    requested: str  # "auto" or a name
    timings_us: dict[str, float] = field(default_factory=dict)  # candidate -> median time
    fallback: bool = False  # requested implementation could not run; reference used instead
    note: str = ""
    benchmark: str = ""  # the shapes the candidates were timed on
    # Per weight shape ("NxK"), the variant the chosen kernel runs, where it has several (timed at build).
    tactics: dict[str, str] = field(default_factory=dict)
    tactic_timings_us: dict[str, dict[str, float]] = field(default_factory=dict)  # "NxK" or "NxK@rows" -> variant -> time


@dataclass(slots=True)
class EngineManifest:
    model: ModelConfig
    build_config: BuildConfig
    device: DeviceSignature
    plugins: dict[str, PluginChoice]
    dtype: str
    max_seq_len: int
    load_format: str = "auto"
    source: str = ""
    versions: dict[str, str] = field(default_factory=dict)
    build_seconds: float = 0.0
    # Per-layer quantization (the recipe loading rebuilds the modules from), calibration and
    # the perplexity gate; None for an engine built without quantization or --validate.
    quantization: QuantizationRecord | None = None
    format: str = ENGINE_FORMAT
    format_version: int = ENGINE_FORMAT_VERSION

    def to_json(self) -> str:
        data = {
            "format": self.format, "format_version": self.format_version, "model": asdict(self.model),
            "build_config": self.build_config.to_dict(), "device": asdict(self.device),
            "plugins": {k: asdict(v) for k, v in self.plugins.items()}, "dtype": self.dtype,
            "max_seq_len": self.max_seq_len, "load_format": self.load_format, "source": self.source,
            "versions": self.versions, "build_seconds": self.build_seconds,
            "quantization": self.quantization.to_dict() if self.quantization is not None else None,
        }
        return json.dumps(data, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> EngineManifest:
        data: dict[str, Any] = json.loads(text)
        model = dict(data["model"])
        if model.get("layer_types") is not None:  # JSON has no tuples
            model["layer_types"] = tuple(model["layer_types"])
        return cls(
            model=ModelConfig(**model), build_config=BuildConfig.from_dict(data["build_config"]),
            device=DeviceSignature(**data["device"]),
            plugins={k: PluginChoice(**v) for k, v in data["plugins"].items()},
            dtype=data["dtype"], max_seq_len=data["max_seq_len"], load_format=data.get("load_format", "auto"),
            source=data.get("source", ""), versions=data.get("versions", {}),
            build_seconds=data.get("build_seconds", 0.0), format=data["format"], format_version=data["format_version"],
            quantization=QuantizationRecord.from_dict(data["quantization"]) if data.get("quantization") else None,
        )


def library_versions() -> dict[str, str]:
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for package in ("inflight", "transformers", "triton", "safetensors"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    if torch.version.cuda:
        versions["cuda"] = torch.version.cuda
    return versions


def is_engine_dir(path: Path) -> bool:
    return (path / MANIFEST_NAME).is_file()


def read_manifest(engine_dir: Path) -> EngineManifest:
    path = engine_dir / MANIFEST_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{engine_dir} is not an engine folder (no {MANIFEST_NAME}); build one with `inflight build`")
    raw = json.loads(path.read_text())
    if raw.get("format") != ENGINE_FORMAT or raw.get("format_version") != ENGINE_FORMAT_VERSION:
        raise EngineMismatchError(
            f"{engine_dir}: engine format {raw.get('format')!r} version {raw.get('format_version')!r}; this inflight "
            f"reads {ENGINE_FORMAT!r} version {ENGINE_FORMAT_VERSION}. Rebuild it: "
            f"inflight build --model {raw.get('source') or 'MODEL'} --output {engine_dir}"
        )
    return EngineManifest.from_json(path.read_text())


def check_device(manifest: EngineManifest, device: torch.device, engine_dir: Path) -> None:
    """Refuse to run an engine on a device other than the one it was built for."""
    here = DeviceSignature.of(device) if device.type != "cuda" or torch.cuda.is_available() else None
    built = manifest.device
    rebuild = f"rebuild it on this machine: inflight build --model {manifest.source or 'MODEL'} --output NEW_DIR"
    if here is None or here.type != built.type:
        where = here.describe() if here is not None else f"{device.type} (no CUDA GPU visible)"
        raise EngineMismatchError(f"{engine_dir} was built for {built.describe()} but would run on {where}; {rebuild}")
    if built.type == "cuda" and here.compute_capability != built.compute_capability:
        raise EngineMismatchError(
            f"{engine_dir} was built for {built.describe()}, this GPU is {here.describe()}: kernels chosen and "
            f"compiled for one architecture are not valid on another; {rebuild}"
        )


def write_manifest(engine_dir: Path, manifest: EngineManifest) -> None:
    tmp = engine_dir / (MANIFEST_NAME + ".tmp")
    tmp.write_text(manifest.to_json())
    tmp.replace(engine_dir / MANIFEST_NAME)  # the manifest appears last: a folder without it is not an engine


def copy_tokenizer_files(source: Path, engine_dir: Path) -> None:
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, engine_dir / name)
