"""Weight-only quantized GEMMs for decode-sized batches (the small-M kernels take up to 16 rows), in Triton.

A decode step multiplies a handful of rows by every weight of the model once:
its time is the time to read the weights, so a quantized GEMM is only worth
its format if it streams them at HBM bandwidth. The kernels here
(plugins/quant_gemm_decode_kernels.py) are built for that: a GEMV (FMA and a
sum over K, dequantizing in registers with integer tricks instead of
conversions) for the smallest batches (one row; two for INT4),
``tl.dot`` on 16-row tiles above that, and
split-K whenever the output tiles alone cannot keep every SM streaming. Tile
choices come from plugins/quant_gemm_decode_config.py.

Registered as ``triton_decode`` for three kinds, each covering every batch
size: small batches run the kernels here, larger ones ``torch._scaled_mm`` for
FP8. INT8 and INT4 run the ``tl.dot`` kernel in tiles of up to 64 rows
(``row_block``; each tile reads the quantized weight again) up to
ROW_TILE_MAX_ROWS rows, and past that the weight dequantized to 16 bits in one
pass (plugins/quant_gemm_triton.py), then cuBLAS. On an H100 with
Llama-3.1-8B's projections (bench/results/h100_quant_gemm_int4_int8_rows_llama8b.json,
..._row_block_llama8b.json) 16-row tiles beat the dequantized path on every
projection at 32 and 64 rows (1.7-4.3x for INT4, 1.3-3.0x for INT8) and were
about even at 128; tiles of 32 and 64 rows beat both at 32 to 128 rows on every
INT4 projection (1.01-1.28x) and every INT8 one but o at 128 (0.90x); the
dequantized path won every projection at 512 and 2,048 rows, by 2.8-9.1x over
16-row tiles and, for INT4, 5-15x over the tile kernels of
plugins/quant_gemm_triton.py, which had made a 128-token INT4 prompt step take
about 100 ms against bf16's 9.5 (17 ms with the dequantized path).
Build-time selection times these against the other candidates.

FP8: ``gemm_fp8`` kernels normally get activations already quantized to FP8
(``x_scale`` given). This one declares ``weight_only_rows`` = 16, which tells
``Fp8Linear`` (executor_svc/quantization/linear.py) to pass 16-bit
activations as they are, with ``x_scale`` None, for batches up to that many
rows: at decode sizes the per-token activation quantization costs more
kernels than the GEMM saves. The choice is made on the host from the shape,
so each captured decode graph holds one path.

FP8 and INT4 GEMV tiles are chosen per weight shape at build (``tune_fp8_tactics``,
``tune_int4_tactics``: timed from CUDA graphs, recorded in the engine, installed at load by
``set_fp8_tactics`` / ``set_int4_tactics``; plugins/gemv_tactics.py), as the 16-bit GEMV's are.
Every kernel here is launched with programmatic dependent launch where the GPU has it
(plugins/pdl.py): it waits for the previous kernel only before reading activations.

Split-K scratch: each launch allocates its float32 partials (from the caching
allocator, so no kernel runs), and the per-tile arrival counters live in one
zeroed int32 buffer per device, reset by the kernels themselves. Launches
therefore must not run concurrently on two streams of one device (the engine
runs its steps on one stream). The counter buffer is made on first use
outside CUDA-graph capture; a launch captured before it exists runs unsplit.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F
import triton

from plugins import gemv_tactics
from plugins.pdl import pdl_launch_args
from plugins.quant_gemm_decode_config import (
    MAX_ROW_BLOCK, DecodeConfig, decode_config, dot_config, resolve_split, row_block,
)
from plugins.quant_gemm_decode_kernels import (
    _float_gemv_kernel, _w4a16_dot_bytes_kernel, _w4a16_dot_kernel, _w4a16_gemv_kernel, _w8a16_gemv_kernel,
    _weight_dot_kernel,
)
from plugins.quant_gemm_scaled_mm import gemm_fp8_scaled_mm
from plugins.quant_gemm_triton import dequantize_int4_triton, dequantize_int8_triton
from plugins.registry import register_kernel

MAX_ROWS = 16  # the registered kernels use the small-M kernels up to this many rows
# ... and for INT8 and INT4 the tl.dot kernel in tiles of up to MAX_ROW_BLOCK rows up to this many, where it beat
# dequantizing the weight for cuBLAS on an H100 (see the module docstring)
ROW_TILE_MAX_ROWS = 128
LOCK_SLOTS = 1 << 16  # output tiles one split launch may have (N / BLOCK_N x M tiles)
INTERPRETER_SMS = 4  # stand-in SM count on the CPU (Triton's interpreter)
# The INT4 word-plane tl.dot kernel multiplies block_k / 8 channels per dot, and a tensor-core
# dot of 16-bit inputs takes at least 16: smaller steps (groups of 32 or 64) use the byte kernel.
MIN_PLANE_BLOCK_K = 128

_locks: dict[torch.device, torch.Tensor] = {}


@lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors the split-K choice aims to fill."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_SMS


def _precision(dtype: torch.dtype) -> str:
    # float32 inputs would otherwise be multiplied in TF32 on the tensor cores (10-bit mantissa).
    return "ieee" if dtype == torch.float32 else "tf32"


def _split_locks(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The device's zeroed arrival counters, or None when this launch cannot split K."""
    locks = _locks.get(device)
    if locks is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None  # zeroing now would only be recorded into the graph, not done
        locks = _locks[device] = torch.zeros(LOCK_SLOTS, dtype=torch.int32, device=device)
    return locks if tiles <= LOCK_SLOTS else None


