"""GPTQ: round weights so that the layer's output error is smallest, not each weight's (Frantar et al., 2022).

Round-to-nearest puts every weight on the grid point closest to it, each error
independent of the others. GPTQ rounds the input channels one at a time and
moves the error each rounding made onto the channels not yet rounded, in the
proportions that cancel it in the layer's output over the calibration inputs
``X``. The quantity it minimises is ``|| X (W - Q)^T ||^2``, whose curvature
is the Hessian ``H = X^T X`` (``[in, in]``, summed during calibration); with
``U`` the upper Cholesky factor of ``H^-1``, rounding channel ``j`` to ``q``
updates every later channel ``k`` by ``-(w_j - q) U[j, k] / U[j, j]``.

The grid stays whatever the format's own scales make it (computed from the
weight before GPTQ runs, the AWQ clip included), so GPTQ changes only which
grid point each weight takes and the engine format does not change:

* FP8 per tensor, INT8 per output channel, INT4 per contiguous group.
* Channels are visited in order of decreasing ``H[j, j]`` (the "act order" of
  the reference code: the channels with the largest inputs are rounded first,
  while the most others are left to absorb their error). With the group
  parameters fixed up front, this order keeps INT4 groups contiguous.
* Work proceeds in blocks of 128 channels, the later channels updated once per
  block, as the reference implementation does to keep it a GEMM.

The Hessians come from the unquantized model's inputs, all layers in one
calibration pass (not sequentially, layer after quantized layer, as the paper
does): one pass is what the other algorithms' statistics need too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from executor_svc.quantization.quantize import group_values_per_channel, round_fp8, round_int4, round_int8

GPTQ_BLOCK = 128  # channels rounded between two updates of the rest of the weight
DEFAULT_DAMP = 0.01  # added to H's diagonal, as a fraction of its mean: H of few or collinear rows is singular


class ColumnGrid(Protocol):
    """A weight format's grid points, input channel by input channel."""

    def round(self, values: torch.Tensor, channels: slice) -> torch.Tensor:
        """Values [out, k] of the input channels ``channels`` -> the nearest grid points [out, k]."""
        ...

    def permute(self, order: torch.Tensor) -> ColumnGrid:
        """The same grid with its input channels taken in ``order``."""
        ...


@dataclass(frozen=True, slots=True)
class Fp8TensorGrid:
    """FP8 E4M3 with one scale for the whole weight (``quantize_fp8_per_tensor``'s grid)."""

    scale: torch.Tensor  # [1]

    def round(self, values: torch.Tensor, channels: slice) -> torch.Tensor:
        return round_fp8(values, self.scale).to(values.dtype) * self.scale

    def permute(self, order: torch.Tensor) -> Fp8TensorGrid:
        return self


@dataclass(frozen=True, slots=True)
class Int8ChannelGrid:
    """Symmetric INT8 with one scale per output channel (``quantize_int8_per_channel``'s grid)."""

    scales: torch.Tensor  # [out, 1]

    def round(self, values: torch.Tensor, channels: slice) -> torch.Tensor:
        return round_int8(values, self.scales) * self.scales

    def permute(self, order: torch.Tensor) -> Int8ChannelGrid:
        return self


@dataclass(frozen=True, slots=True)
class Int4GroupGrid:
    """Asymmetric INT4 per group of input channels (``int4_group_params`` / ``int4_codes``' grid),
    with each group's scale and zero point repeated over its channels."""

    scales: torch.Tensor  # [out, in] float32
    zeros: torch.Tensor  # [out, in] float32

    def round(self, values: torch.Tensor, channels: slice) -> torch.Tensor:
        scale, zero = self.scales[:, channels], self.zeros[:, channels]
        return (round_int4(values, scale, zero) - zero) * scale

    def permute(self, order: torch.Tensor) -> Int4GroupGrid:
        return Int4GroupGrid(self.scales[:, order], self.zeros[:, order])


def fp8_tensor_grid(scale: torch.Tensor) -> Fp8TensorGrid:
    return Fp8TensorGrid(scale.float().reshape(1))


def int8_channel_grid(scales: torch.Tensor) -> Int8ChannelGrid:
    return Int8ChannelGrid(scales.float()[:, None])


def int4_group_grid(scales: torch.Tensor, zeros: torch.Tensor, group_size: int, in_features: int) -> Int4GroupGrid:
    """From the group parameters ([out, groups], the last group may be short)."""
    return Int4GroupGrid(
        group_values_per_channel(scales, group_size, in_features).contiguous(),
        group_values_per_channel(zeros, group_size, in_features).contiguous(),
    )


@dataclass(slots=True)
class GptqResult:
    weight: torch.Tensor  # [out, in] float32 (float64 for a float64 input), every value on the grid
    error: float  # || X (W - Q)^T ||^2 over the calibration rows
    nearest_error: float  # the same for round-to-nearest on the same grid

    @property
    def error_ratio(self) -> float:
        return self.error / self.nearest_error if self.nearest_error > 0 else 1.0


def output_error(delta: torch.Tensor, hessian: torch.Tensor) -> float:
    """``|| X delta^T ||^2`` from ``H = X^T X``: the sum of ``delta H delta^T``'s diagonal."""
    return float(((delta @ hessian) * delta).sum())


def _inverse_cholesky(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of ``(H + damp * mean(diag H) * I)^-1``."""
    h = hessian.clone()
    h.diagonal().add_(damp * float(h.diagonal().mean()))
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)


@torch.no_grad()
def gptq_round(
    weight: torch.Tensor, hessian: torch.Tensor, grid: ColumnGrid, damp: float = DEFAULT_DAMP,
    block_size: int = GPTQ_BLOCK,
) -> GptqResult:
    """Put ``weight`` [out, in] on ``grid`` minimising the output error under ``hessian`` [in, in] (= X^T X).

    Channels the calibration never fed (zero ``H[j, j]``) carry no output error
    and are rounded to nearest, with nothing moved onto others. Works in
    float32 (float64 when ``weight`` is float64).
    """
    in_features = weight.shape[1]
    if hessian.shape != (in_features, in_features):
        raise ValueError(f"Hessian {tuple(hessian.shape)} does not match a weight of {in_features} input channels")
    work = torch.float64 if weight.dtype == torch.float64 else torch.float32
    original = weight.to(work)
    w = original.clone()
    h = hessian.to(device=w.device, dtype=work)
    exact = h.clone()
    nearest = grid.round(original, slice(None))
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0  # an unfed channel: any value is as good, so its error goes nowhere
    order = torch.argsort(h.diagonal(), descending=True, stable=True)
    w, h, grid = w[:, order], h[order][:, order], grid.permute(order)
    u = _inverse_cholesky(h, damp)
    # Channel-major ([in, out]): each step reads and updates whole contiguous rows.
    wt = w.t().contiguous()
    qt = torch.empty_like(wt)
    for start in range(0, in_features, block_size):
        end = min(start + block_size, in_features)
        block = wt[start:end].clone()
        errors = torch.empty_like(block)
        u_block = u[start:end, start:end]
        for i in range(end - start):
            channel = block[i]
            rounded = grid.round(channel[:, None], slice(start + i, start + i + 1))[:, 0]
            qt[start + i] = rounded
            err = (channel - rounded) / u_block[i, i]
            block[i:].addr_(u_block[i, i:], err, alpha=-1.0)
            errors[i] = err
        wt[end:].addmm_(u[start:end, end:].t(), errors, alpha=-1.0)
    q = qt.t()[:, torch.argsort(order)]
    return GptqResult(q, output_error(original - q, exact), output_error(original - nearest, exact))
