"""What an engine is built for: BuildConfig, QuantConfig, plugin choices.

These settings are baked into an engine folder (``engine.json``) at build time,
the way TensorRT-LLM bakes them into a serialized engine: the executor that
loads the engine serves within them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from executor_svc.quantization.quant_mode import (
    ACTIVATION_SCHEMES, KV_CACHE_QUANT_ALGOS, QUANT_ALGOS, QuantMode, QuantModeError, quant_mode_of,
)

# Layer kinds whose implementation is chosen at build time; "auto" times the
# candidates that can run on the target and keeps the fastest.
PLUGIN_KINDS = ("attention", "rmsnorm", "rope", "activation", "gemm", "argmax")
# The quantized GEMMs, one kind per weight/activation format; an engine chooses
# (and records) only the kind its quant_algo uses.
QUANT_PLUGIN_KINDS = ("gemm_w8a16", "gemm_w4a16", "gemm_w8a8", "gemm_fp8")
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
GROUP_SIZES = (32, 64, 128)
# Embeddings are never quantized (they are lookups, not GEMMs); lm_head is
# where a small error shifts every logit, so both stay in high precision.
DEFAULT_EXCLUDE_MODULES = ("embed_tokens", "lm_head")
WEIGHT_ROUNDINGS = ("nearest", "gptq")
ZERO_POINTS = ("integer", "float")


class BuildConfigError(ValueError):
    """A build setting is out of range or not supported."""


@dataclass(slots=True)
class QuantConfig:
    """How weights (and activations) are quantized; see executor_svc/quantization/."""

    quant_algo: str = "none"  # none, W8A16, W4A16_AWQ, W8A8_SQ_PER_CHANNEL_PER_TOKEN, FP8
    kv_cache_quant_algo: str = "none"  # none, FP8 (E4M3) or INT8: a 1-byte KV cache with per-layer scales
    group_size: int = 128  # input channels per INT4 scale (W4A16_AWQ)
    # INT4 zero points: "integer" (whole codes, AWQ's format: 0 is on the grid) or "float" (each
    # group's grid spans its own min..max, as llama.cpp's Q4_1 and HQQ store it). Same kernels.
    zero_point: str = "integer"
    smoothquant_alpha: float = 0.5  # migration strength: 0 = all on activations, 1 = all on weights
    activation_scheme: str = "dynamic"  # FP8 activation scales: per token at run time, or "static" per tensor
    # fnmatch patterns of Linear module names kept in high precision ("layers.0.*",
    # "*.down_proj"); "first_layer" / "last_layer" name the first / last decoder layer.
    exclude_modules: list[str] = field(default_factory=lambda: list(DEFAULT_EXCLUDE_MODULES))
    # Decoder layers kept in high precision because calibration says so: the N whose quantization
    # moves the model's next-token distributions most (quantization/sensitivity.py); 0 measures nothing.
    sensitive_layers: int = 0
    calib_data: str = ""  # text file, one text per line; "" = the built-in stdlib docstring corpus
    calib_size: int = 64  # calibration texts
    calib_max_tokens: int = 512  # tokens kept per calibration text
    awq_grid_size: int = 20  # alpha values tried by the AWQ scale search (and half as many clip factors)
    # How weights take their grid points once the format's scales are set: "nearest", or "gptq"
    # (each rounding error compensated on the channels not yet rounded; needs calibration).
    weight_rounding: str = "nearest"
    gptq_damp: float = 0.01  # added to the GPTQ Hessian's diagonal, as a fraction of its mean
    # GPTQ's order: calibrate and quantize one decoder layer at a time, each on the already
    # quantized layers' outputs (False: every layer calibrated on the unquantized model, one pass).
    gptq_sequential: bool = True

    @property
    def quant_mode(self) -> QuantMode:
        return quant_mode_of(self.quant_algo, self.kv_cache_quant_algo, self.activation_scheme)

    def describe(self) -> str:
        """What is quantized: "FP8", "FP8 + INT8 KV cache", "FP8 KV cache", or "none"."""
        parts = [self.quant_algo] if self.quant_algo != "none" else []
        if self.kv_cache_quant_algo != "none":
            parts.append(f"{self.kv_cache_quant_algo} KV cache")
        return " + ".join(parts) or "none"

    @property
    def needs_calibration(self) -> bool:
        """Whether the weight quantization needs input statistics from calibration texts.

        (A quantized KV cache is always calibrated too, for its scales.)
        """
        mode = self.quant_mode
        return QuantMode.AWQ in mode or QuantMode.SMOOTHQUANT in mode or self.weight_rounding == "gptq" or (
            QuantMode.FP8_WEIGHTS in mode and self.activation_scheme == "static"
        )

    def validate(self) -> None:
        if self.quant_algo not in QUANT_ALGOS:
            raise BuildConfigError(
                f"quant_algo {self.quant_algo!r} is not supported; choose one of {list(QUANT_ALGOS)}"
            )
        if self.kv_cache_quant_algo not in KV_CACHE_QUANT_ALGOS:
            raise BuildConfigError(
                f"kv_cache_quant_algo {self.kv_cache_quant_algo!r} is not supported; "
                f"choose one of {list(KV_CACHE_QUANT_ALGOS)}"
            )
        if self.activation_scheme not in ACTIVATION_SCHEMES:
            raise BuildConfigError(f"activation_scheme {self.activation_scheme!r} is not one of {ACTIVATION_SCHEMES}")
        mode = self.quant_mode
        try:
            mode.validate()
        except QuantModeError as exc:
            raise BuildConfigError(f"quant_algo {self.quant_algo!r}: {exc}") from None
        if self.activation_scheme == "static" and QuantMode.FP8_WEIGHTS not in mode:
            why = "uses per-token activation scales" if mode & QuantMode.ACTIVATIONS else "quantizes no activations"
            raise BuildConfigError(f"activation_scheme 'static' applies to FP8 only; {self.quant_algo!r} {why}")
        if QuantMode.PER_GROUP in mode and self.group_size not in GROUP_SIZES:
            raise BuildConfigError(
                f"group_size must be one of {GROUP_SIZES} for {self.quant_algo}, got {self.group_size}"
            )
        if self.zero_point not in ZERO_POINTS:
            raise BuildConfigError(f"zero_point {self.zero_point!r} is not one of {ZERO_POINTS}")
        if self.zero_point != "integer" and QuantMode.PER_GROUP not in mode:
            raise BuildConfigError(f"zero_point {self.zero_point!r} applies to INT4 groups (W4A16_AWQ), not {self.quant_algo!r}")
        if self.weight_rounding not in WEIGHT_ROUNDINGS:
            raise BuildConfigError(f"weight_rounding {self.weight_rounding!r} is not one of {WEIGHT_ROUNDINGS}")
        if self.weight_rounding == "gptq" and not mode.quantizes_weights:
            raise BuildConfigError("weight_rounding 'gptq' rounds quantized weights; set a weight quant_algo")
        if not 0.0 < self.gptq_damp <= 1.0:
            raise BuildConfigError(f"gptq_damp must be in (0, 1], got {self.gptq_damp}")
        if not 0.0 <= self.smoothquant_alpha <= 1.0:
            raise BuildConfigError(f"smoothquant_alpha must be in [0, 1], got {self.smoothquant_alpha}")
        for name in ("calib_size", "awq_grid_size"):
            if getattr(self, name) <= 0:
                raise BuildConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.calib_max_tokens < 2:
            raise BuildConfigError(f"calib_max_tokens must be at least 2, got {self.calib_max_tokens}")
        if self.sensitive_layers < 0:
            raise BuildConfigError(f"sensitive_layers must be 0 or more, got {self.sensitive_layers}")
        if self.sensitive_layers and not mode.quantizes_weights:
            raise BuildConfigError("sensitive_layers keeps quantized layers in high precision; set a weight quant_algo")
        if not all(isinstance(p, str) and p for p in self.exclude_modules):
            raise BuildConfigError(f"exclude_modules must be non-empty name patterns, got {self.exclude_modules}")


@dataclass(slots=True)
class BuildConfig:
    max_batch_size: int = 256
    max_seq_len: int = 0  # 0 = the model's max_position_embeddings
    max_num_tokens: int = 8192
    tokens_per_block: int = 32
    dtype: str = "auto"  # auto = bfloat16 on a GPU, float32 on the CPU
    quant_config: QuantConfig = field(default_factory=QuantConfig)
    # kind -> implementation name or "auto"; kinds left out mean "auto".
    plugin_config: dict[str, str] = field(default_factory=dict)
    tp_size: int = 1
    # Use the reference implementation (with a loud warning, recorded in the
    # engine) when a requested plugin cannot run on the target, instead of failing.
    allow_fallback: bool = False

    def validate(self) -> None:
        for name in ("max_batch_size", "max_num_tokens", "tokens_per_block", "tp_size"):
            if getattr(self, name) <= 0:
                raise BuildConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_seq_len < 0:
            raise BuildConfigError(f"max_seq_len must be >= 0, got {self.max_seq_len}")
        if self.max_num_tokens < self.tokens_per_block:
            raise BuildConfigError(
                f"max_num_tokens ({self.max_num_tokens}) must be at least tokens_per_block ({self.tokens_per_block})"
            )
        if self.dtype not in DTYPE_NAMES:
            raise BuildConfigError(f"dtype {self.dtype!r} is not one of {DTYPE_NAMES}")
        if self.tp_size != 1:
            raise BuildConfigError("tp_size > 1 (tensor parallelism) is not implemented yet; build with tp_size=1")
        unknown = set(self.plugin_config) - set(PLUGIN_KINDS) - set(QUANT_PLUGIN_KINDS)
        if unknown:
            kinds = PLUGIN_KINDS + QUANT_PLUGIN_KINDS
            raise BuildConfigError(f"unknown plugin kinds {sorted(unknown)}; kinds are {kinds}")
        self.quant_config.validate()

    def plugin_for(self, kind: str) -> str:
        return self.plugin_config.get(kind, "auto")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BuildConfig:
        data = dict(data)
        data["quant_config"] = QuantConfig(**data.get("quant_config", {}))
        return cls(**data)
