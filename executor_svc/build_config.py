"""What an engine is built for: BuildConfig, QuantConfig, plugin choices.

These settings are baked into an engine folder (``engine.json``) at build time,
the way TensorRT-LLM bakes them into a serialized engine: the executor that
loads the engine serves within them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# Layer kinds whose implementation is chosen at build time; "auto" times the
# candidates that can run on the target and keeps the fastest.
PLUGIN_KINDS = ("attention", "rmsnorm", "rope", "activation", "gemm")
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
QUANT_ALGOS = ("none",)  # filled in by the quantization work
KV_CACHE_QUANT_ALGOS = ("none",)


class BuildConfigError(ValueError):
    """A build setting is out of range or not supported."""


@dataclass(slots=True)
class QuantConfig:
    quant_algo: str = "none"
    kv_cache_quant_algo: str = "none"

    def validate(self) -> None:
        if self.quant_algo not in QUANT_ALGOS:
            raise BuildConfigError(f"quant_algo {self.quant_algo!r} is not supported; choose one of {QUANT_ALGOS}")
        if self.kv_cache_quant_algo not in KV_CACHE_QUANT_ALGOS:
            raise BuildConfigError(
                f"kv_cache_quant_algo {self.kv_cache_quant_algo!r} is not supported; choose one of {KV_CACHE_QUANT_ALGOS}"
            )


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
        unknown = set(self.plugin_config) - set(PLUGIN_KINDS)
        if unknown:
            raise BuildConfigError(f"unknown plugin kinds {sorted(unknown)}; kinds are {PLUGIN_KINDS}")
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
