"""Quantized Linear modules: what the builder swaps in for ``executor_svc.model.llama.Linear``.

Each holds its quantized weight and scales as persistent buffers (so the
engine's safetensors file stores them and ``load_model`` fills them back) and
calls the GEMM plugin the builder chose for its format. Constructors make
empty buffers of the right shape and dtype (what loading an engine needs);
``from_float`` quantizes a float weight (what building needs).

``pre_quant_scale`` (optional, [in]) multiplies the input before the GEMM:
AWQ's per-input-channel scale, or SmoothQuant's 1/s on a layer that has no
norm in front of it to fold s into.

``rounding`` (optional, in ``from_float``) picks each weight's grid point once
the format's scales are fixed: GPTQ (``gptq.py``) instead of round-to-nearest.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from executor_svc.quantization.gptq import ColumnGrid, fp8_tensor_grid, int4_group_grid, int8_channel_grid
from executor_svc.quantization.quantize import (
    FP8_DTYPE, GROUP_SCALE_DTYPE, fp8_tensor_scale, int4_group_params, int8_channel_scales, num_groups,
    quantize_fp8_per_tensor, quantize_fp8_per_token, quantize_fp8_static, quantize_int4_groupwise,
    quantize_int8_per_channel, quantize_int8_per_token,
)
from plugins.fp8_rows import Fp8Rows

Kernel = Callable[..., torch.Tensor]
# (float weight [out, in], the format's grid) -> the weight with every value on that grid
WeightRounding = Callable[[torch.Tensor, ColumnGrid], torch.Tensor]


def _int8_per_channel(weight: torch.Tensor, rounding: WeightRounding | None) -> tuple[torch.Tensor, torch.Tensor]:
    scales = int8_channel_scales(weight)
    if rounding is not None:
        weight = rounding(weight.float(), int8_channel_grid(scales))
    return quantize_int8_per_channel(weight, scales)


class _QuantLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, kernel: Kernel, pre_quant_scale: bool) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.kernel = kernel
        self.register_buffer("pre_quant_scale", torch.ones(in_features) if pre_quant_scale else None)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Int8WeightOnlyLinear(_QuantLinear):
    """W8A16: INT8 weights with one scale per output channel; activations stay 16-bit."""

    def __init__(self, in_features: int, out_features: int, kernel: Kernel) -> None:
        super().__init__(in_features, out_features, kernel, pre_quant_scale=False)
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(out_features, dtype=torch.float32))

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, kernel: Kernel, rounding: WeightRounding | None = None
    ) -> Int8WeightOnlyLinear:
        module = cls(weight.shape[1], weight.shape[0], kernel).to(weight.device)
        module.qweight, module.scales = _int8_per_channel(weight, rounding)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [tokens, in] -> [tokens, out]
        return self.kernel(x, self.qweight, self.scales)


class Int4AWQLinear(_QuantLinear):
    """W4A16_AWQ: packed INT4 weights, asymmetric per group of input channels, AWQ input scale."""

    def __init__(self, in_features: int, out_features: int, kernel: Kernel, group_size: int) -> None:
        super().__init__(in_features, out_features, kernel, pre_quant_scale=True)
        if in_features % 2:
            raise ValueError(f"INT4 packing needs an even number of input channels, got {in_features}")
        self.group_size = group_size
        groups = num_groups(in_features, group_size)
        self.register_buffer("qweight", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.empty(out_features, groups, dtype=GROUP_SCALE_DTYPE))
        self.register_buffer("zeros", torch.empty(out_features, groups, dtype=GROUP_SCALE_DTYPE))

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, kernel: Kernel, group_size: int, input_scale: torch.Tensor | None = None,
        clip: torch.Tensor | None = None, rounding: WeightRounding | None = None, float_zeros: bool = False,
    ) -> Int4AWQLinear:
        """Quantize ``weight * input_scale`` (per input channel; the module divides x by it at run time),
        with each group's range shrunk by ``clip`` ([out, groups]) when given; ``float_zeros``: see
        ``int4_group_params``."""
        module = cls(weight.shape[1], weight.shape[0], kernel, group_size).to(weight.device)
        s = torch.ones(weight.shape[1], device=weight.device) if input_scale is None else input_scale.float()
        scaled = weight.float() * s[None, :]
        params = int4_group_params(scaled, group_size, clip, float_zeros)
        if rounding is not None:
            scaled = rounding(scaled, int4_group_grid(*params, group_size, scaled.shape[1]))
        module.qweight, module.scales, module.zeros = quantize_int4_groupwise(scaled, group_size, params=params)
        module.pre_quant_scale = 1.0 / s
        return module

    def store_scales_by_group(self) -> None:
        """Lay the scales and zeros out [groups, N] in memory; the tensors keep their [N, groups] shape.

        Engines store them row by row, as they are computed. The decode GEMV reads one group of
        many output channels per step, which this layout makes a run of adjacent values instead
        of one value a row apart for each channel: on an H200 the best tile of each Llama-3.1-8B
        projection ran 5-22% faster with groups of 32 and 0-3% faster with groups of 128
        (``bench/quant_gemm_kernels.py``, which times both layouts). Every INT4 kernel takes the
        scales' strides, so this is done once, after the weights are loaded.
        """
        self.scales = self.scales.t().contiguous().t()
        self.zeros = self.zeros.t().contiguous().t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.qweight, self.scales, self.zeros, self.group_size, self.pre_quant_scale)


class SmoothQuantLinear(_QuantLinear):
    """W8A8 SmoothQuant: per-channel INT8 weights, per-token INT8 activations quantized on the fly."""

    def __init__(self, in_features: int, out_features: int, kernel: Kernel, pre_quant_scale: bool) -> None:
        super().__init__(in_features, out_features, kernel, pre_quant_scale)
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(out_features, dtype=torch.float32))

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, kernel: Kernel, smoothing: torch.Tensor | None = None,
        rounding: WeightRounding | None = None,
    ) -> SmoothQuantLinear:
        """``smoothing`` (s per input channel) is multiplied into the weight and divided out of x here;
        None when s was already folded into the weight and the norm in front."""
        module = cls(weight.shape[1], weight.shape[0], kernel, pre_quant_scale=smoothing is not None).to(weight.device)
        w = weight.float() if smoothing is None else weight.float() * smoothing.float()[None, :]
        module.qweight, module.scales = _int8_per_channel(w, rounding)
        if smoothing is not None:
            module.pre_quant_scale = 1.0 / smoothing.float()
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_quant_scale is not None:
            x = x * self.pre_quant_scale.to(x.dtype)
        x_q, x_scale = quantize_int8_per_token(x)
        return self.kernel(x_q, x_scale, self.qweight, self.scales, x.dtype)


def weight_only_rows(kernel: Kernel) -> int:
    """Up to how many rows a ``gemm_fp8`` kernel takes unquantized activations (``x_scale`` None); 0 for none."""
    return getattr(kernel, "weight_only_rows", 0)


class Fp8Linear(_QuantLinear):
    """FP8: E4M3 weights with one scale per tensor; activations per token (dynamic) or per tensor (static)."""

    def __init__(self, in_features: int, out_features: int, kernel: Kernel, static_input_scale: bool) -> None:
        super().__init__(in_features, out_features, kernel, pre_quant_scale=False)
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8_DTYPE))
        self.register_buffer("weight_scale", torch.empty(1, dtype=torch.float32))
        self.register_buffer("input_scale", torch.empty(1, dtype=torch.float32) if static_input_scale else None)

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, kernel: Kernel, input_scale: torch.Tensor | None = None,
        rounding: WeightRounding | None = None,
    ) -> Fp8Linear:
        static = input_scale is not None
        module = cls(weight.shape[1], weight.shape[0], kernel, static_input_scale=static).to(weight.device)
        scale = fp8_tensor_scale(weight)
        if rounding is not None:
            weight = rounding(weight.float(), fp8_tensor_grid(scale))
        module.weight, module.weight_scale = quantize_fp8_per_tensor(weight, scale)
        if input_scale is not None:
            module.input_scale = input_scale.float().reshape(1).to(weight.device)
        return module

    def wants_fp8_rows(self, rows: int) -> bool:
        """Whether an input of ``rows`` rows is quantized per token here, so that the kernel before
        this projection may hand it over quantized already (``plugins/fp8_rows.py``)."""
        return self.input_scale is None and rows > weight_only_rows(self.kernel)

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        if isinstance(x, Fp8Rows):  # quantized per token by the norm or activation before this projection
            return self.kernel(x.values, x.scales, self.weight, self.weight_scale, x.dtype)
        if x.shape[0] <= weight_only_rows(self.kernel):
            # A decode-sized batch: the kernel multiplies 16-bit x by the FP8 weight as it is, since
            # quantizing x would cost more kernels than the GEMM. Decided from the shape on the host,
            # so each captured decode graph holds one path.
            return self.kernel(x, None, self.weight, self.weight_scale, x.dtype)
        if self.input_scale is not None:
            x_q = quantize_fp8_static(x, self.input_scale)
            return self.kernel(x_q, self.input_scale, self.weight, self.weight_scale, x.dtype)
        x_q, x_scale = quantize_fp8_per_token(x)
        return self.kernel(x_q, x_scale, self.weight, self.weight_scale, x.dtype)


QUANT_LINEAR_TYPES = (Int8WeightOnlyLinear, Int4AWQLinear, SmoothQuantLinear, Fp8Linear)
