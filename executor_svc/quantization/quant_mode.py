"""QuantMode: what an engine quantizes, as a bit mask (TensorRT-LLM's QuantMode idea).

An algorithm name (``--quant-algo W4A16_AWQ``) is a user-facing label; the bit
mask is what the code asks questions of (``mode.is_weight_only``,
``mode.has(QuantMode.PER_TOKEN)``), and what the combination rules are written
against. Activations are quantized to the weights' format: INT8 weights with
ACTIVATIONS is W8A8, FP8 weights with ACTIVATIONS is FP8 x FP8. "Weight-only"
is not a bit of its own but a derived property (quantized weights, no
ACTIVATIONS), so the mask cannot contradict itself there.
"""

from __future__ import annotations

from enum import IntFlag, auto


class QuantModeError(ValueError):
    """A combination of quantization bits that is meaningless or not implemented."""


class QuantMode(IntFlag):
    # Weight formats (at most one).
    INT4_WEIGHTS = auto()
    INT8_WEIGHTS = auto()
    FP8_WEIGHTS = auto()  # E4M3
    # Activations quantized to the weights' format before the GEMM.
    ACTIVATIONS = auto()
    # Scale granularity.
    PER_CHANNEL = auto()  # one weight scale per output channel
    PER_TOKEN = auto()  # one activation scale per token, computed on the fly
    PER_GROUP = auto()  # one weight scale (and zero) per group of input channels
    # How the scales were found.
    AWQ = auto()  # activation-aware per-input-channel scales (INT4 weight-only)
    SMOOTHQUANT = auto()  # activation outliers migrated into the weights (W8A8)
    # KV cache formats (at most one).
    INT8_KV_CACHE = auto()
    FP8_KV_CACHE = auto()

    @property
    def weight_format(self) -> QuantMode:
        return self & (QuantMode.INT4_WEIGHTS | QuantMode.INT8_WEIGHTS | QuantMode.FP8_WEIGHTS)

    @property
    def quantizes_weights(self) -> bool:
        return bool(self.weight_format)

    @property
    def is_weight_only(self) -> bool:
        return self.quantizes_weights and not self & QuantMode.ACTIVATIONS

    @property
    def has_kv_cache_quant(self) -> bool:
        return bool(self & (QuantMode.INT8_KV_CACHE | QuantMode.FP8_KV_CACHE))

    def flag_names(self) -> list[str]:
        return [flag.name for flag in QuantMode if flag in self]

    def describe(self) -> str:
        return "|".join(self.flag_names()) or "none"

    def validate(self) -> None:
        """Raise QuantModeError naming the first rule this mask breaks."""
        for rule_broken, message in _RULES:
            if rule_broken(self):
                raise QuantModeError(f"quantization mode {self.describe()}: {message}")


def _count(mode: QuantMode, *flags: QuantMode) -> int:
    return sum(1 for flag in flags if flag in mode)


Q = QuantMode
# (predicate that is true when the rule is broken, what is wrong). Order matters:
# the first broken rule is the message the user sees.
_RULES: tuple[tuple, ...] = (
    (lambda m: _count(m, Q.INT4_WEIGHTS, Q.INT8_WEIGHTS, Q.FP8_WEIGHTS) > 1, "choose one weight format"),
    (lambda m: _count(m, Q.INT8_KV_CACHE, Q.FP8_KV_CACHE) > 1, "choose one KV-cache format"),
    (lambda m: Q.ACTIVATIONS in m and not m.quantizes_weights, "activation quantization needs quantized weights"),
    (lambda m: Q.ACTIVATIONS in m and Q.INT4_WEIGHTS in m,
     "INT4 weights with quantized activations (W4A8) is not implemented"),
    (lambda m: Q.FP8_WEIGHTS in m and Q.ACTIVATIONS not in m,
     "FP8 weight-only (W8A16 in FP8) is not implemented; FP8 quantizes activations too"),
    (lambda m: Q.PER_TOKEN in m and Q.ACTIVATIONS not in m, "per-token scales apply to quantized activations"),
    (lambda m: Q.PER_GROUP in m and Q.INT4_WEIGHTS not in m, "per-group scales are implemented for INT4 weights only"),
    (lambda m: Q.INT4_WEIGHTS in m and Q.PER_GROUP not in m, "INT4 weights need per-group scales"),
    (lambda m: Q.PER_CHANNEL in m and Q.INT8_WEIGHTS not in m,
     "per-channel scales are implemented for INT8 weights only"),
    (lambda m: Q.INT8_WEIGHTS in m and Q.PER_CHANNEL not in m, "INT8 weights need per-channel scales"),
    (lambda m: Q.INT8_WEIGHTS in m and Q.ACTIVATIONS in m and Q.PER_TOKEN not in m,
     "INT8 activations need per-token scales (static per-tensor INT8 is not implemented)"),
    (lambda m: Q.AWQ in m and not (Q.INT4_WEIGHTS in m and m.is_weight_only),
     "AWQ applies to INT4 weight-only quantization"),
    (lambda m: Q.SMOOTHQUANT in m and not (Q.INT8_WEIGHTS in m and Q.ACTIVATIONS in m),
     "SmoothQuant applies to W8A8 (INT8 weights and activations)"),
    (lambda m: Q.INT8_WEIGHTS in m and Q.ACTIVATIONS in m and Q.SMOOTHQUANT not in m,
     "W8A8 without SmoothQuant is not implemented (activation outliers make it inaccurate)"),
)

# --quant-algo names (TensorRT-LLM's) and what they mean.
QUANT_ALGOS: dict[str, QuantMode] = {
    "none": QuantMode(0),
    "W8A16": Q.INT8_WEIGHTS | Q.PER_CHANNEL,
    "W4A16_AWQ": Q.INT4_WEIGHTS | Q.PER_GROUP | Q.AWQ,
    "W8A8_SQ_PER_CHANNEL_PER_TOKEN": Q.INT8_WEIGHTS | Q.ACTIVATIONS | Q.PER_CHANNEL | Q.PER_TOKEN | Q.SMOOTHQUANT,
    "FP8": Q.FP8_WEIGHTS | Q.ACTIVATIONS,  # + PER_TOKEN when activation scales are dynamic
}
KV_CACHE_QUANT_ALGOS: dict[str, QuantMode] = {
    "none": QuantMode(0),
    "INT8": Q.INT8_KV_CACHE,
    "FP8": Q.FP8_KV_CACHE,
}
# How FP8 activation scales are found: per token at run time, or one per tensor from calibration.
ACTIVATION_SCHEMES = ("dynamic", "static")


def quant_mode_of(quant_algo: str, kv_cache_quant_algo: str = "none", activation_scheme: str = "dynamic") -> QuantMode:
    """The bit mask an algorithm name (and KV-cache algorithm) stands for."""
    if quant_algo not in QUANT_ALGOS:
        raise QuantModeError(f"quant_algo {quant_algo!r} is not supported; choose one of {list(QUANT_ALGOS)}")
    if kv_cache_quant_algo not in KV_CACHE_QUANT_ALGOS:
        raise QuantModeError(
            f"kv_cache_quant_algo {kv_cache_quant_algo!r} is not supported; choose one of {list(KV_CACHE_QUANT_ALGOS)}"
        )
    mode = QUANT_ALGOS[quant_algo] | KV_CACHE_QUANT_ALGOS[kv_cache_quant_algo]
    if Q.FP8_WEIGHTS in mode and activation_scheme == "dynamic":
        mode |= Q.PER_TOKEN
    return mode
