"""An INT4 x bfloat16 decode GEMM on Hopper's wgmma, timed beside the INT4 GEMV tiles (an experiment).

The INT4 GEMV (plugins/quant_gemm_decode_kernels.py) is bound by instructions, about 3.4 per weight
in its sm_90 loop, most of them the FMA and the unpacking of each weight. This kernel hands the
multiply to the tensor cores instead: weights are the register A operand of ``tl.dot`` (output
channels as M), x the B operand (its rows padded to 16). Inline PTX turns two words into eight
bf16x2 registers, plane j holding nibble j of both: one PRMT per byte position, then per plane one
LOP3 that writes 128 + q under bfloat16's exponent (exact) and one add of -(128 + z), so q - z is
exact too; 1.5 instructions per weight. Each plane is one dot of K = BLOCK_K / 8 against x's channels
8 i + j, and the group's scale multiplies each step's sum in float32.

Result on an H200 (bench/results/h200_int4_wgmma_experiment_llama8b.json): correct (the same error as
the GEMV), but 1.7-2.1x slower on every Llama-3.1-8B shape at one row (gate_up 52.7 against 28.8 us)
and 1.0-1.7x slower at two rows. The compiled loop is 2.9-3.4 instructions per weight (3.3-3.8 with
the AWQ input scale), no fewer than the GEMV's: Triton stages each plane's B tile through shared
memory with its own fence, barrier and wgmma wait, eight times a step.
Not used by the engine; kept so the figures can be reproduced. Run on a GPU:
``python bench/int4_wgmma_experiment.py`` (writes the JSON to $OUT, or /tmp).
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from executor_svc.quantization.quantize import dequantize_int4_groupwise  # noqa: E402
from plugins import gemv_tactics  # noqa: E402
from plugins import quant_gemm_decode as D  # noqa: E402
from plugins.pdl import enter  # noqa: E402
from plugins.quant_gemm_decode_config import DecodeConfig  # noqa: E402
from plugins.quant_gemm_decode_kernels import _write_tile  # noqa: E402


@triton.jit
def _int4_planes(words, zz):
    # pack=2: two adjacent words a ($8), b ($9) of one row; $10: -(128 + z) twice, as bf16x2.
    # Output j: (nibble j of a, nibble j of b) - z as bf16x2. 0x4300 | q is 128 + q, exact.
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 v0, v1, v2, v3, u;
        prmt.b32 v0, $8, $9, 0x4400;
        prmt.b32 v1, $8, $9, 0x5511;
        prmt.b32 v2, $8, $9, 0x6622;
        prmt.b32 v3, $8, $9, 0x7733;
        lop3.b32 u, v0, 0x000F000F, 0x43004300, 0xEA;
        add.rn.bf16x2 $0, u, $10;
        shr.u32 v0, v0, 4;
        lop3.b32 u, v0, 0x000F000F, 0x43004300, 0xEA;
        add.rn.bf16x2 $1, u, $10;
        lop3.b32 u, v1, 0x000F000F, 0x43004300, 0xEA;
        add.rn.bf16x2 $2, u, $10;
        shr.u32 v1, v1, 4;
        lop3.b32 u, v1, 0x000F000F, 0x43004300, 0xEA;
        add.rn.bf16x2 $3, u, $10;
        lop3.b32 u, v2, 0x000F000F, 0x43004300, 0xEA;
        add.rn.bf16x2 $4, u, $10;
        shr.u32 v2, v2, 4;
        lop3.b32 u, v2, 0x000F000F, 0x43004300, 0xEA;
        add.rn.bf16x2 $5, u, $10;
        lop3.b32 u, v3, 0x000F000F, 0x43004300, 0xEA;
        add.rn.bf16x2 $6, u, $10;
        shr.u32 v3, v3, 4;
        lop3.b32 u, v3, 0x000F000F, 0x43004300, 0xEA;
        add.rn.bf16x2 $7, u, $10;
        }
        """,
        constraints="=r,=r,=r,=r,=r,=r,=r,=r,r,r,r",
        args=[words, zz],
        dtype=(tl.bfloat16,) * 8,
        is_pure=True,
        pack=2,
    )


