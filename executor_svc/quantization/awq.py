"""AWQ: activation-aware per-input-channel scales for INT4 weights (Lin et al., 2023).

A few input channels carry much larger activations than the rest, and the
weights that multiply them matter most. Scaling those weight columns up by
``s`` before quantization (and the activations down by ``s`` at run time, so
the product is unchanged) gives them more of the INT4 grid. AWQ picks
``s = mean|x| ** alpha`` per channel, with ``alpha`` from a grid search in
[0, 1) that minimises the error of the layer's output on calibration inputs:

    alpha* = argmin || X W^T - (X / s) Q(W * s)^T ||^2

``alpha = 0`` is plain round-to-nearest, so the search never does worse than
that on the calibration rows. Then, as the AWQ reference code does, each
group's range is shrunk by the factor (1 down to 0.5) that minimises that
group's share of the output error: clipping a few extreme weights buys a
finer grid for all the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor_svc.quantization.quantize import fake_quantize_int4, num_groups


@dataclass(slots=True)
class AWQResult:
    scale: torch.Tensor  # [in] float32: multiply W's columns by it, divide x by it
    alpha: float
    error: float  # mean squared output error at alpha
    plain_error: float  # the same at alpha = 0 (round-to-nearest)


@torch.inference_mode()
def search_awq_scale(
    samples: torch.Tensor, weight: torch.Tensor, channel_absmean: torch.Tensor, group_size: int, grid_size: int = 20,
    float_zeros: bool = False,
) -> AWQResult:
    """Grid-search the AWQ scale of one Linear from its calibration inputs.

    samples: [rows, in] inputs the layer saw; weight: [out, in]; channel_absmean: [in];
    float_zeros: the INT4 format's zeros (see ``int4_group_params``).
    """
    x = samples.float()
    w = weight.float()
    reference = x @ w.t()  # [rows, out]
    salience = channel_absmean.float().clamp(min=1e-4)
    best: AWQResult | None = None
    plain_error = 0.0
    for step in range(grid_size):
        alpha = step / grid_size
        s = salience.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()  # centre the scales around 1 so neither extreme leaves fp16 range
        dequantized = fake_quantize_int4(w * s[None, :], group_size, float_zeros=float_zeros) / s[None, :]
        error = float((x @ dequantized.t() - reference).pow(2).mean())
        if step == 0:
            plain_error = error
        if best is None or error < best.error:
            best = AWQResult(s, alpha, error, plain_error)
    assert best is not None
    best.plain_error = plain_error
    return best


@torch.inference_mode()
def search_awq_clip(
    samples: torch.Tensor, weight: torch.Tensor, group_size: int, steps: int = 10, max_shrink: float = 0.5,
    rows_per_chunk: int = 4096, float_zeros: bool = False,
) -> torch.Tensor:
    """Per-group range factors [out, groups] in [1 - max_shrink, 1] minimising each group's output error.

    samples: [rows, in] inputs of the (already AWQ-scaled) weight [out, in].
    Groups are independent, so one pass per candidate factor scores every group.
    """
    out_features, in_features = weight.shape
    groups = num_groups(in_features, group_size)
    pad = groups * group_size - in_features  # zero columns add nothing to a group's error
    x = torch.nn.functional.pad(samples.float(), (0, pad)).view(samples.shape[0], groups, group_size)
    best_clip = torch.ones(out_features, groups, device=weight.device)
    for start in range(0, out_features, rows_per_chunk):  # bounds the [rows, groups, out] error tensor
        w = weight[start : start + rows_per_chunk].float()
        best_error = torch.full((w.shape[0], groups), float("inf"), device=weight.device)
        for step in range(steps):
            factor = 1.0 - max_shrink * step / steps
            clip = torch.full((w.shape[0], groups), factor, device=weight.device)
            delta = torch.nn.functional.pad(fake_quantize_int4(w, group_size, clip, float_zeros) - w, (0, pad))
            delta = delta.view(w.shape[0], groups, group_size)
            error = torch.einsum("ngk,ogk->ogn", x, delta).pow(2).mean(dim=2)  # [out, groups]
            better = error < best_error
            best_error = torch.where(better, error, best_error)
            best_clip[start : start + rows_per_chunk][better] = factor
    return best_clip
