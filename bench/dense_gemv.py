"""16-bit GEMMs at batch 1 and 2: cuBLAS (``F.linear``) against the Triton GEMV of plugins/gemm_decode.py.

Llama-3.1-8B's linear layers (N x K: qkv 6144x4096, o 4096x4096, gate_up
28672x4096, down 4096x14336, lm_head 128256x4096) in bfloat16 with random
weights, times 1 or 2 rows. For each layer and row count: cuBLAS, the GEMV at
the tactics a build chooses among per shape, and the GEMV under a grid of tile
variants (BLOCK_N, BLOCK_K, warps, prefetch; split-K from the SM count), with
the weight bytes read per second and their share of the copy bandwidth
measured in the same run.

Timing is what a decode step sees: the calls are captured in one CUDA graph
(``plugins.timing.graph_time_us``, which build-time kernel and tactic
selection use too) that cycles over enough copies of the weight (at least 512 MiB) that
every call reads its weight from HBM, not L2, and back-to-back launches pay
the graph's gaps between kernels; the time per call is the replay time over
the calls (median of the repeats).

    python bench/dense_gemv.py --output bench/results/h200_dense_gemv_llama8b.json

``--device cpu --smoke`` runs tiny shapes through Triton's interpreter
(TRITON_INTERPRET=1, set here when not given); its times mean nothing.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import log, measure_copy_bandwidth, write_report  # noqa: E402  (also puts the repository on sys.path)

LAYERS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
SMOKE_LAYERS = {"qkv": (96, 256), "down": (40, 200)}
MIN_BYTES = 512 << 20  # weight copies per graph: enough that L2 (60 MB on an H200) holds none of them


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True, type=Path, help="JSON file for the results")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (through Triton's interpreter)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, two variants (smoke run)")
    p.add_argument("--rows", default="1,2", help="comma-separated row counts (at most 2)")
    p.add_argument("--layers", default=None, help=f"comma-separated layers (default all: {','.join(LAYERS)})")
    p.add_argument("--repeats", type=int, default=None, help="graph replays timed, median kept (default 20)")
    args = p.parse_args(argv)
    layers = SMOKE_LAYERS if args.smoke else LAYERS
    names = args.layers.split(",") if args.layers else list(layers)
    if unknown := [name for name in names if name not in layers]:
        p.error(f"unknown layers {unknown}; choose from {list(layers)}")
    args.layers = {name: layers[name] for name in names}
    args.rows = [int(r) for r in args.rows.split(",")]
    args.repeats = args.repeats or (2 if args.smoke else 20)
    return args


def variants(smoke: bool) -> list[tuple[str, object]]:
    """(label, DecodeConfig) pairs: the tactics a build chooses from, then a grid around them."""
    from plugins.gemm_decode import DEFAULT_CONFIG, TACTICS

    out = [(f"tactic {name}", config) for name, config in TACTICS.items()]
    if smoke:
        return out[:1] + [("block_k 64 no split", replace(DEFAULT_CONFIG, block_k=64, split_k=1))]
    for block_n, block_k, warps, stages in itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (1, 2)):
        config = replace(DEFAULT_CONFIG, block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages)
        # at most 32 KiB of weights per step; prefetch (stages 2) only at the narrowest tiles
        if config not in TACTICS.values() and block_n * block_k <= 16384 and (stages == 1 or block_n * block_k <= 4096):
            out.append((f"n{block_n} k{block_k} w{warps} s{stages}", config))
    return out


def time_calls(fn, weights: list, device, repeats: int) -> float:
    """Microseconds per ``fn(weight)`` over the weight copies: from one CUDA graph on a GPU, wall clock on the CPU."""
    import time

    if device.type == "cuda":
        from plugins.timing import graph_time_us

        return graph_time_us([lambda w=w: fn(w) for w in weights], device, repeats)
    fn(weights[0])
    start = time.perf_counter()
    for w in weights:
        fn(w)
    return (time.perf_counter() - start) * 1e6 / len(weights)


def measure_layer(name: str, n: int, k: int, args: argparse.Namespace, device, bandwidth: float | None) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from plugins.gemm_decode import dense_gemv

    repeats = args.repeats
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(n * 7 + k)
    weight_bytes = n * k * 2
    copies = max(2, -(-MIN_BYTES // weight_bytes)) if device.type == "cuda" else 2
    weights = [(torch.randn(n, k, generator=gen, device=device) * k**-0.5).to(dtype) for _ in range(copies)]
    rows_out = []
    for rows in args.rows:
        x = torch.randn(rows, k, generator=gen, device=device).to(dtype)
        expected = F.linear(x.float(), weights[0].float())
        scale = expected.abs().max().item() or 1.0

        def row(impl: str, us: float, config=None, out=None) -> dict:
            gbps = weight_bytes / us / 1e3
            entry = {"layer": name, "n": n, "k": k, "rows": rows, "impl": impl, "us": round(us, 2),
                     "weight_gb_per_s": round(gbps, 1)}
            if bandwidth:
                entry["share_of_copy_bandwidth"] = round(gbps / bandwidth, 3)
            if config is not None:
                entry["config"] = config.describe()
            if out is not None:
                entry["max_rel_diff"] = float(f"{(out.float() - expected).abs().max().item() / scale:.3g}")
            return entry

        rows_out.append(row("cublas", time_calls(lambda w: F.linear(x, w), weights, device, repeats),
                            out=F.linear(x, weights[0])))
        best = None
        for label, config in variants(args.smoke):
            us = time_calls(lambda w, c=config: dense_gemv(x, w, c), weights, device, repeats)
            entry = row(f"gemv {label}", us, config, dense_gemv(x, weights[0], config))
            rows_out.append(entry)
            if best is None or us < best["us"]:
                best = entry
        log(f"{name} rows {rows}: cublas {rows_out[-len(variants(args.smoke)) - 1]['us']} us, "
            f"GEMV default {rows_out[-len(variants(args.smoke))]['us']} us, best {best['impl']} {best['us']} us")
    del weights
    return rows_out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    from tqdm import tqdm

    device = torch.device(args.device)
    bandwidth = measure_copy_bandwidth(args.device) / 1e9 if device.type == "cuda" else None
    results = []
    for name, (n, k) in tqdm(args.layers.items(), desc="layers", file=sys.stderr):
        results += measure_layer(name, n, k, args, device, bandwidth)
    from plugins.gemm_decode import TACTICS

    first_tactic = next(iter(TACTICS))
    best = {}
    for entry in results:
        key = f"{entry['layer']} rows {entry['rows']}"
        if entry["impl"] == "cublas":
            best[key] = {"cublas_us": entry["us"]}
        elif entry["impl"] == f"gemv tactic {first_tactic}":
            best[key]["gemv_default_us"] = entry["us"]
        if entry["impl"] != "cublas" and entry["us"] < best[key].get("gemv_best_us", float("inf")):
            best[key].update(gemv_best_us=entry["us"], gemv_best=entry["impl"], gemv_best_config=entry["config"])
    for key, entry in best.items():
        entry["speedup_default_vs_cublas"] = round(entry["cublas_us"] / entry["gemv_default_us"], 3)
        entry["speedup_best_vs_cublas"] = round(entry["cublas_us"] / entry["gemv_best_us"], 3)
    write_report("bench/dense_gemv.py", argv, args.device, args.output, {
        "copy_bandwidth_gb_per_s": round(bandwidth, 1) if bandwidth else None,
        "note": "copy bandwidth: bytes read + written per second by a device-to-device copy "
                "(bench_common.measure_copy_bandwidth, as bench/offline_throughput.py's batch-1 limit); shares are weight bytes read per second over it. "
                "gemv_default is the first tactic (what a shape a build did not time runs)",
        "best": best, "results": results,
    })


if __name__ == "__main__":
    main()