@triton.jit
def _x_plane(x_cols, j: tl.constexpr, pqs_cols, x_mask, HAS_PQS: tl.constexpr):
    x = tl.load(x_cols + j, mask=x_mask, other=0.0)
    if HAS_PQS:
        x = (x.to(tl.float32) * tl.load(pqs_cols + j)).to(tl.bfloat16)
    return x


@triton.jit
def _w4a16_wgmma_kernel(
    x_ptr, w_ptr, scale_ptr, zero_ptr, pqs_ptr, out_ptr, part_ptr, lock_ptr,
    M, N, K, stride_xm, stride_wn, stride_sn, stride_om, steps_per_split,
    GROUP: tl.constexpr, HAS_PQS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    PDL: tl.constexpr,
):
    # BLOCK_K == GROUP: a step is one group. Plane j of a step's words [BLOCK_N, WORDS] is the codes of
    # channels 8 i + j; (q - z) in bf16 is exact, so the dots are exact sums of x (q - z), scaled per step.
    WORDS: tl.constexpr = BLOCK_K // 8
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    rw = tl.arange(0, WORDS)
    first = tl.program_id(1) * steps_per_split
    last = tl.minimum(first + steps_per_split, tl.cdiv(K, BLOCK_K))
    n_mask = rn < N
    w_rows = w_ptr + rn[:, None] * stride_wn + rw[None, :]
    x_cols = x_ptr + rm[None, :] * stride_xm + 8 * rw[:, None]   # [WORDS, BLOCK_M]: channel 8 i of each word
    pqs_cols = pqs_ptr + 8 * rw[:, None]
    x_mask = rm[None, :] < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    enter(PDL)
    for step in range(first, last):
        k0 = step * BLOCK_K
        current = tl.load(w_rows + step * WORDS, mask=n_mask[:, None], other=0)
        group_offs = rn * stride_sn + k0 // GROUP
        scale = tl.load(scale_ptr + group_offs, mask=n_mask, other=0.0).to(tl.float32)
        zero = tl.load(zero_ptr + group_offs, mask=n_mask, other=0.0).to(tl.float32)
        zz = tl.broadcast_to((-128.0 - zero).to(tl.bfloat16)[:, None], (BLOCK_N, WORDS))
        p0, p1, p2, p3, p4, p5, p6, p7 = _int4_planes(current, zz)
        xs = x_cols + k0
        ps = pqs_cols + k0
        d = tl.dot(p0, _x_plane(xs, 0, ps, x_mask, HAS_PQS))
        d = tl.dot(p1, _x_plane(xs, 1, ps, x_mask, HAS_PQS), d)
        d = tl.dot(p2, _x_plane(xs, 2, ps, x_mask, HAS_PQS), d)
        d = tl.dot(p3, _x_plane(xs, 3, ps, x_mask, HAS_PQS), d)
        d = tl.dot(p4, _x_plane(xs, 4, ps, x_mask, HAS_PQS), d)
        d = tl.dot(p5, _x_plane(xs, 5, ps, x_mask, HAS_PQS), d)
        d = tl.dot(p6, _x_plane(xs, 6, ps, x_mask, HAS_PQS), d)
        d = tl.dot(p7, _x_plane(xs, 7, ps, x_mask, HAS_PQS), d)
        acc += d * scale[:, None]
    _write_tile(tl.trans(acc), rm, rn, M, N, out_ptr, stride_om, part_ptr, lock_ptr, SPLIT_K)


dev = torch.device("cuda")
G = 128


def mma(kernel, config):
    def run(x, q, s, z, pqs):
        n = q.shape[0]
        words = q.view(torch.int32)
        x2, cfg, out = D._prepare("int4", x, n, x.dtype, config, G)
        return D._launch(kernel, cfg, x2, out, n, x2.shape[1], (words, s, z, pqs), (words.stride(0), s.stride(0)),
                         GROUP=G, HAS_PQS=pqs is not None)
    return run


