"""Fused Triton kernels against their references, kernel by kernel.

Times rope + KV-cache write, SwiGLU and RMSNorm + residual, torch reference
vs Triton, at Llama-3.1-8B's shapes (hidden 4096, 32 heads, 8 KV heads, head
dim 128, intermediate 14336) in bfloat16, for several token counts, and
records the largest absolute difference of each Triton output from the
reference's. The FP8-rows variants of SwiGLU and RMSNorm (``plugins/fp8_rows.py``)
are timed against what an FP8 projection does without them: the plain Triton
kernel, then its per-token quantization; their difference is that of the
dequantized rows, 0 when the bytes and scales agree. On CUDA the time of one
call is the median over CUDA events after a warm-up.

    python bench/fused_kernels.py --output bench/results/h200_fused_kernels.json

``--device cpu --small`` is a smoke run on tiny shapes through Triton's
interpreter (TRITON_INTERPRET=1, set here when not given); its times mean
nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import time_us, write_report  # noqa: E402  (also puts the repository on sys.path)


@dataclass(frozen=True, slots=True)
class Shapes:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tokens_per_block: int
    max_positions: int


LLAMA_3_1_8B = Shapes(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336,
                      tokens_per_block=32, max_positions=16384)
SMALL = Shapes(hidden=256, heads=4, kv_heads=2, head_dim=32, intermediate=384, tokens_per_block=8, max_positions=256)


@dataclass(slots=True)
class Case:
    """One kernel at one token count: both implementations on the same inputs."""

    name: str
    tokens: int
    reference: Callable[[], object]
    fused: Callable[[], object]
    max_abs_diff: Callable[[], float]  # runs both once and compares their outputs
    bytes_moved: int  # the least memory traffic of one call (of the fused kernel)
    reference_name: str = "torch"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True, type=Path, help="JSON file for the results")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (through Triton's interpreter)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="auto: bfloat16 on CUDA, float32 on the CPU (the interpreter rounds bfloat16 by truncation)")
    p.add_argument("--small", action="store_true", help="tiny shapes and token counts (smoke run)")
    p.add_argument("--tokens", default=None, help="comma-separated token counts (default 1,64,256,8192; small: 1,5)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 10; small: 1)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls, median kept (default 100; small: 3)")
    args = p.parse_args(argv)
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    args.tokens = [int(t) for t in (args.tokens or ("1,5" if args.small else "1,64,256,8192")).split(",")]
    args.warmup = args.warmup if args.warmup is not None else (1 if args.small else 10)
    args.repeats = args.repeats if args.repeats is not None else (3 if args.small else 100)
    return args


def rope_case(shapes: Shapes, tokens: int, pool_slots: int, dtype, device, gen) -> Case:
    """Rotate q, k of ``tokens`` tokens and write k, v at scattered slots of a shared pool."""
    import torch

    from plugins.rope_torch import rope_and_write_kv, rope_cos_sin, rope_inv_freq
    from plugins.rope_triton import rope_and_write_kv_triton

    s = shapes
    q_size, kv_size = s.heads * s.head_dim, s.kv_heads * s.head_dim
    # q, k, v as views into one fused projection output, as the model has them.
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=gen).to(device, dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k, v = q.view(tokens, s.heads, -1), k.view(tokens, s.kv_heads, -1), v.view(tokens, s.kv_heads, -1)
    cos, sin = (t.to(device, dtype) for t in rope_cos_sin(rope_inv_freq(s.head_dim, 500000.0), s.max_positions))
    positions = torch.randint(0, s.max_positions, (tokens,), generator=gen).to(device)
    slots = torch.randperm(pool_slots, generator=gen)[:tokens].to(device)
    cache_shape = (pool_slots // s.tokens_per_block, s.tokens_per_block, s.kv_heads, s.head_dim)
    ref_k, ref_v, fused_k, fused_v = (torch.zeros(cache_shape, dtype=dtype, device=device) for _ in range(4))
    args = (q, k, v, cos, sin, positions)

    def max_abs_diff() -> float:
        ref_q = rope_and_write_kv(*args, ref_k, ref_v, slots)
        fused_q = rope_and_write_kv_triton(*args, fused_k, fused_v, slots)
        return max(_max_abs_diff(ref_q, fused_q), _max_abs_diff(ref_k, fused_k), _max_abs_diff(ref_v, fused_v))

    size = torch.finfo(dtype).bits // 8
    return Case(
        name="rope_write_kv", tokens=tokens,
        reference=lambda: rope_and_write_kv(*args, ref_k, ref_v, slots),
        fused=lambda: rope_and_write_kv_triton(*args, fused_k, fused_v, slots),
        max_abs_diff=max_abs_diff,
        # read q, k, v and the cos/sin rows; write q, k, v
        bytes_moved=tokens * size * (2 * (q_size + 2 * kv_size) + 2 * s.head_dim),
    )


def activation_case(shapes: Shapes, tokens: int, dtype, device, gen) -> Case:
    import torch

    from plugins.activation_torch import act_and_mul
    from plugins.activation_triton import act_and_mul_triton

    x = torch.randn(tokens, 2 * shapes.intermediate, generator=gen).to(device, dtype)
    size = torch.finfo(dtype).bits // 8
    return Case(
        name="swiglu", tokens=tokens,
        reference=lambda: act_and_mul(x, "silu"), fused=lambda: act_and_mul_triton(x, "silu"),
        max_abs_diff=lambda: _max_abs_diff(act_and_mul(x, "silu"), act_and_mul_triton(x, "silu")),
        bytes_moved=tokens * size * 3 * shapes.intermediate,  # read gate and up, write the product
    )


def rmsnorm_case(shapes: Shapes, tokens: int, dtype, device, gen) -> Case:
    import torch

    from plugins.norm_torch import rms_norm
    from plugins.norm_triton import rms_norm_triton

    x, residual = (torch.randn(tokens, shapes.hidden, generator=gen).to(device, dtype) for _ in range(2))
    weight = torch.randn(shapes.hidden, generator=gen).to(device, dtype)

    def max_abs_diff() -> float:
        ref_out, ref_residual = rms_norm(x, weight, 1e-5, residual)
        out, new_residual = rms_norm_triton(x, weight, 1e-5, residual)
        return max(_max_abs_diff(ref_out, out), _max_abs_diff(ref_residual, new_residual))

    size = torch.finfo(dtype).bits // 8
    return Case(
        name="rmsnorm_residual", tokens=tokens,
        reference=lambda: rms_norm(x, weight, 1e-5, residual), fused=lambda: rms_norm_triton(x, weight, 1e-5, residual),
        max_abs_diff=max_abs_diff,
        bytes_moved=size * (4 * tokens * shapes.hidden + shapes.hidden),  # read x, residual; write both back
    )


def activation_fp8_rows_case(shapes: Shapes, tokens: int, dtype, device, gen) -> Case:
    """SwiGLU storing E4M3 rows and scales, against SwiGLU and then the projection's quantizer."""
    import torch

    from executor_svc.model.llama import as_fp8_rows
    from plugins.activation_triton import act_and_mul_fp8_triton, act_and_mul_triton

    x = torch.randn(tokens, 2 * shapes.intermediate, generator=gen).to(device, dtype)

    def reference():  # what the model does for a kernel without the variant
        return as_fp8_rows(act_and_mul_triton(x, "silu"))

    def fused():
        return act_and_mul_fp8_triton(x, "silu")

    return Case(
        name="swiglu_fp8_rows", tokens=tokens, reference=reference, fused=fused, reference_name="triton + quantize",
        max_abs_diff=lambda: _dequantized_diff(reference(), fused()),
        # read gate and up, write 1-byte rows and a float32 scale per row
        bytes_moved=tokens * (2 * (torch.finfo(dtype).bits // 8) * shapes.intermediate + shapes.intermediate + 4),
    )


def rmsnorm_fp8_rows_case(shapes: Shapes, tokens: int, dtype, device, gen) -> Case:
    """RMSNorm + residual storing E4M3 rows and scales, against the norm and then the projection's quantizer."""
    import torch

    from executor_svc.model.llama import as_fp8_rows
    from plugins.norm_triton import rms_norm_fp8_triton, rms_norm_triton

    x, residual = (torch.randn(tokens, shapes.hidden, generator=gen).to(device, dtype) for _ in range(2))
    weight = torch.randn(shapes.hidden, generator=gen).to(device, dtype)

    def reference():  # what the model does for a kernel without the variant
        return as_fp8_rows(rms_norm_triton(x, weight, 1e-5, residual)[0])

    def fused():
        return rms_norm_fp8_triton(x, weight, 1e-5, residual)[0]

    size = torch.finfo(dtype).bits // 8
    return Case(
        name="rmsnorm_fp8_rows", tokens=tokens, reference=reference, fused=fused, reference_name="triton + quantize",
        max_abs_diff=lambda: _dequantized_diff(reference(), fused()),
        # read x and residual, write the residual, 1-byte rows and a float32 scale per row
        bytes_moved=tokens * (3 * size * shapes.hidden + shapes.hidden + 4) + size * shapes.hidden,
    )


def _dequantized_diff(a, b) -> float:
    """Largest difference of two ``Fp8Rows`` as the rows they stand for."""
    return _max_abs_diff(a.values.float() * a.scales, b.values.float() * b.scales)


def _max_abs_diff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def run(args: argparse.Namespace) -> dict:
    import torch
    import triton

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    shapes = SMALL if args.small else LLAMA_3_1_8B
    gen = torch.Generator().manual_seed(0)
    block = shapes.tokens_per_block
    pool_slots = 2 * block * -(-max(args.tokens) // block)  # one pool for every token count, twice the largest
    results = []
    for tokens in args.tokens:
        cases = [
            rope_case(shapes, tokens, pool_slots, dtype, device, gen),
            activation_case(shapes, tokens, dtype, device, gen),
            rmsnorm_case(shapes, tokens, dtype, device, gen),
        ]
        if dtype != torch.float32:  # the FP8-rows variants serve 16-bit rows (plugins/fp8_rows.py)
            cases += [activation_fp8_rows_case(shapes, tokens, dtype, device, gen),
                      rmsnorm_fp8_rows_case(shapes, tokens, dtype, device, gen)]
        for case in cases:
            diff = case.max_abs_diff()
            reference_us = time_us(case.reference, device, args.warmup, args.repeats)
            triton_us = time_us(case.fused, device, args.warmup, args.repeats)
            row = {
                "kernel": case.name, "tokens": tokens, "reference": case.reference_name,
                "reference_us": round(reference_us, 2), "triton_us": round(triton_us, 2),
                "speedup": round(reference_us / triton_us, 3), "max_abs_diff": diff, "bytes_moved": case.bytes_moved,
                "triton_gb_per_s": round(case.bytes_moved / triton_us / 1e3, 1),
            }
            results.append(row)
            print(f"{case.name:18s} {tokens:6d} tokens  {case.reference_name} {reference_us:9.1f} us  "
                  f"triton {triton_us:9.1f} us  x{row['speedup']:<6.2f} {row['triton_gb_per_s']:8.1f} GB/s  "
                  f"max|diff| {diff:.3g}", file=sys.stderr)
    return {
        "shapes": asdict(shapes), "dtype": args.dtype, "triton": triton.__version__,
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        "timing": {
            "warmup": args.warmup, "repeats": args.repeats,
            "method": "median of CUDA events per call" if device.type == "cuda" else "median wall clock per call",
        },
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":  # the kernels run through the interpreter; it is read when they are defined
        os.environ.setdefault("TRITON_INTERPRET", "1")
    write_report("bench/fused_kernels.py", argv, args.device, args.output, run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