def _launch(
    kernel, config: DecodeConfig, x: torch.Tensor, out: torch.Tensor, n: int, k: int, tensors: tuple, strides: tuple,
    **constants,
) -> torch.Tensor:
    """Run ``kernel`` over (N tiles, K splits, M tiles) with the split-K scratch it needs; returns ``out``.

    Kernel arguments: x, ``tensors``, out, partials, counters, M, N, K, x's row stride, ``strides``, out's
    row stride, K steps per split, then the constants.
    """
    m = x.shape[0]
    row_tiles = 1 if config.fma else triton.cdiv(m, config.rows_per_tile)
    n_tiles = triton.cdiv(n, config.block_n)
    steps = triton.cdiv(k, config.block_k)
    split = max(1, min(config.split_k, steps))
    locks = _split_locks(x.device, n_tiles * row_tiles) if split > 1 else None
    if locks is None:
        split = 1
    steps_per_split = triton.cdiv(steps, split)
    split = triton.cdiv(steps, steps_per_split)  # no empty split
    partials = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    if config.fma:  # K a multiple of the step: the GEMV kernels load without K masks
        rows = {"ROWS": m, "BLOCK_M": triton.next_power_of_2(m), "EVEN_K": k % config.block_k == 0,
                "PREFETCH": config.num_stages > 1}
    else:
        rows = {"BLOCK_M": config.rows_per_tile}
    kernel[(n_tiles, split, row_tiles)](
        x, *tensors, out, partials, locks if locks is not None else out, m, n, k, x.stride(0), *strides,
        out.stride(0), steps_per_split, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=split,
        num_warps=config.num_warps, num_stages=config.num_stages, **rows, **constants, **pdl_launch_args(x.device),
    )
    return out


