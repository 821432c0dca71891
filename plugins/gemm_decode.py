"""16-bit GEMV for decode-sized batches: ``x[M, K] @ W[N, K].T`` with M of 1 or 2, in Triton.

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

Registered as the ``gemm`` kind's ``triton_gemv`` (CUDA, 16-bit): one row runs
the GEMV, three or more rows run F.linear. Which tile a weight shape gets, or
whether it stays on cuBLAS, is a tactic timed at build (``tune_tactics``, from
executor_svc/kernel_selection.py), recorded in the engine and installed again
at load (``set_tactics``). Two rows (a step verifying one draft) are timed
apart, because the answer differs by model: cuBLAS was faster at two rows on
every Llama-3.1-8B shape, while on SmolLM2-135M's small layers the GEMV,
launched with programmatic dependent launch like the rest of the decode
kernels, made a whole two-row forward cheaper than cuBLAS's tiles did. Two
rows with no timed entry (an engine built before they were timed) stay on
cuBLAS.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plugins.quant_gemm_decode import _launch, num_sms
from plugins.quant_gemm_decode_config import DecodeConfig, resolve_split
from plugins.quant_gemm_decode_kernels import _float_gemv_kernel
from plugins import gemv_tactics
from plugins.registry import register_kernel

MAX_ROWS = 2  # above this the GEMV's per-row FMAs cost more than cuBLAS's tensor-core tiles save


def _config(block_n: int, block_k: int, num_warps: int) -> DecodeConfig:
    # num_stages 1: no prefetch across the loop; it measured slower for 16-bit weights on an H200.
    return DecodeConfig(fma=True, block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=1)


# The tactics a build times per weight shape (bench/dense_gemv.py sweeps the wider grid these come
# from); the first is what an untimed shape runs.
TACTICS = {
    "n32 k256 w4": _config(32, 256, 4),
    "n32 k128 w4": _config(32, 128, 4),
    "n16 k128 w8": _config(16, 128, 8),
    "n16 k256 w4": _config(16, 256, 4),
}
CUBLAS = "cublas"
DEFAULT_CONFIG = next(iter(TACTICS.values()))


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, config: DecodeConfig | None = None) -> torch.Tensor:
    """x [M, K] (M <= 2), weight [N, K] in x's dtype -> [M, N] in x's dtype.

    ``config`` overrides the default tiles (split_k 0: chosen from the SM count).
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"dense_gemv takes x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    m, k = x.shape
    if m > MAX_ROWS:
        raise ValueError(f"dense_gemv takes at most {MAX_ROWS} rows, got {m}")
    if weight.stride(1) != 1:
        raise ValueError("dense_gemv needs a weight with unit stride along K")
    x = x if x.stride(-1) == 1 else x.contiguous()
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    config = resolve_split(config or DEFAULT_CONFIG, m, n, k, num_sms(x.device))
    # the weight doubles as the (unread) scale pointer
    return _launch(_float_gemv_kernel, config, x, out, n, k, (weight, weight), (weight.stride(0),), SCALED=False)


# -- per-shape tactics: chosen by timing at build, recorded in the engine, set again at load --------

FORMAT = "dense"  # this kernel's table in plugins/gemv_tactics.py


def set_tactics(tactics: dict[str, str]) -> None:
    """Install per-shape tactics (``shape_key`` -> a TACTICS name or ``CUBLAS``), e.g. from an engine."""
    gemv_tactics.install(FORMAT, tactics, [CUBLAS, *TACTICS])


def tune_tactics(shapes: list[tuple[int, int]], device: torch.device, dtype: torch.dtype) -> dict[str, dict]:
    """Time cuBLAS and every tactic at one and at two rows on each (N, K) weight shape; install and return
    the fastest.

    Returns ``shape_key`` -> {"tactic": the fastest, "timings_us": {name: microseconds}}.
    """
    candidates = {CUBLAS: lambda x, w: F.linear(x, w)}
    candidates.update({name: lambda x, w, c=config: dense_gemv(x, w, c) for name, config in TACTICS.items()})
    return gemv_tactics.tune(
        FORMAT, shapes, device, torch.finfo(dtype).bits / 8,
        make_weight=lambda n, k, gen: (torch.randn(n, k, generator=gen, device=device, dtype=dtype),),
        make_x=lambda k, gen: torch.randn(1, k, generator=gen, device=device, dtype=dtype),
        candidates=candidates, rows=(1, 2),
    )


@register_kernel(
    "gemm", "triton_gemv", device_types=frozenset({"cuda"}), dtypes=frozenset({torch.float16, torch.bfloat16}),
    description="Triton split-K GEMV at one or two rows (per-shape tactic timed at build), torch F.linear otherwise",
)
def linear_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    config = _gemv_config(x, weight) if bias is None else None
    return dense_gemv(x, weight, config) if config is not None else F.linear(x, weight, bias)


def _gemv_config(x: torch.Tensor, weight: torch.Tensor) -> DecodeConfig | None:
    """The tiles for x's rows times ``weight``, or None when F.linear should run."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS or weight.dtype != x.dtype or weight.stride(1) != 1:
        return None
    rows = x.shape[0]
    tactic = gemv_tactics.lookup(FORMAT, weight.shape[0], weight.shape[1], rows)
    if tactic == CUBLAS or (tactic is None and rows > 1):  # two rows run the GEMV only where timed faster
        return None
    return TACTICS[tactic] if tactic else DEFAULT_CONFIG