def main() -> None:
    candidates = {name: (lambda x, q, s, z, pqs, c=c: D.w4a16_decode(x, q, s, z, G, pqs, config=c))
                  for name, c in D.INT4_TACTICS.items()}
    for bn, w, st in ((64, 4, 1), (128, 4, 1), (128, 8, 1), (256, 8, 1), (128, 4, 2), (256, 8, 2)):
        config = DecodeConfig(fma=False, block_n=bn, block_k=128, num_warps=w, num_stages=st)
        candidates[f"mma n{bn} w{w} s{st}"] = mma(_w4a16_wgmma_kernel, config)

    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
    result = {"command": "python bench/int4_wgmma_experiment.py", "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name(), "correctness": {}, "timings": {}}
    result["triton"] = triton.__version__

    # correctness on three shapes, at 1, 2 and 5 rows, with a non-trivial AWQ scale and random zeros
    gen = torch.Generator(device=dev).manual_seed(1)
    for n, k in ((4096, 4096), (6144, 4096), (4096, 14336)):
        packed = torch.randint(0, 256, (n, k // 2), generator=gen, device=dev, dtype=torch.uint8)
        scales = (torch.rand(n, k // G, generator=gen, device=dev) * 0.02 + 0.001).to(torch.float16)
        zeros = torch.randint(0, 16, (n, k // G), generator=gen, device=dev).to(torch.float16)
        pqs = torch.rand(k, generator=gen, device=dev) + 0.5
        w = dequantize_int4_groupwise(packed, scales, zeros, G)
        for rows in (1, 2, 5):
            x = torch.randn(rows, k, generator=gen, device=dev).to(torch.bfloat16)
            ref = (x.float() * pqs) @ w.T
            scale = ref.abs().max().item()
            errs = {}
            for name in ["n64 k256 w4", "mma n128 w4 s1", "mma n256 w8 s1", "mma n64 w4 s1", "mma n256 w8 s2"]:
                try:
                    out = candidates[name](x, packed, scales, zeros, pqs).float()
                    errs[name] = round((out - ref).abs().max().item() / scale, 6)
                except Exception as exc:
                    errs[name] = f"{type(exc).__name__}: {str(exc)[:400]}"
            result["correctness"][f"{n}x{k}@{rows}"] = errs
            print(n, k, rows, errs, flush=True)

    for rows in (1, 2):
        t0 = time.time()
        rep = gemv_tactics.tune(
            "int4", shapes, dev, 0.5 + 4 / G,
            lambda n, k, g: (torch.randint(0, 256, (n, k // 2), generator=g, device=dev, dtype=torch.uint8),
                             (torch.rand(n, k // G, generator=g, device=dev) * 0.01).to(torch.float16),
                             torch.full((n, k // G), 8.0, device=dev, dtype=torch.float16), torch.ones(k, device=dev)),
            lambda k, g: torch.randn(1, k, generator=g, device=dev, dtype=torch.bfloat16),
            {name: c for name, c in candidates.items() if rows == 1 or name.startswith("mma") or name == "n64 k256 w4"},
            rows=(rows,))
        for key, entry in rep.items():
            t = entry["timings_us"]
            gemv = {a: b for a, b in t.items() if not a.startswith("mma")}
            mm = {a: b for a, b in t.items() if a.startswith("mma")}
            best_g = min(gemv, key=gemv.get) if gemv else None
            best_m = min(mm, key=mm.get) if mm else None
            print(key, "best gemv", best_g, gemv.get(best_g), "best mma", best_m, mm.get(best_m), flush=True)
            result["timings"][key] = entry
        print("rows", rows, "took", round(time.time() - t0, 1), flush=True)

    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "h200_int4_wgmma_experiment_llama8b.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
