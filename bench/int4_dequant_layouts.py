"""How fast can one pass turn packed INT4 weights into 16-bit ones? Layouts of the same arithmetic, timed.

Past 128 rows an INT4 GEMM dequantizes its weight to 16 bits in one Triton pass and hands it to cuBLAS
(``plugins/quant_gemm_triton.py``). That pass reads half a byte and writes two per weight, yet on an H100 it
took about four times the INT8 pass's time (one byte read, two written) for the same weights. Every variant
below computes ``(code - zero) * scale`` (times AWQ's input scale) in float32 and rounds once, so all must be
bit-identical to the served pass; they differ only in how codes are loaded and how results are laid out:

* ``bytes`` - the served pass: each weight loads its own byte (two neighbours share one) and shifts its nibble out.
* ``words`` - one int32 word (eight codes) per load, its nibbles spread over a third axis and reshaped away,
  so a thread's eight results are contiguous and can leave in one 16-byte store.
* ``planes`` - one int32 word per load, then eight stores, one per nibble position, each a strided plane.
* ``join`` - the bytes loaded contiguously, low and high nibbles interleaved with ``tl.join``.
* ``words_k_first`` - ``words`` with the grid turned round: programs launched one after another take the
  K blocks of the same rows, so those resident together read whole rows, not a 64-byte piece of each.

Besides them: the INT8 pass over the same shapes and a plain 16-bit copy (``torch.clone``) of the dequantized
weight, as bandwidth yardsticks. Times come from CUDA graphs over more weight copies than L2 holds
(``plugins.timing.graph_time_us``), for Llama-3.1-8B's four projections (group size 128, scales stored by group
as the GEMV kernels keep them).

    python bench/int4_dequant_layouts.py --output bench/results/h100_int4_dequant_layouts_llama8b.json

On the CPU (Triton's interpreter) ``--smoke`` checks the variants' bits on tiny shapes; its times mean nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import log, write_report  # noqa: E402  (also puts the repository on sys.path)

import torch  # noqa: E402

if not torch.cuda.is_available():  # the kernels below run through Triton's interpreter; it is read as they are defined
    os.environ.setdefault("TRITON_INTERPRET", "1")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

LAYERS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
SMOKE_LAYERS = {"a": (64, 256), "b": (96, 512)}
ROTATION_BYTES = 150 << 20


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter)")
    p.add_argument("--output", type=Path, default=None)
    return p.parse_args(argv)


@triton.jit
def _weights(codes, scale_ptr, zero_ptr, pqs_ptr, rn, n_mask, k0, rk, K, stride_sn, stride_sg,
             GROUP: tl.constexpr, HAS_PQS: tl.constexpr):
    """(codes - zero) * scale [* AWQ's input scale] in float32, for codes [BLOCK_N, BLOCK_K] of one group."""
    offs = rn * stride_sn + (k0 // GROUP) * stride_sg
    scale = tl.load(scale_ptr + offs, mask=n_mask, other=0.0).to(tl.float32)
    zero = tl.load(zero_ptr + offs, mask=n_mask, other=0.0).to(tl.float32)
    w = (codes - zero[:, None]) * scale[:, None]
    if HAS_PQS:
        w *= tl.load(pqs_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)[None, :]
    return w


@triton.jit
def words_kernel(w_ptr, scale_ptr, zero_ptr, pqs_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_sg, stride_on,
                 GROUP: tl.constexpr, HAS_PQS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 K_FIRST: tl.constexpr = False):
    # w_ptr: int32 words [N, K / 8]; code j of a word (bits 4j..4j+3) is channel 8i + j. K_FIRST: neighbouring
    # programs take neighbouring K blocks of the same rows (the grid is [K blocks, N blocks]), so the programs
    # resident at once read whole rows instead of one 64-byte piece of every row.
    WORDS: tl.constexpr = BLOCK_K // 8
    if K_FIRST:
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(0)
    else:
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = pid_k * BLOCK_K
    rw = tl.arange(0, WORDS)
    rk = k0 + tl.arange(0, BLOCK_K)
    n_mask = rn < N
    words = tl.load(w_ptr + rn[:, None] * stride_wn + (k0 // 8 + rw)[None, :],
                    mask=n_mask[:, None] & ((k0 + 8 * rw) < K)[None, :], other=0)
    shifts = tl.arange(0, 8) * 4
    codes = ((words[:, :, None] >> shifts[None, None, :]) & 0xF).to(tl.float32)
    codes = tl.reshape(codes, (BLOCK_N, BLOCK_K))
    w = _weights(codes, scale_ptr, zero_ptr, pqs_ptr, rn, n_mask, k0, rk, K, stride_sn, stride_sg, GROUP, HAS_PQS)
    tl.store(out_ptr + rn[:, None] * stride_on + rk[None, :], w.to(out_ptr.dtype.element_ty),
             mask=n_mask[:, None] & (rk < K)[None, :])


@triton.jit
def planes_kernel(w_ptr, scale_ptr, zero_ptr, pqs_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_sg, stride_on,
                  GROUP: tl.constexpr, HAS_PQS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    WORDS: tl.constexpr = BLOCK_K // 8
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    rw = tl.arange(0, WORDS)
    n_mask = rn < N
    mask = n_mask[:, None] & ((k0 + 8 * rw) < K)[None, :]
    words = tl.load(w_ptr + rn[:, None] * stride_wn + (k0 // 8 + rw)[None, :], mask=mask, other=0)
    offs = rn * stride_sn + (k0 // GROUP) * stride_sg
    scale = tl.load(scale_ptr + offs, mask=n_mask, other=0.0).to(tl.float32)
    zero = tl.load(zero_ptr + offs, mask=n_mask, other=0.0).to(tl.float32)
    for j in tl.static_range(8):
        rk = k0 + 8 * rw + j
        w = (((words >> (4 * j)) & 0xF).to(tl.float32) - zero[:, None]) * scale[:, None]
        if HAS_PQS:
            w *= tl.load(pqs_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rn[:, None] * stride_on + rk[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)

@triton.jit
def join_kernel(w_ptr, scale_ptr, zero_ptr, pqs_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_sg, stride_on,
                GROUP: tl.constexpr, HAS_PQS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # w_ptr: bytes [N, K / 2]; the low nibble of byte i is channel 2i, the high one 2i + 1
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    rb = tl.arange(0, BLOCK_K // 2)
    rk = k0 + tl.arange(0, BLOCK_K)
    n_mask = rn < N
    packed = tl.load(w_ptr + rn[:, None] * stride_wn + (k0 // 2 + rb)[None, :],
                     mask=n_mask[:, None] & ((k0 + 2 * rb) < K)[None, :], other=0)
    codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK_N, BLOCK_K)).to(tl.float32)
    w = _weights(codes, scale_ptr, zero_ptr, pqs_ptr, rn, n_mask, k0, rk, K, stride_sn, stride_sg, GROUP, HAS_PQS)
    tl.store(out_ptr + rn[:, None] * stride_on + rk[None, :], w.to(out_ptr.dtype.element_ty),
             mask=n_mask[:, None] & (rk < K)[None, :])


KERNELS = {"words": words_kernel, "words_k_first": words_kernel, "planes": planes_kernel, "join": join_kernel}


def make_call(kernel, variant: str, qweight, scales, zeros, pqs, group_size: int, k: int, block_n: int, block_k: int,
              num_warps: int):
    """``call(qweight) -> weight`` for one variant and launch shape (the other tensors are fixed)."""
    def call(q):
        n = q.shape[0]
        out = torch.empty((n, k), dtype=scales.dtype, device=q.device)
        w = q if variant == "join" else q.view(torch.int32)
        grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
        extra = {"K_FIRST": True} if variant == "words_k_first" else {}
        kernel[grid[::-1] if extra else grid](
            w, scales, zeros, pqs if pqs is not None else scales, out, n, k, w.stride(0), *scales.stride(),
            out.stride(0), GROUP=group_size, HAS_PQS=pqs is not None, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=num_warps, **extra,
        )
        return out

    return call


def rotation(t: torch.Tensor, cuda: bool) -> list[torch.Tensor]:
    """``t`` and enough clones that cycling through them outgrows L2 (on a GPU; ``t`` alone on the CPU)."""
    count = max(1, -(-ROTATION_BYTES // (t.numel() * t.element_size()))) if cuda else 1
    return [t] + [t.clone() for _ in range(count - 1)]


def run(args: argparse.Namespace) -> dict:
    from plugins.quant_gemm_triton import dequantize_int4_triton, dequantize_int8_triton

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        from plugins.timing import graph_time_us
    layers = SMOKE_LAYERS if args.smoke else LAYERS
    configs = [(32, 128, 4), (64, 128, 4), (64, 128, 8), (128, 128, 8)] if not args.smoke else [(32, 128, 4)]
    rows, totals = [], {}
    for name, (n, k) in layers.items():
        gen = torch.Generator(device=device).manual_seed(n + k)
        groups = k // args.group_size
        qweight = torch.randint(0, 256, (n, k // 2), generator=gen, device=device, dtype=torch.int32).to(torch.uint8)
        scales = (torch.rand(n, groups, generator=gen, device=device) * 0.02).to(torch.bfloat16).t().contiguous().t()
        zeros = torch.randint(0, 16, (n, groups), generator=gen, device=device).to(torch.bfloat16).t().contiguous().t()
        pqs = (torch.rand(k, generator=gen, device=device) + 0.5).to(torch.bfloat16)
        int8 = torch.randint(-127, 128, (n, k), generator=gen, device=device, dtype=torch.int32).to(torch.int8)
        int8_scales = (torch.rand(n, generator=gen, device=device) * 0.02).to(torch.bfloat16)
        q_copies, i8_copies = rotation(qweight, cuda), rotation(int8, cuda)
        served = dequantize_int4_triton(qweight, scales, zeros, args.group_size, k, pqs, torch.bfloat16)
        dense_copies = rotation(served, cuda)

        def timed(call, inputs):
            if not cuda:
                return None
            calls = [lambda c=c: call(c) for c in inputs] * max(1, -(-8 // len(inputs)))
            return graph_time_us(calls, device, args.repeats, warmup=min(2, len(calls)))

        def record(variant, config, us, exact):
            moved = n * k // 2 + 2 * n * k if variant != "int8" else 3 * n * k
            if variant == "copy_bf16":
                moved = 4 * n * k
            row = {"layer": name, "n": n, "k": k, "variant": variant, "config": config, "exact": exact}
            if us is not None:
                row.update(us=round(us, 2), tb_per_s=round(moved / us / 1e6, 3))
                totals.setdefault(f"{variant} {config}", 0.0)
                totals[f"{variant} {config}"] += us
            rows.append(row)
            log(f"{name:8s} {variant:9s} {config:14s} {row.get('us', float('nan')):9.1f} us "
                f"{row.get('tb_per_s', float('nan')):6.2f} TB/s exact={exact}")

        record("bytes", "32x128 w4", timed(lambda q: dequantize_int4_triton(
            q, scales, zeros, args.group_size, k, pqs, torch.bfloat16), q_copies), True)
        record("int8", "32x128 w4", timed(lambda q: dequantize_int8_triton(q, int8_scales, torch.bfloat16), i8_copies),
               True)
        record("copy_bf16", "torch", timed(lambda w: w.clone(), dense_copies), True)
        for variant, kernel in KERNELS.items():
            for block_n, block_k, warps in configs:
                config = f"{block_n}x{block_k} w{warps}"
                call = make_call(kernel, variant, qweight, scales, zeros, pqs, args.group_size, k, block_n, block_k,
                                 warps)
                try:
                    exact = bool(torch.equal(call(qweight), served))
                    us = timed(call, q_copies)
                except Exception as exc:  # a layout Triton cannot compile is a result, not a crash
                    rows.append({"layer": name, "variant": variant, "config": config,
                                 "error": f"{type(exc).__name__}: {exc}"[:500]})
                    log(f"{name:8s} {variant:9s} {config:14s} failed: {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                record(variant, config, us, exact)
    return {"settings": vars(args) | {"output": str(args.output) if args.output else None}, "results": rows,
            "layer_sums_us": {key: round(v, 1) for key, v in sorted(totals.items(), key=lambda kv: kv[1])}}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    payload = run(args)
    if args.output:
        write_report("bench/int4_dequant_layouts.py", argv, args.device, args.output, payload)
    inexact = [r for r in payload["results"] if r.get("exact") is False]
    for key, us in payload["layer_sums_us"].items():
        log(f"sum of the four layers: {key:24s} {us:9.1f} us")
    return 1 if inexact else 0


if __name__ == "__main__":
    raise SystemExit(main())
