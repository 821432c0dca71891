"""Decode speed of each quantization mode on a model shape with random weights, and KV pool capacity.

Builds a ``--load-format dummy`` engine per mode (Llama-3.1-8B's shape by
default), loads it, and times generation steps of ``--batch-size`` requests
(1 by default) through the ModelRunner directly (no scheduler, no gRPC), with
CUDA events on a GPU. Random weights are quantized at load: AWQ gets unit
per-channel scales and SmoothQuant no smoothing (there is no calibration on
random weights), which changes nothing about the arithmetic a step does, so the
timings stand. The KV-cache modes (FP8_KV, INT8_KV, FP8+FP8_KV) store a 1-byte
cache whose per-layer scales the build calibrates on the random weights over
random token ids.

Capacity: ``kv_capacity`` lists how many tokens the KV pool of ``--kv-cache-gb``
holds with a 16-bit, an FP8 and an INT8 cache (what ``load_engine`` computes
from the budget), and each mode records the pool its loaded engine got.

    python bench/quant_speed.py --device cuda --output bench/results/h200_quant_speed_llama8b.json
    python bench/quant_speed.py --device cuda --modes bf16,FP8_KV --batch-size 32 --prompt-len 2048 \
        --max-seq-len 4096 --kv-cache-gb 40     # where reading the KV cache dominates a step
    python bench/quant_speed.py --shape tiny --device cpu --decode-tokens 4   # smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import device_info, git_info, kernel_rows, log, resolve_device_and_dtype  # noqa: E402
from model_shapes import SHAPES, shape_folder  # noqa: E402
from quant_common import environment, greedy_generate, scratch_dir  # noqa: E402

import torch  # noqa: E402

from executor_svc.build_config import BuildConfig, QuantConfig  # noqa: E402
from executor_svc.builder import build_engine, resolve_dtype  # noqa: E402
from executor_svc.engine import DTYPES, RuntimeConfig, kv_pool_blocks, load_engine, resolve_device  # noqa: E402
from executor_svc.model.config import ModelConfig  # noqa: E402
from executor_svc.quantization.kv_cache import kv_cache_dtype  # noqa: E402
from kvcache.layout import KVCacheLayout  # noqa: E402

# A shape small enough for a CPU smoke run; the real ones come from model_shapes.py.
TINY = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "max_position_embeddings": 2048, "tie_word_embeddings": False,
}
# label -> (quant_algo, kv_cache_quant_algo)
MODES = {
    "bf16": ("none", "none"), "FP8": ("FP8", "none"), "W8A16": ("W8A16", "none"), "W4A16_AWQ": ("W4A16_AWQ", "none"),
    "FP8_KV": ("none", "FP8"), "INT8_KV": ("none", "INT8"), "FP8+FP8_KV": ("FP8", "FP8"),
}
KV_FORMATS = ("none", "FP8", "INT8")  # the capacity table: the engine dtype's cache, then the 1-byte ones
TOKENS_PER_BLOCK = 32


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3.1-8b", choices=[*SHAPES, "tiny"])
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="activation dtype (auto: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {list(MODES)} (bf16 = unquantized)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=1, help="requests decoded together")
    p.add_argument("--decode-tokens", type=int, default=64, help="timed generation steps")
    p.add_argument("--warmup-tokens", type=int, default=8, help="untimed generation steps first (Triton compiles here)")
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--kv-cache-gb", type=float, default=2.0, help="KV pool budget of each engine and of the table")
    p.add_argument("--plugin", action="append", default=[], metavar="KIND=NAME", help="kernel choice for the build")
    p.add_argument("--tokenizer-from", default="smollm2-135m-instruct", help="tokenizer files for the shape folder")
    p.add_argument("--work-dir", default=None)
    p.add_argument("--profile-steps", type=int, default=0,
                   help="also run this many generation steps under the torch profiler and record each mode's kernels")
    p.add_argument("--output", default=None, help="JSON file to write (default: stdout only)")
    return p.parse_args(argv)


def kv_capacity(checkpoint: Path, args: argparse.Namespace, dtype: str) -> dict:
    """Tokens the KV pool of --kv-cache-gb holds, per cache format, as load_engine sizes it."""
    config = ModelConfig.from_folder(checkpoint)
    model_dtype = DTYPES[resolve_dtype(dtype, resolve_device(args.device))]
    budget = int(args.kv_cache_gb * 2**30)
    table = {}
    for kv in KV_FORMATS:
        layout = KVCacheLayout(config.num_layers, config.num_kv_heads, config.head_dim, TOKENS_PER_BLOCK,
                               kv_cache_dtype(kv, model_dtype))
        blocks = kv_pool_blocks(budget, layout.bytes_per_block)
        table[str(layout.dtype).removeprefix("torch.")] = {
            "kv_cache_quant_algo": kv, "bytes_per_token": layout.bytes_per_block // TOKENS_PER_BLOCK,
            "blocks": blocks, "tokens": blocks * TOKENS_PER_BLOCK,
        }
    base = next(iter(table.values()))["tokens"]
    for row in table.values():
        row["tokens_vs_unquantized"] = round(row["tokens"] / base, 3)  # the first row is the engine dtype's cache
    return table


def time_mode(label: str, checkpoint: Path, args: argparse.Namespace, dtype: str, work: Path) -> dict:
    plugins = dict(item.split("=", 1) for item in args.plugin)
    quant_algo, kv_algo = MODES[label]
    build = BuildConfig(
        max_batch_size=max(8, args.batch_size), max_num_tokens=max(256, args.prompt_len * args.batch_size),
        max_seq_len=args.max_seq_len, tokens_per_block=TOKENS_PER_BLOCK, dtype=dtype,
        quant_config=QuantConfig(quant_algo, kv_algo), plugin_config=plugins,
    )
    started = time.perf_counter()
    manifest = build_engine(checkpoint, work / label, build, device=args.device, load_format="dummy", progress=False)
    engine = load_engine(work / label, RuntimeConfig(device=args.device, kv_cache_bytes=int(args.kv_cache_gb * 2**30)))
    setup_s = time.perf_counter() - started
    weight_bytes = sum(t.numel() * t.element_size() for t in [*engine.model.parameters(), *engine.model.buffers()])
    vocab = engine.model_config.vocab_size
    prompts = [[(7 * i + 3 + 11 * r) % vocab for i in range(args.prompt_len)] for r in range(args.batch_size)]
    greedy_generate(engine, prompts, args.warmup_tokens)
    step_times: list[float] = []
    greedy_generate(engine, prompts, args.decode_tokens + 1, step_times)
    ms = [t * 1e3 for t in step_times]
    kernel_profile = profile_kernels(engine, prompts, args.profile_steps) if args.profile_steps else None
    gemms = {k: c for k, c in manifest.plugins.items() if k.startswith("gemm")}
    kernels = {k: {"name": c.name, "timings_us": c.timings_us} for k, c in gemms.items()}
    kv = {
        "kv_cache_dtype": str(engine.layout.dtype).removeprefix("torch."),
        "kv_pool_tokens": engine.num_kv_blocks * engine.tokens_per_block,
        "attention_kernel": manifest.plugins["attention"].name,
    }
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {
        "quant_algo": quant_algo,
        "kv_cache_quant_algo": kv_algo,
        "decode_ms_per_token": {"p50": statistics.median(ms), "mean": statistics.fmean(ms), "min": min(ms)},
        "tokens_per_s": round(args.batch_size * 1e3 / statistics.median(ms), 2),
        "model_bytes_gib": round(weight_bytes / 2**30, 3),
        "gemm_kernels": kernels,
        **kv,
        "setup_seconds": round(setup_s, 1),
        **({"kernel_profile": kernel_profile} if kernel_profile else {}),
    }


def profile_kernels(engine, prompts: list[list[int]], steps: int, top: int = 30) -> dict:
    """Device time per generation step by kernel, over ``steps`` steps under the torch profiler.

    ``gpu_us_per_step`` is the kernels' summed time: against the timed step it shows
    how much of a step the device spends idle (waiting for the host to launch).
    """
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        greedy_generate(engine, prompts, steps + 1)  # + the context step, excluded below by per-step division
    rows = [{"kernel": r["kernel"], "calls_per_step": r["calls"], "us_per_step": r["us"]}
            for r in kernel_rows(prof, steps, top=10_000)]
    return {"steps": steps, "note": "includes the one context step spread over the steps",
            "gpu_us_per_step": round(sum(r["us_per_step"] for r in rows), 1), "kernels": rows[:top]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.device, dtype = resolve_device_and_dtype(args.device, args.dtype)
    modes = [m for m in args.modes.split(",") if m]
    if set(modes) - set(MODES):
        raise SystemExit(f"unknown modes {sorted(set(modes) - set(MODES))}; choose from {list(MODES)}")
    work = scratch_dir(args.work_dir)
    if args.shape == "tiny":
        checkpoint = work / "shape-tiny"
        checkpoint.mkdir(parents=True, exist_ok=True)
        (checkpoint / "config.json").write_text(json.dumps({"_name_or_path": "tiny", **TINY}))
    else:
        checkpoint = shape_folder(args.shape, work, args.tokenizer_from)
    capacity = kv_capacity(checkpoint, args, dtype)
    for name, row in capacity.items():
        log(f"KV pool of {args.kv_cache_gb} GiB, {name}: {row['tokens']} tokens ({row['tokens_vs_unquantized']}x)")
    results = {}
    for label in modes:
        log(f"{label}: build, load, decode {args.decode_tokens} tokens at batch {args.batch_size}")
        results[label] = time_mode(label, checkpoint, args, dtype, work)
        log(f"{label}: {results[label]['decode_ms_per_token']['p50']:.2f} ms/token")
    base = results.get("bf16")
    if base:
        for row in results.values():
            row["speedup_vs_bf16"] = round(base["decode_ms_per_token"]["p50"] / row["decode_ms_per_token"]["p50"], 3)
    report = {
        "command": " ".join(shlex.quote(a) for a in [sys.executable.rsplit("/", 1)[-1], *sys.argv]),
        "git": git_info(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": device_info(args.device),
        "environment": environment(),
        "shape": args.shape,
        "dtype": dtype,
        "settings": {k: v for k, v in vars(args).items() if k not in ("output", "work_dir", "tokenizer_from")},
        "notes": "random weights (--load-format dummy); W4A16_AWQ with unit AWQ scales, no calibration; "
        "KV-cache scales calibrated on the random weights over random token ids",
        "kv_capacity": capacity,
        "modes": results,
    }
    text = json.dumps(report, indent=2)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
