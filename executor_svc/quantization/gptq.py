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

from collections.abc import Callable
from dataclasses import dataclass

import torch

from executor_svc.quantization.quantize import FP8_DTYPE, FP8_MAX, INT4_MAX, INT8_MAX

# (values of one input channel [out], that channel's index) -> the grid points chosen for them [out]
ColumnGrid = Callable[[torch.Tensor, int], torch.Tensor]

GPTQ_BLOCK = 128  # channels rounded between two updates of the rest of the weight
DEFAULT_DAMP = 0.01  # added to H's diagonal, as a fraction of its mean: H of few or collinear rows is singular


def fp8_tensor_grid(scale: torch.Tensor) -> ColumnGrid:
    """FP8 E4M3 with one scale for the whole weight (``quantize_fp8_per_tensor``'s grid)."""
    def nearest(column: torch.Tensor, channel: int) -> torch.Tensor:
        return (column / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * scale

    return nearest


def int8_channel_grid(scales: torch.Tensor) -> ColumnGrid:
    """Symmetric INT8 with one scale per output channel (``quantize_int8_per_channel``'s grid)."""
    def nearest(column: torch.Tensor, channel: int) -> torch.Tensor:
        return torch.round(column / scales).clamp(-INT8_MAX, INT8_MAX) * scales

    return nearest


def int4_group_grid(scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> ColumnGrid:
    """Asymmetric INT4 per group of input channels (``int4_group_params`` / ``int4_codes``' grid)."""
    scales, zeros = scales.float(), zeros.float()

    def nearest(column: torch.Tensor, channel: int) -> torch.Tensor:
        scale, zero = scales[:, channel // group_size], zeros[:, channel // group_size]
        return ((torch.round(column / scale) + zero).clamp(0, INT4_MAX) - zero) * scale

    return nearest


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
    nearest = torch.stack([grid(w[:, j], j) for j in range(in_features)], dim=1)
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0  # an unfed channel: any value is as good, so its error goes nowhere
    order = torch.argsort(h.diagonal(), descending=True, stable=True)
    channels = order.tolist()
    w, h_perm = w[:, order], h[order][:, order]
    u = _inverse_cholesky(h_perm, damp)
    q = torch.empty_like(w)
    for start in range(0, in_features, block_size):
        end = min(start + block_size, in_features)
        block = w[:, start:end].clone()
        errors = torch.empty_like(block)
        u_block = u[start:end, start:end]
        for i in range(end - start):
            column = block[:, i]
            rounded = grid(column, channels[start + i])
            q[:, start + i] = rounded
            err = (column - rounded) / u_block[i, i]
            block[:, i:] -= err[:, None] * u_block[i, i:][None, :]
            errors[:, i] = err
        w[:, end:] -= errors @ u[start:end, end:]
    q = q[:, torch.argsort(order)]
    return GptqResult(q, output_error(original - q, exact), output_error(original - nearest, exact))
