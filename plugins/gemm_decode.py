"""16-bit GEMMs of decode-sized batches in Triton: ``x[M, K] @ W[N, K].T``, a GEMV or a 16-row tl.dot tile.

A batch-1 decode step reads every weight once and does two FLOPs per weight,
so a GEMM there is a read of the weight, and the only question is how close
to HBM bandwidth it streams. cuBLAS picks tensor-core tiles of 8 or more rows
for these shapes and, for the narrow layers (Llama-3.1-8B's o and qkv
projections), a split-K launch followed by a separate reduction kernel; on an
H200 those layers read at about 72% of the copy bandwidth.

The kernel (``_float_gemv_kernel`` of plugins/quant_gemm_decode_kernels.py, which
FP8 weights run too) streams a [BLOCK_N, BLOCK_K] tile of
the weight per step (16-byte loads along K), keeps a float32 accumulator of the
tile's shape so the cross-thread sum over K happens once per program instead of
once per step, and K is split across programs whenever the output tiles alone
would leave SMs idle. The split partials are added by the program that
arrives last (an atomic counter per tile), so there is no reduction kernel.

Registered as the ``gemm`` kind's ``triton_gemv`` (CUDA, 16-bit). Which tile
a weight shape gets, or whether it stays on cuBLAS, is a tactic timed at build
(``tune_tactics``, from executor_svc/kernel_selection.py), recorded in the
engine and installed again at load (``set_tactics``), for three row classes:

* one row (a plain decode step): the GEMV;
* two rows (a step verifying one draft): the GEMV, timed apart because the
  answer differs by model: cuBLAS was faster at two rows on every
  Llama-3.1-8B shape, while on SmolLM2-135M's small layers the GEMV, launched
  with programmatic dependent launch like the rest of the decode kernels,
  made a whole two-row forward 16% cheaper than cuBLAS's tiles did
  (bench/results/h200_round_cost_smollm2.json);
* 3 to 16 rows (verifying several drafts, or a draft tree), timed at 16
  rows: ``tl.dot`` on one 16-row tile (``dense_dot``, the FP8 and INT8
  weights' kernel with a unit scale), also launched with programmatic
  dependent launch. The GEMV does not serve them: its rows past two are
  summed across threads every step, which made a five-row forward 2.5
  times a one-row one in the same measurement (1.79 against 0.73 ms).

A row count without a timed entry (an engine built before its class was
timed) runs cuBLAS, as does anything past 16 rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plugins.quant_gemm_decode import _launch, _precision, _tiles, num_sms
from plugins.quant_gemm_decode_config import DOT_BLOCK_M, DecodeConfig, resolve_split
from plugins.quant_gemm_decode_kernels import _float_gemv_kernel, _weight_dot_kernel
from plugins import gemv_tactics
from plugins.registry import register_kernel

MAX_ROWS = 2  # the GEMV's rows: past two it sums each row across threads every step (``dense_dot`` takes them)


# The tactics a build times per weight shape (bench/dense_gemv.py sweeps the wider grid these come
# from); the first is what an untimed shape runs. num_stages 1: no prefetch across the loop, which
# measured slower for 16-bit weights on an H200. " t8": each 16-byte load's 8 products summed in the
# thread first (fewer registers, wider tiles).
TACTICS = {
    **_tiles(((32, 256, 4), (32, 128, 4), (16, 128, 8), (16, 256, 4)), stages=1),
    **_tiles(((32, 256, 4), (64, 256, 8)), stages=1, thread_k=8),
}
# tl.dot tiles for 3 to 16 rows (one 16-row tile), timed at build against cuBLAS.
# Narrow tiles too: a small model's layers have few output tiles to spread over the SMs.
DOT_TACTICS = {
    "dot n64 k128": DecodeConfig(fma=False, block_n=64, block_k=128, num_stages=3),
    "dot n32 k128": DecodeConfig(fma=False, block_n=32, block_k=128, num_stages=3),
    "dot n16 k128": DecodeConfig(fma=False, block_n=16, block_k=128, num_stages=3),
    "dot n32 k64 w2": DecodeConfig(fma=False, block_n=32, block_k=64, num_warps=2, num_stages=4),
}
CUBLAS = "cublas"
DEFAULT_CONFIG = next(iter(TACTICS.values()))
DOT_ROWS = DOT_BLOCK_M  # the row class past two: up to one tl.dot tile, keyed and timed at this many rows

_unit_scales: dict[torch.device, torch.Tensor] = {}


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, config: DecodeConfig | None = None) -> torch.Tensor:
    """x [M, K] (M <= 2), weight [N, K] in x's dtype -> [M, N] in x's dtype.

    ``config`` overrides the default tiles (split_k 0: chosen from the SM count).
    """
    x, out = _operands("dense_gemv", x, weight, MAX_ROWS)
    if x.shape[0] == 0:
        return out
    n, k = weight.shape
    config = resolve_split(config or DEFAULT_CONFIG, x.shape[0], n, k, num_sms(x.device))
    # the weight doubles as the (unread) scale pointer
    return _launch(_float_gemv_kernel, config, x, out, n, k, (weight, weight), (weight.stride(0),), SCALED=False,
                   THREAD_K=config.thread_k)


def dense_dot(x: torch.Tensor, weight: torch.Tensor, config: DecodeConfig | None = None) -> torch.Tensor:
    """x [M, K] (M <= 16), weight [N, K] in x's dtype -> [M, N] in x's dtype, on one 16-row tl.dot tile.

    ``config`` overrides the default tile (``DOT_TACTICS``' first).
    """
    x, out = _operands("dense_dot", x, weight, DOT_ROWS)
    if x.shape[0] == 0:
        return out
    n, k = weight.shape
    config = resolve_split(config or next(iter(DOT_TACTICS.values())), x.shape[0], n, k, num_sms(x.device))
    return _launch(_weight_dot_kernel, config, x, out, n, k, (weight, _unit_scale(x.device)), (weight.stride(0),),
                   PER_CHANNEL=False, PRECISION=_precision(x.dtype))


def _operands(name: str, x: torch.Tensor, weight: torch.Tensor, max_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x with unit column stride, the [M, N] output to fill) after checking what kernel ``name`` takes."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"{name} takes x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.shape[0] > max_rows:
        raise ValueError(f"{name} takes at most {max_rows} rows, got {x.shape[0]}")
    if weight.stride(1) != 1:
        raise ValueError(f"{name} needs a weight with unit stride along K")
    x = x if x.stride(-1) == 1 else x.contiguous()
    return x, torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)


def _unit_scale(device: torch.device) -> torch.Tensor:
    """A float32 1.0 on ``device``: the per-tensor scale the dot kernel multiplies by (made before any capture)."""
    scale = _unit_scales.get(device)
    if scale is None:
        scale = _unit_scales[device] = torch.ones(1, dtype=torch.float32, device=device)
    return scale


def row_class(rows: int) -> int | None:
    """The tactic table's row count for ``rows`` rows: 1, 2, ``DOT_ROWS`` (3 to 16), or None (past 16)."""
    if rows <= MAX_ROWS:
        return rows if rows >= 1 else None
    return DOT_ROWS if rows <= DOT_ROWS else None


# -- per-shape tactics: chosen by timing at build, recorded in the engine, set again at load --------

FORMAT = "dense"  # this kernel's table in plugins/gemv_tactics.py


def set_tactics(tactics: dict[str, str]) -> None:
    """Install per-shape tactics (``shape_key`` -> a TACTICS or DOT_TACTICS name, or ``CUBLAS``), e.g. from
    an engine."""
    gemv_tactics.install(FORMAT, tactics, [CUBLAS, *TACTICS, *DOT_TACTICS])


def tune_tactics(shapes: list[tuple[int, int]], device: torch.device, dtype: torch.dtype) -> dict[str, dict]:
    """Time cuBLAS against the GEMV's tiles at one and at two rows, and against the tl.dot tiles at
    ``DOT_ROWS`` rows, on each (N, K) weight shape; install and return the fastest per shape and row class.

    Returns ``shape_key`` -> {"tactic": the fastest, "timings_us": {name: microseconds}}.
    """
    cublas = {CUBLAS: lambda x, w: F.linear(x, w)}
    gemvs = {name: lambda x, w, c=config: dense_gemv(x, w, c) for name, config in TACTICS.items()}
    dots = {name: lambda x, w, c=config: dense_dot(x, w, c) for name, config in DOT_TACTICS.items()}
    _unit_scale(device)
    report = {}
    for candidates, rows in (({**cublas, **gemvs}, (1, 2)), ({**cublas, **dots}, (DOT_ROWS,))):
        report.update(gemv_tactics.tune(
            FORMAT, shapes, device, torch.finfo(dtype).bits / 8,
            make_weight=lambda n, k, gen: (torch.randn(n, k, generator=gen, device=device, dtype=dtype),),
            make_x=lambda k, gen: torch.randn(1, k, generator=gen, device=device, dtype=dtype),
            candidates=candidates, rows=rows,
        ))
    return report


@register_kernel(
    "gemm", "triton_gemv", device_types=frozenset({"cuda"}), dtypes=frozenset({torch.float16, torch.bfloat16}),
    description="Triton split-K GEMV at one or two rows, tl.dot at 3 to 16 (per-shape tactics timed at build), "
                "torch F.linear otherwise",
)
def linear_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    config = _gemv_config(x, weight) if bias is None else None
    if config is None:
        return F.linear(x, weight, bias)
    return dense_gemv(x, weight, config) if config.fma else dense_dot(x, weight, config)


def _gemv_config(x: torch.Tensor, weight: torch.Tensor) -> DecodeConfig | None:
    """The tiles for x's rows times ``weight`` (a GEMV's or a tl.dot's), or None when F.linear should run."""
    if x.dim() != 2 or weight.dtype != x.dtype or weight.stride(1) != 1:
        return None
    rows = row_class(x.shape[0])
    if rows is None:
        return None
    tactic = gemv_tactics.lookup(FORMAT, weight.shape[0], weight.shape[1], rows)
    if tactic == CUBLAS or (tactic is None and rows > 1):  # more rows leave cuBLAS only where timed faster
        return None
    if tactic is None:
        return DEFAULT_CONFIG
    if rows == DOT_ROWS:
        if x.device not in _unit_scales and x.is_cuda and torch.cuda.is_current_stream_capturing():
            return None  # its scale cannot be made inside a capture (graphs run an eager warm-up first)
        return DOT_TACTICS.get(tactic)  # a GEMV name here (a table written by hand): cuBLAS
    return TACTICS.get(tactic)