def _prepare(
    fmt: str, x: torch.Tensor, n: int, out_dtype: torch.dtype, config: DecodeConfig | None, group_size: int = 128,
) -> tuple[torch.Tensor, DecodeConfig, torch.Tensor]:
    """(x with unit column stride, the resolved launch config, the output to fill)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    sms = num_sms(x.device)
    config = resolve_split(config, m, n, k, sms) if config else decode_config(fmt, m, n, k, sms, group_size)
    if config.fma and m > MAX_ROWS:
        raise ValueError(f"the GEMV kernels unroll over rows and take at most {MAX_ROWS}, got {m}")
    return x, config, torch.empty((m, n), dtype=out_dtype, device=x.device)


def _dot_config(fmt: str, x: torch.Tensor, n: int, group_size: int = 128, block_m: int = 0) -> DecodeConfig:
    """The tl.dot launch, for a GEMV config whose weight cannot be read as words, or past 16 rows."""
    m, k = x.shape
    return dot_config(fmt, m, n, k, num_sms(x.device), group_size, block_m)


def _words(t: torch.Tensor) -> torch.Tensor | None:
    """Rows of bytes ``t`` viewed as int32 words, or None when its rows do not split into whole aligned words."""
    if t.shape[1] % 4 or t.stride(1) != 1 or t.stride(0) % 4 or t.data_ptr() % 4:
        return None
    return t.view(torch.int32)


def w8a16_decode(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, config: DecodeConfig | None = None
) -> torch.Tensor:
    """x [M, K] 16-bit or float32, qweight [N, K] int8, scales [N] float32 -> [M, N] in x's dtype.

    ``config`` overrides ``decode_config``'s choice (split_k 0: chosen from the SM count).
    """
    n = qweight.shape[0]
    x, config, out = _prepare("int8", x, n, x.dtype, config)
    if x.shape[0] == 0:
        return out
    k = x.shape[1]
    words = _words(qweight) if config.fma else None  # 4 channels a word: K a multiple of 4
    if words is not None:
        return _launch(_w8a16_gemv_kernel, config, x, out, n, k, (words, scales), (words.stride(0),))
    dot = _dot_config("int8", x, n) if config.fma else config
    return _launch(_weight_dot_kernel, dot, x, out, n, k, (qweight, scales), (qweight.stride(0),), PER_CHANNEL=True,
                   PRECISION=_precision(x.dtype))


def w4a16_decode(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
    pre_quant_scale: torch.Tensor | None = None, config: DecodeConfig | None = None,
) -> torch.Tensor:
    """x [M, K], qweight [N, K/2] uint8 (even channel in the low nibble), scales/zeros [N, groups] -> [M, N].

    The scales and zeros may have any strides, the same for both (e.g. [groups, N] storage, transposed).
    ``pre_quant_scale`` [K] (AWQ) multiplies x first. ``config`` as for ``w8a16_decode``; without one, a
    single row runs the tile installed for the weight's shape (``set_int4_tactics``), if any.
    """
    n = qweight.shape[0]
    config = config or _tactic(INT4_FORMAT, x, n, qweight.shape[1] * 2)
    x, config, out = _prepare("int4", x, n, x.dtype, config, group_size)
    if x.shape[0] == 0:
        return out
    if scales.stride() != zeros.stride():
        raise ValueError("INT4 scales and zeros must share one layout")
    k = x.shape[1]
    pqs = pre_quant_scale if pre_quant_scale is not None else scales  # any pointer when unused
    constants = {"GROUP": group_size, "HAS_PQS": pre_quant_scale is not None}
    words = _words(qweight)  # 8 channels a word: K a multiple of 8
    if config.fma and words is not None:
        chunk = min(group_size, config.block_k)  # channels of one group within a step
        if config.block_k % chunk or chunk % 8:
            raise ValueError(f"block_k {config.block_k} must be a multiple of min(group {group_size}, block_k)")
        if config.thread_k and (config.thread_k % 8 or chunk % config.thread_k):
            raise ValueError(f"INT4 thread_k {config.thread_k} must be a multiple of 8 (whole words) dividing "
                             f"the {chunk} channels of a group within a step")
        return _launch(_w4a16_gemv_kernel, config, x, out, n, k, (words, scales, zeros, pqs),
                       (words.stride(0), *scales.stride()), CHUNK=chunk, THREAD_K=config.thread_k, **constants)
    dot = _dot_config("int4", x, n, group_size) if config.fma else config
    if group_size % dot.block_k:
        raise ValueError(f"the INT4 tl.dot kernels step within one group: block_k {dot.block_k} must divide "
                         f"the group size {group_size}")
    # Eight dots of block_k / 8 channels each; the codes are made by setting a 16-bit float's exponent
    # bits, so float32 activations take the byte kernel.
    if words is not None and dot.block_k >= MIN_PLANE_BLOCK_K and x.element_size() == 2:
        return _launch(_w4a16_dot_kernel, dot, x, out, n, k, (words, scales, zeros, pqs),
                       (words.stride(0), *scales.stride()), PRECISION=_precision(x.dtype),
                       EVEN_K=k % dot.block_k == 0, ONE_DOT=dot.one_dot, **constants)
    return _launch(_w4a16_dot_bytes_kernel, dot, x, out, n, k, (qweight, scales, zeros, pqs),
                   (qweight.stride(0), *scales.stride()), PRECISION=_precision(x.dtype), **constants)


def fp8_weight_only_decode(
    x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype | None = None,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """x [M, K] 16-bit or float32 (not quantized), weight [N, K] float8_e4m3fn, w_scale [1] -> [M, N].

    ``config`` as for ``w8a16_decode``; without one, a single row runs the tile installed for the weight's
    shape (``set_fp8_tactics``), if any.
    """
    n = weight.shape[0]
    config = config or _tactic(FP8_FORMAT, x, n, weight.shape[1])
    x, config, out = _prepare("fp8", x, n, out_dtype or x.dtype, config)
    if x.shape[0] == 0:
        return out
    kernel, constants = ((_float_gemv_kernel, {"SCALED": True, "THREAD_K": config.thread_k}) if config.fma else
                         (_weight_dot_kernel, {"PRECISION": _precision(x.dtype), "PER_CHANNEL": False}))
    return _launch(kernel, config, x, out, n, x.shape[1], (weight, w_scale), (weight.stride(0),), **constants)


# -- per-shape GEMV tactics (plugins/gemv_tactics.py): timed at build, installed at load -----

FP8_FORMAT = "fp8"
INT4_FORMAT = "int4"


def _tiles(tiles: tuple[tuple[int, int, int], ...], stages: int, thread_k: int = 0) -> dict[str, DecodeConfig]:
    """Named one-row GEMV tiles (block_n, block_k, num_warps), e.g. "n32 k256 w4" (" t16" with thread_k 16)."""
    suffix = f" t{thread_k}" if thread_k else ""
    return {
        f"n{n} k{k} w{w}{suffix}": DecodeConfig(
            fma=True, block_n=n, block_k=k, num_warps=w, num_stages=stages, thread_k=thread_k
        )
        for n, k, w in tiles
    }


# The one-row GEMV tiles a build times per weight shape; the first of each is decode_config's default.
# FP8 tiles with a float32 accumulator per weight stay at 64 weights a thread or fewer (128 registers,
# four 4-warp programs an SM); summing each 16-byte load's 16 products in the thread first ("t16")
# needs 56-68 registers at 64 weights a thread, so wider tiles fit. On an H200 they won Llama-3.1-8B's
# qkv, gate_up and down projections (bench/results/h200_batch1_fp8_thread_sums_llama8b.json; a fixed
# split of K into 8, also timed there, never won and was dropped). INT4 keeps one accumulator per
# word (8 weights), or ("t32") per 16-byte load of four words (5% fewer instructions per weight in the
# compiled sm_90 loop), and prefetches the next step's words. On an H200 " t32" tiles won qkv, gate_up,
# down and the LM head shape, the others o (bench/results/h200_batch1_W4A16_AWQ_int4_subnormal_llama8b.json,
# where these tiles are the ones named " sn").
FP8_TACTICS = {
    **_tiles(((32, 256, 4), (16, 512, 4), (64, 256, 8), (32, 512, 8), (16, 256, 4), (32, 128, 4), (64, 128, 4)),
             stages=1),
    **_tiles(((32, 256, 4), (64, 256, 4), (32, 512, 4), (64, 256, 8), (128, 256, 8)), stages=1, thread_k=16),
}
INT4_TACTICS = {
    # (16, 256, 4): the best tile for gate_up with groups of 32 (h200_quant_gemm_int4_g32_graphs_llama8b.json)
    **_tiles(((64, 256, 4), (128, 128, 4), (128, 128, 8), (256, 128, 8), (64, 128, 4), (32, 256, 4), (128, 256, 8),
              (16, 256, 4)), stages=2),
    **_tiles(((64, 256, 4), (128, 128, 4), (128, 256, 8), (256, 128, 8), (64, 128, 4)), stages=2, thread_k=32),
}
TACTICS = {FP8_FORMAT: FP8_TACTICS, INT4_FORMAT: INT4_TACTICS}


def _tactic(fmt: str, x: torch.Tensor, n: int, k: int) -> DecodeConfig | None:
    """The tile installed for one row times an (n, k) weight of format ``fmt``, or None (the default)."""
    if x.shape[0] != 1:
        return None
    name = gemv_tactics.lookup(fmt, n, k)
    return TACTICS[fmt][name] if name else None


def set_fp8_tactics(tactics: dict[str, str]) -> None:
    """Install per-shape FP8 GEMV tactics (``shape_key`` -> an FP8_TACTICS name), e.g. from an engine."""
    gemv_tactics.install(FP8_FORMAT, tactics, FP8_TACTICS)


def set_int4_tactics(tactics: dict[str, str]) -> None:
    """Install per-shape INT4 GEMV tactics (``shape_key`` -> an INT4_TACTICS name), e.g. from an engine."""
    gemv_tactics.install(INT4_FORMAT, tactics, INT4_TACTICS)


def tune_fp8_tactics(shapes: list[tuple[int, int]], device: torch.device, dtype: torch.dtype) -> dict[str, dict]:
    """Time every FP8 GEMV tactic at one row on each (N, K) shape; install and return the fastest per shape."""

    def make_weight(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        weight = (torch.randn(n, k, generator=gen, device=device) * 0.1).to(torch.float8_e4m3fn)
        return weight, torch.ones(1, device=device)

    candidates = {
        name: lambda x, w, scale, c=config: fp8_weight_only_decode(x, w, scale, config=c)
        for name, config in FP8_TACTICS.items()
    }
    return gemv_tactics.tune(
        FP8_FORMAT, shapes, device, 1, make_weight,
        lambda k, gen: torch.randn(1, k, generator=gen, device=device, dtype=dtype), candidates,
    )


TUNE_GROUP = 128  # the group size INT4 tactics are timed with when the caller names none (AWQ's usual)


def tune_int4_tactics(
    shapes: list[tuple[int, int]], device: torch.device, dtype: torch.dtype, group_size: int = TUNE_GROUP,
) -> dict[str, dict]:
    """Time every INT4 GEMV tactic at one row on each (N, K) shape (groups of ``group_size``, an AWQ input
    scale); install and return the fastest per shape.

    The group size changes which tile wins: tactics chosen with groups of 128 cost an engine with
    groups of 32 about 14 us a Llama-3.1-8B layer against that engine's own best tiles
    (qkv 17.0 against 11.0 us; ``h200_quant_gemm_int4_g32_graphs_llama8b.json``).
    """

    def make_weight(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        packed = torch.randint(0, 256, (n, k // 2), generator=gen, device=device, dtype=torch.uint8)
        groups = -(-k // group_size)
        # [N, groups] laid out by group, as a loaded engine holds them (Int4AWQLinear.store_scales_by_group)
        scales = (torch.rand(groups, n, generator=gen, device=device) * 0.01).to(torch.float16).t()
        zeros = torch.full((groups, n), 8.0, device=device, dtype=torch.float16).t()
        return packed, scales, zeros, torch.ones(k, device=device)

    candidates = {
        name: lambda x, q, s, z, pqs, c=config: w4a16_decode(x, q, s, z, group_size, pqs, config=c)
        for name, config in INT4_TACTICS.items()
    }
    return gemv_tactics.tune(
        INT4_FORMAT, [(n, k) for n, k in shapes if k % 8 == 0], device, 0.5 + 4 / group_size, make_weight,
        lambda k, gen: torch.randn(1, k, generator=gen, device=device, dtype=dtype), candidates,
    )


# -- registered: small batches here, larger ones on the format's existing kernel ------------

_CUDA = frozenset({"cuda"})


@register_kernel(
    "gemm_w8a16", "triton_decode", device_types=_CUDA,
    description=f"Triton: split-K GEMV / 16-row tl.dot up to {MAX_ROWS} rows, tl.dot tiles of up to {MAX_ROW_BLOCK} "
                f"rows up to {ROW_TILE_MAX_ROWS}; above, the weight dequantized once for a cuBLAS GEMM",
)
def gemm_w8a16_decode(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    rows = x.shape[0]
    if rows > ROW_TILE_MAX_ROWS:  # a prompt, or a large decode batch: one cuBLAS GEMM
        return F.linear(x, dequantize_int8_triton(qweight, scales, x.dtype))
    if rows > MAX_ROWS:
        return w8a16_decode(x, qweight, scales, _dot_config("int8", x, qweight.shape[0], block_m=row_block(rows)))
    return w8a16_decode(x, qweight, scales)


@register_kernel(
    "gemm_w4a16", "triton_decode", device_types=_CUDA,
    description=f"Triton: split-K GEMV / 16-row tl.dot up to {MAX_ROWS} rows, tl.dot tiles of up to {MAX_ROW_BLOCK} "
                f"rows up to {ROW_TILE_MAX_ROWS}; above, the weight dequantized once for a cuBLAS GEMM",
)
def gemm_w4a16_decode(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
    pre_quant_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    rows = x.shape[0]
    if rows > ROW_TILE_MAX_ROWS:  # a prompt, or a large decode batch: one cuBLAS GEMM
        weight = dequantize_int4_triton(qweight, scales, zeros, group_size, x.shape[1], pre_quant_scale, x.dtype)
        return F.linear(x, weight)
    config = _dot_config("int4", x, qweight.shape[0], group_size, row_block(rows)) if rows > MAX_ROWS else None
    return w4a16_decode(x, qweight, scales, zeros, group_size, pre_quant_scale, config)


@register_kernel(
    "gemm_fp8", "triton_decode", device_types=_CUDA,
    description=f"Triton FP8-weight x 16-bit GEMV / tl.dot up to {MAX_ROWS} rows, torch._scaled_mm above",
)
def gemm_fp8_decode(
    x_q: torch.Tensor, x_scale: torch.Tensor | None, weight: torch.Tensor, w_scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    # x_scale None: x_q is the 16-bit activation itself (what Fp8Linear passes up to weight_only_rows rows).
    if x_scale is None:
        return fp8_weight_only_decode(x_q, weight, w_scale, out_dtype)
    return gemm_fp8_scaled_mm(x_q, x_scale, weight, w_scale, out_dtype)


gemm_fp8_decode.weight_only_rows = MAX_ROWS  # type: ignore[attr-defined]
