"""What Triton makes of a kernel for Hopper, without a GPU: instructions, tensor-core ops, shared memory.

Compiles kernels for sm_90 with Triton's bundled ptxas (no GPU needed) and counts, per kernel:
the SASS instructions by opcode, global loads and stores by width, warpgroup MMAs (``HGMMA``) and
warp MMAs (``HMMA``), and in the Triton GPU IR the dots, ``warp_group_dot`` ops, shared-memory
allocations and layout conversions, plus the shared memory and spills the compiled kernel needs.
A static view only: it says where work is and whether a change removes it (e.g. that a tile's
eight dots each store their operand to shared memory and wait for their wgmma), never how fast
a kernel runs. Times come from the GPU benchmarks.

The cases: the INT4 dequantizing pass as served and its layouts in ``int4_dequant_layouts.py``,
against the INT8 pass; the INT4 ``tl.dot`` kernel with eight plane dots and with one dot a step
(``DecodeConfig.one_dot``) at 16, 32 and 64 rows, against the INT8 one.

    python bench/sm90_kernel_census.py --output bench/results/cpu_sm90_kernel_census_int4.json
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
from pathlib import Path

# Compile for real (a GPU-less machine may have the interpreter switched on for the tests).
os.environ["TRITON_INTERPRET"] = "0"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import log, write_report  # noqa: E402  (also puts the repository on sys.path)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)(\.[A-Z0-9_.]+)?")


def compile_for_hopper(kernel, types: dict[str, str], constants: dict, num_warps: int = 4, num_stages: int = 2):
    """``kernel`` compiled for sm_90: arguments not in ``constants`` are pointers as ``types`` names them, else
    int32, 16-byte aligned / divisible by 16 as a launch on Llama's shapes specializes them (but M)."""
    signature = {name: ("constexpr" if name in constants else types.get(name, "i32")) for name in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
             if name not in constants and name not in ("M", "N")}
    return triton.compile(ASTSource(kernel, signature, constexprs=constants, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})


def census(compiled) -> dict:
    """Counts of one compiled kernel (see the module docstring)."""
    import tempfile

    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([str(nvdisasm), "-c", cubin.name], capture_output=True, text=True, check=True).stdout
    opcodes, memory = collections.Counter(), collections.Counter()
    for line in sass.splitlines():
        match = INSTRUCTION.match(line)
        if match is None:
            continue
        opcode, suffix = match.group(1), match.group(2) or ""
        opcodes[opcode] += 1
        if opcode in ("LDG", "STG", "LDS", "STS", "LDGSTS", "STL", "LDL"):
            memory[opcode + suffix] += 1
    ttgir = compiled.asm["ttgir"]
    return {
        "sass_instructions": sum(opcodes.values()),
        "hgmma": opcodes["HGMMA"], "hmma": opcodes["HMMA"],
        "memory_instructions": dict(sorted(memory.items())),
        "ttgir": {op: ttgir.count(op) for op in ("tt.dot ", "warp_group_dot ", "warp_group_dot_wait", "local_alloc",
                                                 "convert_layout")},
        "shared_bytes": compiled.metadata.shared,
        "spills": opcodes["STL"] + opcodes["LDL"],
        "top_opcodes": dict(opcodes.most_common(12)),
    }


def cases() -> list[tuple[str, object, dict, dict, dict]]:
    """(name, kernel, pointer types, constants, launch options [and weights per thread for a per-weight count])."""
    import int4_dequant_layouts as layouts

    from plugins import quant_gemm_decode_kernels as K
    from plugins import quant_gemm_triton as Q

    out = []
    int4 = {"w_ptr": "*u8", "scale_ptr": "*bf16", "zero_ptr": "*bf16", "pqs_ptr": "*bf16", "out_ptr": "*bf16"}
    group = {"GROUP": 128, "HAS_PQS": True, "BLOCK_N": 32, "BLOCK_K": 128}
    per_thread = {"weights_per_thread": 32 * 128 // 128}
    out.append(("int4 dequant: bytes (served)", Q._int4_dequant_kernel, int4, group, per_thread))
    for name, kernel, extra in (("words", layouts.words_kernel, {"K_FIRST": False}),
                                ("words_k_first", layouts.words_kernel, {"K_FIRST": True}),
                                ("planes", layouts.planes_kernel, {}), ("join", layouts.join_kernel, {})):
        types = int4 if name == "join" else {**int4, "w_ptr": "*i32"}
        out.append((f"int4 dequant: {name}", kernel, types, {**group, **extra}, per_thread))
    out.append(("int8 dequant (served)", Q._int8_dequant_kernel, {"w_ptr": "*i8", "scale_ptr": "*bf16", "out_ptr": "*bf16"},
                {"BLOCK_N": 32, "BLOCK_K": 128}, per_thread))
    dot = {"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 1, "PRECISION": "tf32", "PDL": False}
    x = {"x_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32", "lock_ptr": "*i32", "pqs_ptr": "*bf16",
         "scale_ptr": "*bf16", "zero_ptr": "*bf16"}
    for rows in (16, 32, 64):
        for one_dot in (False, True):
            constants = {**dot, "BLOCK_M": rows, "GROUP": 128, "HAS_PQS": True, "EVEN_K": True, "ONE_DOT": one_dot}
            name = f"int4 tl.dot {rows} rows: {'one dot' if one_dot else 'eight plane dots'}"
            out.append((name, K._w4a16_dot_kernel, {**x, "w_ptr": "*i32"}, constants, {"num_stages": 3}))
        out.append((f"int8 tl.dot {rows} rows", K._weight_dot_kernel, {**x, "w_ptr": "*i8", "scale_ptr": "*fp32"},
                    {**dot, "BLOCK_M": rows, "PER_CHANNEL": True}, {"num_stages": 3}))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = []
    for name, kernel, types, constants, extra in cases():
        options = {key: extra[key] for key in ("num_warps", "num_stages") if key in extra}
        try:
            row = {"kernel": name, "constants": constants, **census(compile_for_hopper(kernel, types, constants, **options))}
        except Exception as exc:  # a kernel that does not compile is a finding, not a crash
            rows.append({"kernel": name, "error": f"{type(exc).__name__}: {str(exc)[:400]}"})
            log(f"{name:42s} failed: {type(exc).__name__}")
            continue
        if "weights_per_thread" in extra:
            row["sass_instructions_per_weight"] = round(row["sass_instructions"] / extra["weights_per_thread"], 2)
        rows.append(row)
        log(f"{name:42s} {row['sass_instructions']:5d} SASS, {row['hgmma']} HGMMA, {row['hmma']} HMMA, "
            f"{row['ttgir']['warp_group_dot ']} wgmma ops, {row['ttgir']['local_alloc']} smem allocs, "
            f"{row['shared_bytes']} B shared, {row['spills']} spills")
    if args.output:
        write_report("bench/sm90_kernel_census.py", argv, "cpu", args.output,
                     {"target": "sm_90 (Triton's bundled ptxas)", "triton": triton.__version__, "kernels": rows})
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
