"""What an engine's manifest records about quantization (plain data, no torch).

The per-layer records are both the report (``inflight inspect --layer-info``)
and the recipe loading uses to rebuild the same quantized modules before the
weights file fills them. A quantized KV cache's per-layer scales live here too
(a few floats, read when the engine loads; no tensor in the weights file).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class LayerQuant:
    """What one Linear got."""

    name: str  # module name, e.g. "layers.3.qkv_proj"
    algo: str  # quant_algo, or "none" for a layer kept in high precision
    in_features: int
    out_features: int
    kind: str = "gemm"  # the plugin kind its GEMM is: gemm, gemm_w8a16, gemm_w4a16, gemm_w8a8, gemm_fp8
    weight: str = ""  # stored format: "int8 per-channel", "int4 g128 asymmetric, integer zeros", ..., or the dtype
    activation: str = ""  # "16-bit", "int8 per-token dynamic", "float8_e4m3fn per-tensor static", ...
    group_size: int = 0
    pre_quant_scale: bool = False  # the module multiplies its input by a per-channel scale
    static_input_scale: bool = False  # FP8 with a calibrated activation scale
    note: str = ""  # why it is excluded, where SmoothQuant folded its factors, ...


@dataclass(slots=True)
class CalibrationReport:
    corpus: str  # "stdlib docstrings (N modules)" or the --calib-data file
    num_texts: int
    num_tokens: int
    seconds: float


@dataclass(slots=True)
class PerplexityReport:
    """The accuracy gate of ``inflight build --validate``."""

    corpus: str
    num_texts: int
    num_tokens: int  # predicted tokens the perplexity averages over
    baseline: float  # the unquantized model in the engine dtype
    quantized: float
    max_increase: float

    @property
    def increase(self) -> float:
        return self.quantized - self.baseline

    @property
    def passed(self) -> bool:
        return self.increase <= self.max_increase


@dataclass(slots=True)
class KVCacheQuant:
    """The 1-byte KV cache of an engine: its format and each layer's scales.

    A layer's cache holds ``k / k_scales[layer]`` and ``v / v_scales[layer]``
    in ``dtype``; ``scale = max |x| / (448 for FP8, 127 for INT8)``, with the
    maxima of post-RoPE keys and of values measured by calibration.
    """

    algo: str  # kv_cache_quant_algo: "FP8" or "INT8"
    dtype: str  # torch dtype name: "float8_e4m3fn" or "int8"
    k_scales: list[float]  # per layer
    v_scales: list[float]
    source: str = ""  # what the maxima were measured on

    @property
    def num_layers(self) -> int:
        return len(self.k_scales)


@dataclass(slots=True)
class LayerSensitivity:
    """Each decoder layer's sensitivity to the build's format, and the layers kept in high precision for it
    (``QuantConfig.sensitive_layers``; ``sensitivity.py``)."""

    metric: str  # what ``kl`` measures
    num_texts: int
    num_tokens: int  # tokens the KL averages over
    kl: list[float] = field(default_factory=list)  # per decoder layer, nats per token
    kept: list[int] = field(default_factory=list)  # decoder layers kept in high precision, most sensitive first


@dataclass(slots=True)
class QuantizationRecord:
    quant_algo: str
    kv_cache_quant_algo: str
    quant_mode: int
    quant_mode_flags: list[str]
    layers: list[LayerQuant] = field(default_factory=list)
    calibration: CalibrationReport | None = None
    perplexity: PerplexityReport | None = None
    kv_cache: KVCacheQuant | None = None  # None: a 16-bit KV cache
    sensitivity: LayerSensitivity | None = None  # None: no layer kept in high precision by measurement

    def layer(self, name: str) -> LayerQuant | None:
        return next((layer for layer in self.layers if layer.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if self.perplexity is not None:  # derived numbers too, for readers of engine.json
            data["perplexity"].update(increase=round(self.perplexity.increase, 4), passed=self.perplexity.passed)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> QuantizationRecord:
        data = dict(data)
        data["layers"] = [LayerQuant(**layer) for layer in data.get("layers", [])]
        if data.get("calibration") is not None:
            data["calibration"] = CalibrationReport(**data["calibration"])
        if data.get("kv_cache") is not None:
            data["kv_cache"] = KVCacheQuant(**data["kv_cache"])
        if data.get("sensitivity") is not None:
            data["sensitivity"] = LayerSensitivity(**data["sensitivity"])
        if data.get("perplexity") is not None:
            report = {k: v for k, v in data["perplexity"].items() if k not in ("increase", "passed")}
            data["perplexity"] = PerplexityReport(**report)
        return cls(**data)
