"""Quantized GEMMs at decode sizes: every candidate against bf16, and tile variants of the small-M kernels.

Llama-3.1-8B's linear layers (N x K: qkv 6144x4096, o 4096x4096, gate_up
28672x4096, down 4096x14336) with random weights quantized three ways: INT8
per output channel (W8A16), INT4 in groups of 128 with unit AWQ scales
(W4A16_AWQ), FP8 E4M3 per tensor (FP8), times M rows of bfloat16 activations
(default 1, 2, 4, 8, 16, 64).

``results``: per layer and rows, bf16 ``F.linear`` and every registered
candidate of the three GEMM kinds, each called as its quantized Linear module
calls it (FP8: the ``scaled_mm`` candidate quantizes the activations per
token first; ``triton_decode`` multiplies 16-bit activations directly up to
16 rows), with the time, the weight bytes read per second (quantized weight
and its scales), the speedup over bf16, and the largest difference from the
format's torch reference relative to the reference's largest value.

Past 16 rows, ``row_tiles`` times INT8 and INT4 through the 16-row ``tl.dot`` kernel over
every row tile (the weight read once per tile) and ``row_block`` through tiles of up to 64 rows,
beside the path that dequantizes the weight once for cuBLAS: where each wins sets how far the
decode kernels should reach. ``row_block_one_dot`` (INT4) is ``row_block`` with each step's codes
built whole for one dot instead of eight dots of one nibble plane (``DecodeConfig.one_dot``), and the
tl.dot variants up to 16 rows include ``dot one_dot``.

``variants``: the small-M kernels of plugins/quant_gemm_decode.py under tile
variants (one knob at a time around the defaults of
plugins/quant_gemm_decode_config.py: BLOCK_N, BLOCK_K, split-K, warps,
stages), the GEMV ones up to 4 rows and the tl.dot ones up to 16; ``best``
names the fastest per format, layer and rows next to the default's time, and
``summary`` adds the four layers up per format and rows (a decoder layer's
GEMMs). Those are what to copy into quant_gemm_decode_config.py.

On a GPU, times come from one CUDA graph that calls the kernel back to back on
copies of the layer's weights, more copies than L2 holds, so every call reads
its weights from HBM and no launch overhead counts, as in a decode step (which
reads every weight once and replays a graph): the median of ``--repeats``
replays, divided by the calls. Timing each call between CUDA events instead
measured the host's kernel launch (Triton's launcher takes longer than these
kernels run) and spread the same tile over 12 to 85 us. On the CPU, the median
wall clock of one call.

    python bench/quant_gemm_kernels.py --output bench/results/h200_quant_gemm_kernels.json

``--device cpu --smoke`` runs tiny shapes through Triton's interpreter
(TRITON_INTERPRET=1, set here when not given); its times mean nothing.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import log, time_us, write_report  # noqa: E402  (also puts the repository on sys.path)

LLAMA_3_1_8B_LAYERS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
# Smoke shapes: N and K off the tile sizes, K a multiple of 8 (INT4 words) on one layer only.
SMOKE_LAYERS = {"qkv": (96, 256), "down": (40, 200)}
# format -> (plugin kind, quant_algo)
FORMATS = {"int8": ("gemm_w8a16", "W8A16"), "int4": ("gemm_w4a16", "W4A16_AWQ"), "fp8": ("gemm_fp8", "FP8")}
GEMV_MAX_ROWS = 4  # GEMV variants are timed up to this many rows, tl.dot variants up to MAX_ROWS


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True, type=Path, help="JSON file for the results")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (through Triton's interpreter)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="activations; auto: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--smoke", "--small", dest="smoke", action="store_true", help="tiny shapes (smoke run)")
    p.add_argument("--rows", default=None, help="comma-separated row counts (default 1,2,4,8,16,64; smoke: 1,3)")
    p.add_argument("--layers", default=None, help=f"comma-separated layers (default all: {','.join(LLAMA_3_1_8B_LAYERS)})")
    p.add_argument("--formats", default=",".join(FORMATS), help="comma-separated weight formats: int8,int4,fp8")
    p.add_argument("--group-size", type=int, default=128, help="INT4 input channels per scale and zero")
    p.add_argument("--no-variants", action="store_true", help="skip the tile variants of the small-M kernels")
    p.add_argument("--include-reference", action="store_true",
                   help="also time the torch references (dequantize the whole weight; always on with --smoke)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 10; smoke: 1)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs (CUDA graph replays on a GPU), median kept (default 50; smoke: 2)")
    args = p.parse_args(argv)
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    layers = SMOKE_LAYERS if args.smoke else LLAMA_3_1_8B_LAYERS
    names = args.layers.split(",") if args.layers else list(layers)
    unknown = [name for name in names if name not in layers]
    if unknown:
        p.error(f"unknown layers {unknown}; choose from {list(layers)}")
    args.layers = {name: layers[name] for name in names}
    args.formats = args.formats.split(",")
    if any(fmt not in FORMATS for fmt in args.formats):
        p.error(f"--formats takes {list(FORMATS)}")
    args.rows = [int(r) for r in (args.rows or ("1,3" if args.smoke else "1,2,4,8,16,64")).split(",")]
    args.include_reference = args.include_reference or args.smoke
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 10)
    args.repeats = args.repeats if args.repeats is not None else (2 if args.smoke else 50)
    return args


@dataclass(frozen=True, slots=True)
class Variant:
    """A launch of a small-M kernel: ``config`` with split_k 0 (auto), or ``split`` "none" / "double"."""

    label: str
    config: object  # DecodeConfig
    split: str = "auto"


def variants(fmt: str, smoke: bool, group_size: int) -> list[Variant]:
    """One knob at a time around the format's default GEMV and tl.dot tiles, then the one-row GEMV tactics
    a build times per shape (plugins/quant_gemm_decode.py)."""
    from plugins.quant_gemm_decode import TACTICS
    from plugins.quant_gemm_decode_config import DOT_TILES, FMA_TILES

    def around(kind: str, base) -> list[Variant]:
        out = [Variant(f"{kind} default", base), Variant(f"{kind} no split", base, "none"),
               Variant(f"{kind} split x2", base, "double")]
        if smoke:
            return out
        for block_n in (16, 32, 64, 128):
            if block_n != base.block_n:
                out.append(Variant(f"{kind} block_n {block_n}", replace(base, block_n=block_n)))
        block_ks = (128, 256, 512) if base.fma else (64, 128, 256)
        for block_k in block_ks:
            if block_k != base.block_k and not (fmt == "int4" and not base.fma and block_k > group_size):
                out.append(Variant(f"{kind} block_k {block_k}", replace(base, block_k=block_k)))
        for warps in (2, 8):
            out.append(Variant(f"{kind} warps {warps}", replace(base, num_warps=warps)))
        for stages in ((1, 2) if base.fma else (2, 4)):
            if stages != base.num_stages:
                out.append(Variant(f"{kind} stages {stages}", replace(base, num_stages=stages)))
        return out

    tactics = [] if smoke else [Variant(f"tactic {name}", config) for name, config in TACTICS.get(fmt, {}).items()]
    dot = DOT_TILES[fmt]
    one_dot = []
    if fmt == "int4":  # the INT4 tl.dot kernels step within one group
        dot = replace(dot, block_k=min(dot.block_k, group_size))
        one_dot = [Variant("dot one_dot", replace(dot, one_dot=True))]
    return around("gemv", FMA_TILES[fmt]) + around("dot", dot) + one_dot + tactics


def weight_bytes(fmt: str, n: int, k: int, group_size: int = 128) -> int:
    """Bytes a GEMM in ``fmt`` must read for its weight: the codes and their scales (and AWQ's input scale)."""
    if fmt == "bf16":
        return 2 * n * k
    if fmt == "int8":
        return n * k + 4 * n
    if fmt == "int4":
        return n * k // 2 + 2 * 2 * n * -(-k // group_size) + 4 * k
    return n * k + 4  # fp8


def _rel_diff(out, expected) -> float:
    scale = expected.float().abs().max().item() or 1.0
    return (out.float() - expected.float()).abs().max().item() / scale


# The weight copies a timing cycles through add up to at least this many bytes: three times an
# H100/H200's L2 (50 MiB), so each call's weights have left L2 before they are read again.
ROTATION_BYTES = 150 << 20
MIN_GRAPH_CALLS = 8  # a graph replay this long dwarfs the events around it


class Timer:
    """Times calls as the module docstring says."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.device = torch.device(args.device)
        self.args = args

    def copies(self, nbytes: int) -> int:
        """How many copies of ``nbytes`` of weights a timing cycles through (1 on the CPU)."""
        return max(1, -(-ROTATION_BYTES // max(1, nbytes))) if self.device.type == "cuda" else 1

    def __call__(self, fn: Callable[[object], object], copies: list) -> float:
        """Microseconds per ``fn(copy)``."""
        if self.device.type != "cuda":
            return time_us(lambda: fn(copies[0]), self.device, self.args.warmup, self.args.repeats)
        from plugins.timing import graph_time_us

        calls = [lambda c=c: fn(c) for c in copies] * -(-MIN_GRAPH_CALLS // len(copies))
        return graph_time_us(calls, self.device, self.args.repeats, warmup=min(len(calls), self.args.warmup))


def _runs_here(spec, device, dtype) -> bool:
    # Under the CPU interpreter the Triton kernels run too (slowly); torch._scaled_mm needs a GPU.
    interpreted = device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    return spec.supports(device, dtype) or (interpreted and spec.name.startswith("triton"))


def measure_layer(name: str, n: int, k: int, args: argparse.Namespace, timer: Timer) -> tuple[list[dict], list[dict]]:
    """All candidates and variants on one layer shape: (results rows, variant rows)."""
    import torch
    import torch.nn.functional as F

    from executor_svc.quantization.kernel_choice import quantized_layer
    from executor_svc.quantization.linear import weight_only_rows
    from plugins.quant_gemm_decode_config import row_block
    from plugins.quant_gemm_torch import gemm_fp8
    from plugins.registry import get_kernel, list_kernels

    device, dtype = timer.device, getattr(torch, args.dtype)
    gen = torch.Generator(device=device).manual_seed(n * 7 + k)
    weight = torch.randn(n, k, generator=gen, device=device) * k**-0.5
    layers = {fmt: quantized_layer(FORMATS[fmt][0], weight, get_kernel(FORMATS[fmt][0], "torch", device, torch.float32).fn,
                                   args.group_size) for fmt in args.formats}
    dense = weight.to(dtype)
    del weight
    dense_copies = [dense] + [dense.clone() for _ in range(timer.copies(weight_bytes("bf16", n, k)) - 1)]
    layer_copies = {fmt: [layer] + [copy.deepcopy(layer) for _ in range(timer.copies(
        weight_bytes(fmt, n, k, args.group_size)) - 1)] for fmt, layer in layers.items()}
    results, variant_rows = [], []
    for rows in args.rows:
        x = torch.randn(rows, k, generator=gen, device=device).to(dtype)
        base = {"layer": name, "n": n, "k": k, "rows": rows}
        bf16_us = timer(lambda w: F.linear(x, w), dense_copies)
        results.append({**base, "format": "bf16", "impl": "torch F.linear", "us": round(bf16_us, 2),
                        "weight_gb_per_s": round(weight_bytes("bf16", n, k) / bf16_us / 1e3, 1), "speedup_vs_bf16": 1.0})
        for fmt in args.formats:
            kind, layer = FORMATS[fmt][0], layers[fmt]
            reference_kernel = layer.kernel
            reference = layer(x)
            for spec in (s for s in list_kernels() if s.kind == kind):
                if not _runs_here(spec, device, dtype) or (spec.name == "torch" and not args.include_reference):
                    continue
                if spec.name == "scaled_mm":
                    from plugins.quant_gemm_scaled_mm import scaled_mm_supported

                    if not scaled_mm_supported(device):
                        continue
                for c in layer_copies[fmt]:
                    c.kernel = spec.fn
                expected = reference
                if rows <= weight_only_rows(spec.fn):  # FP8 weight-only: compare with unquantized activations
                    expected = gemm_fp8(x, None, layer.weight, layer.weight_scale, dtype)
                try:
                    diff = _rel_diff(layer(x), expected)
                    us = timer(lambda c: c(x), layer_copies[fmt])
                except Exception as exc:  # a candidate that refuses the shape is a result, not a crash
                    results.append({**base, "format": fmt, "impl": spec.name, "error": f"{type(exc).__name__}: {exc}"})
                    continue
                finally:
                    for c in layer_copies[fmt]:
                        c.kernel = reference_kernel
                results.append({
                    **base, "format": fmt, "impl": spec.name, "us": round(us, 2),
                    "weight_gb_per_s": round(weight_bytes(fmt, n, k, args.group_size) / us / 1e3, 1),
                    "speedup_vs_bf16": round(bf16_us / us, 3), "max_rel_diff": diff,
                })
                log(f"{name:8s} M={rows:<3d} {fmt:5s} {spec.name:14s} {us:9.1f} us  x{bf16_us / us:5.2f} vs bf16 "
                    f"{bf16_us:8.1f} us")
            # The alternatives to dequantizing past 16 rows: 16-row tiles (the weights read once per 16 rows),
            # and tiles of up to 64 rows (read once per 64); for INT4 also those tiles with each step's codes
            # built whole for one dot (``one_dot``).
            tilings = [("row_tiles", 0, False), ("row_block", row_block(rows), False)]
            if fmt == "int4":
                tilings.append(("row_block_one_dot", row_block(rows), True))
            for impl, block_m, one_dot in tilings:
                call = row_tile_call(fmt, x, args.group_size, block_m, one_dot)
                if call is None:
                    continue
                try:
                    diff = _rel_diff(call(layer), reference)
                    us = timer(call, layer_copies[fmt])
                except Exception as exc:  # e.g. a tile that does not fit: recorded, not fatal
                    results.append({**base, "format": fmt, "impl": impl, "error": f"{type(exc).__name__}: {exc}"})
                    continue
                results.append({
                    **base, "format": fmt, "impl": impl, "block_m": block_m or 16, "us": round(us, 2),
                    "weight_gb_per_s": round(weight_bytes(fmt, n, k, args.group_size) / us / 1e3, 1),
                    "speedup_vs_bf16": round(bf16_us / us, 3), "max_rel_diff": diff,
                })
                log(f"{name:8s} M={rows:<3d} {fmt:5s} {impl:14s} {us:9.1f} us  x{bf16_us / us:5.2f} vs bf16")
            if not args.no_variants:
                variant_rows += measure_variants(fmt, layer_copies[fmt], x, base, args, timer)
    return results, variant_rows


def row_tile_call(fmt: str, x, group_size: int, block_m: int = 0,
                  one_dot: bool = False) -> Callable[[object], object] | None:
    """Past 16 rows: the layer through the ``tl.dot`` kernel over tiles of ``block_m`` rows (0: 16), each
    tile reading the quantized weight again (INT4 with ``one_dot``: one dot a step). None for FP8 and up to
    16 rows."""
    from plugins import quant_gemm_decode as decode
    from plugins.quant_gemm_decode_config import dot_config

    rows, k = x.shape
    if rows <= decode.MAX_ROWS or fmt not in ("int8", "int4"):
        return None
    sms = decode.num_sms(x.device)

    def config(n: int):
        return replace(dot_config(fmt, rows, n, k, sms, group_size, block_m), one_dot=one_dot)

    if fmt == "int8":
        return lambda c: decode.w8a16_decode(x, c.qweight, c.scales, config(c.qweight.shape[0]))
    return lambda c: decode.w4a16_decode(x, c.qweight, c.scales, c.zeros, group_size, c.pre_quant_scale,
                                         config(c.qweight.shape[0]))


def measure_variants(fmt: str, layers: list, x, base: dict, args: argparse.Namespace, timer: Timer) -> list[dict]:
    """The small-M kernel of ``fmt`` under each applicable tile variant, on the weights of ``layers``
    (copies of one layer; the first is the one checked against the reference)."""
    import torch

    from plugins import quant_gemm_decode as decode
    from plugins.quant_gemm_decode_config import MIN_SPLIT_STEPS, decode_config, resolve_split
    from plugins.quant_gemm_torch import gemm_fp8, gemm_w4a16, gemm_w8a16

    rows, n, k = x.shape[0], base["n"], base["k"]
    if rows > decode.MAX_ROWS:
        return []
    sms = decode.num_sms(x.device)
    layer = layers[0]
    # call(config, weights): the kernel on one copy's weights (the tuple ``weights(copy)`` gives)
    if fmt == "int8":
        expected = gemm_w8a16(x, layer.qweight, layer.scales)
        weights = lambda c: (c.qweight, c.scales)  # noqa: E731
        call = lambda config, w: decode.w8a16_decode(x, *w, config)  # noqa: E731
    elif fmt == "int4":
        group = args.group_size
        expected = gemm_w4a16(x, layer.qweight, layer.scales, layer.zeros, group, layer.pre_quant_scale)
        weights = lambda c: (c.qweight, c.scales, c.zeros)  # noqa: E731
        call = lambda config, w: decode.w4a16_decode(  # noqa: E731
            x, *w, group, layer.pre_quant_scale, config)
    else:
        expected = gemm_fp8(x, None, layer.weight, layer.weight_scale, x.dtype)
        weights = lambda c: (c.weight, c.weight_scale)  # noqa: E731
        call = lambda config, w: decode.fp8_weight_only_decode(x, *w, x.dtype, config)  # noqa: E731
    copies = [weights(c) for c in layers]
    default = decode_config(fmt, rows, n, k, sms, args.group_size)
    out = []
    runs = [(variant, copies) for variant in variants(fmt, args.smoke, args.group_size)]
    if fmt == "int4":
        # The GEMVs again with the scales and zeros stored [groups, N] (read transposed): a step's
        # groups then come from whole lines of N, not a few bytes of each output channel's row.
        by_group = [(q, s.t().contiguous().t(), z.t().contiguous().t()) for q, s, z in copies]
        runs += [(replace(variant, label=f"{variant.label}, scales [groups, N]"), by_group)
                 for variant, _ in runs if variant.config.fma and variant.split == "auto"]
    for variant, run_copies in runs:
        if variant.config.fma and rows > GEMV_MAX_ROWS:
            continue
        config = resolve_split(variant.config, rows, n, k, sms)
        if variant.split == "none":
            config = replace(config, split_k=1)
        elif variant.split == "double":
            steps = -(-k // config.block_k)
            if steps // (2 * config.split_k) < MIN_SPLIT_STEPS // 2:
                continue  # splits of one step or less: not a variant worth timing
            config = replace(config, split_k=2 * config.split_k)
        try:
            diff = _rel_diff(call(config, run_copies[0]), expected)
            us = timer(lambda w: call(config, w), run_copies)
        except Exception as exc:  # e.g. a tile that does not fit: recorded, not fatal
            out.append({**base, "format": fmt, "variant": variant.label, "config": config.describe(),
                        "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            continue
        out.append({
            **base, "format": fmt, "variant": variant.label, "config": config.describe(),
            "is_default": config == default, "us": round(us, 2),
            "weight_gb_per_s": round(weight_bytes(fmt, n, k, args.group_size) / us / 1e3, 1), "max_rel_diff": diff,
        })
        if x.device.type == "cuda":
            torch.cuda.synchronize()
    fastest = min((row for row in out if "us" in row), key=lambda row: row["us"], default=None)
    if fastest is not None:
        log(f"{base['layer']:8s} M={rows:<3d} {fmt:5s} variants: fastest {fastest['variant']!r} {fastest['us']:.1f} us "
            f"({fastest['weight_gb_per_s']:.0f} GB/s)")
    return out


def best_variants(variant_rows: list[dict]) -> dict:
    """format -> layer -> rows -> the fastest variant, and the default config's time."""
    best: dict = {}
    for row in variant_rows:
        if "us" not in row:
            continue
        slot = best.setdefault(row["format"], {}).setdefault(row["layer"], {}).setdefault(str(row["rows"]), {})
        if "us" not in slot or row["us"] < slot["us"]:
            slot.update({"variant": row["variant"], "config": row["config"], "us": row["us"],
                         "weight_gb_per_s": row["weight_gb_per_s"]})
        if row.get("is_default"):
            slot["default_us"] = row["us"]
    return best


def summarize(results: list[dict]) -> dict:
    """format -> rows -> the four layers' times added up, per implementation, and the best one's speedup."""
    totals: dict = {}
    for row in results:
        if "us" in row:
            totals.setdefault(str(row["rows"]), {}).setdefault(row["format"], {}).setdefault(row["impl"], []).append(
                row["us"])
    summary: dict = {}
    for rows, by_format in totals.items():
        count = len(by_format.get("bf16", {}).get("torch F.linear", []))
        bf16 = sum(by_format.get("bf16", {}).get("torch F.linear", [])) or None
        for fmt, impls in by_format.items():
            complete = {impl: sum(times) for impl, times in impls.items() if len(times) == count}
            if fmt == "bf16" or not complete or bf16 is None:
                continue
            fastest = min(complete, key=complete.__getitem__)
            summary.setdefault(fmt, {})[rows] = {
                "layers_us": {impl: round(t, 2) for impl, t in complete.items()}, "bf16_us": round(bf16, 2),
                "fastest": fastest, "speedup_vs_bf16": round(bf16 / complete[fastest], 3),
            }
    return summary


def run(args: argparse.Namespace) -> dict:
    import torch
    import triton

    from plugins import quant_gemm_decode as decode
    from plugins import quant_gemm_decode_config as tiles

    timer = Timer(args)
    results, variant_rows = [], []
    for name, (n, k) in args.layers.items():
        layer_results, layer_variants = measure_layer(name, n, k, args, timer)
        results += layer_results
        variant_rows += layer_variants
        if timer.device.type == "cuda":
            torch.cuda.empty_cache()
    return {
        "layers": {name: {"n": n, "k": k} for name, (n, k) in args.layers.items()}, "rows": args.rows,
        "formats": {fmt: FORMATS[fmt][1] for fmt in args.formats}, "group_size": args.group_size, "dtype": args.dtype,
        "triton": triton.__version__, "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        "num_sms": decode.num_sms(timer.device),
        "defaults": {
            "FMA_MAX_ROWS": tiles.FMA_MAX_ROWS, "FMA_TILES": {f: c.describe() for f, c in tiles.FMA_TILES.items()},
            "DOT_TILES": {f: c.describe() for f, c in tiles.DOT_TILES.items()},
            "PROGRAMS_PER_SM": tiles.PROGRAMS_PER_SM, "MIN_SPLIT_STEPS": tiles.MIN_SPLIT_STEPS,
            "MAX_SPLIT": tiles.MAX_SPLIT,
        },
        "timing": {
            "warmup": args.warmup, "repeats": args.repeats,
            "method": (f"one CUDA graph of back-to-back calls over weight copies of at least {ROTATION_BYTES >> 20} "
                       f"MiB in all; median of the replays per call" if timer.device.type == "cuda"
                       else "median wall clock per call"),
        },
        "summary": summarize(results), "best": best_variants(variant_rows), "results": results,
        "variants": variant_rows,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":  # the kernels run through the interpreter; it is read when they are defined
        os.environ.setdefault("TRITON_INTERPRET", "1")
    write_report("bench/quant_gemm_kernels.py", argv, args.device, args.output, run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
