"""Where the GPU time of a large-batch step goes: kernels by category, for a decode and a context step.

Builds the engine the offline benchmark builds (a model shape with random weights, any
weight and KV-cache quantization), fills it with ``--batch-size`` requests of
``--context`` tokens through the executor's runner, then, under the torch profiler:

- ``decode``: steps in which every request computes one token (CUDA-graph replays unless
  ``--enforce-eager``), with ``--context`` tokens already cached;
- ``context``: steps that prefill ``--prefill-requests`` new prompts of ``--context``
  tokens each (``--max-num-tokens`` rows), as the offline benchmark's waves do.

For each, the step's wall time (the steps back to back, then one synchronize), the kernels' summed time,
and the kernels grouped into categories (GEMM, attention, norm, rotary, activation,
activation quantization, sampling, copies), with the GEMMs' achieved TFLOP/s.

  python bench/step_kernels.py --shape llama-3.1-8b --quant-algo FP8 --kv-cache-quant-algo FP8 \
      --batch-size 1024 --context 192 --output bench/results/h200_step_kernels_fp8_llama8b.json
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_common import kernel_rows, log, write_report  # noqa: E402
from model_shapes import add_model_source_args, default_load_format, resolve_model_source  # noqa: E402

# Kernel name patterns, first match wins. Names come from cuBLAS/CUTLASS, torch and this
# project's Triton kernels (plugins/), whose function names say what they do.
CATEGORIES: list[tuple[str, str]] = [
    ("attention", r"attn|attention|_decode_split|_decode_merge|_context_kernel|flash"),
    ("activation_quant", r"quant(?!ize_kv)|_scale_rows|per_token"),
    ("gemm", r"gemm|gemv|nvjet|cutlass|sm90_xmma|xmma|_weight_|matmul|_dot_kernel|splitk|cublas"),
    ("norm", r"rms|norm"),
    ("rotary", r"rope|rotary"),
    ("kv_write", r"kv|cache|slot"),
    ("activation", r"silu|swiglu|gelu|act"),
    ("sampling", r"argmax|softmax|topk|top_k|sort|multinomial|exponential|sample|max_"),
    ("copy", r"copy|fill|index|gather|scatter|cat|elementwise|vectorized|reduce"),
]


def category(kernel: str) -> str:
    name = kernel.lower()
    for label, pattern in CATEGORIES:
        if re.search(pattern, name):
            return label
    return "other"


def gemm_flops_per_token(config: dict) -> float:
    """Multiply-add FLOPs of the layers' matrices for one token (the LM head not counted)."""
    h, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or h // config["num_attention_heads"]
    qkv = h * head_dim * (config["num_attention_heads"] + 2 * config["num_key_value_heads"])
    return 2.0 * layers * (qkv + head_dim * config["num_attention_heads"] * h + 3 * h * inter)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_source_args(p)
    p.add_argument("--device", default="cuda", help="cuda (cpu runs the steps but sees no kernels: a smoke test)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quant-algo", default="none")
    p.add_argument("--kv-cache-quant-algo", default="none")
    p.add_argument("--batch-size", type=int, default=1024, help="requests in each decode step")
    p.add_argument("--context", type=int, default=192, help="tokens cached per request (and per new prompt)")
    p.add_argument("--prefill-requests", type=int, default=64, help="new prompts per context step")
    p.add_argument("--max-num-tokens", type=int, default=8192)
    p.add_argument("--tokens-per-block", type=int, default=32)
    p.add_argument("--kv-cache-fraction", type=float, default=0.9)
    p.add_argument("--steps", type=int, default=20, help="profiled steps of each kind")
    p.add_argument("--top", type=int, default=25, help="kernels listed per step kind")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--plugin", action="append", default=[], metavar="KIND=NAME")
    p.add_argument("--output", type=Path, required=True)
    args = p.parse_args(argv)
    default_load_format(args)
    return args


def main(argv: list[str] | None = None) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from tqdm import tqdm

    from executor_svc.build_config import BuildConfig, QuantConfig
    from executor_svc.engine_cache import build_cached
    from executor_svc.engine import RuntimeConfig, load_engine
    from executor_svc.runner import ModelRunner
    from inflight.model_store import default_cache_dir
    from protos.plan import CachedRequest, NewRequest, SamplingConfig, StepPlan

    args = parse_args(argv)
    per_step = max(1, args.max_num_tokens // args.context)
    if args.prefill_requests > per_step:  # a context step never holds more rows than the scheduler plans
        log(f"--prefill-requests {args.prefill_requests} x {args.context} tokens passes --max-num-tokens:"
            f" {per_step} instead")
        args.prefill_requests = per_step
    checkpoint, config = resolve_model_source(args)
    build = BuildConfig(
        max_batch_size=args.batch_size, max_num_tokens=args.max_num_tokens, tokens_per_block=args.tokens_per_block,
        max_seq_len=args.context + args.steps * 2 + 64, dtype=args.dtype,
        plugin_config=dict(item.split("=", 1) for item in args.plugin),
        quant_config=QuantConfig(args.quant_algo, args.kv_cache_quant_algo),
    )
    engine_dir = build_cached(checkpoint, build, default_cache_dir(), args.device, args.load_format)
    engine = load_engine(engine_dir, RuntimeConfig(device=args.device, kv_cache_fraction=args.kv_cache_fraction,
                                                   cuda_graphs=not args.enforce_eager))
    runner = ModelRunner(engine)
    vocab = config["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    blocks_per_request = -(-(args.context + args.steps * 2 + 32) // args.tokens_per_block)
    total = args.batch_size + args.prefill_requests * (args.steps + 2)
    if total * blocks_per_request > engine.num_kv_blocks:
        raise SystemExit(f"{total} requests of {blocks_per_request} blocks do not fit {engine.num_kv_blocks} KV blocks")
    state = {"step": 0, "next_block": 0, "next_id": 0}

    def new_requests(count: int) -> list[NewRequest]:
        out = []
        for _ in range(count):
            first = state["next_block"]
            state["next_block"] += blocks_per_request
            rid = f"r{state['next_id']}"
            state["next_id"] += 1
            prompt = torch.randint(1000, min(vocab, 32000), (args.context,), generator=gen).tolist()
            out.append(NewRequest(rid, prompt, args.context, 0, args.context,
                                  list(range(first, first + blocks_per_request)), SamplingConfig(temperature=0.0)))
        return out

    def execute(plan_fn) -> None:
        state["step"] += 1
        runner.execute(plan_fn(state["step"]))

    decoding: list[str] = []
    for start in tqdm(range(0, args.batch_size, per_step), desc="prefill", unit="step", file=sys.stderr):
        batch = new_requests(min(per_step, args.batch_size - start))
        execute(lambda s: StepPlan(s, new_requests=batch))
        decoding += [r.request_id for r in batch]

    def decode_plan(step: int) -> StepPlan:
        return StepPlan(step, cached_requests=[CachedRequest(rid, runner.requests[rid].num_computed_tokens, 1)
                                               for rid in decoding])

    def context_plan(step: int) -> StepPlan:
        return StepPlan(step, new_requests=new_requests(args.prefill_requests))

    on_gpu = engine.device.type == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    flops_per_token = gemm_flops_per_token(config)
    report: dict = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                    "engine": {"kernels": {k: c.name for k, c in engine.manifest.plugins.items()},
                               "num_kv_blocks": engine.num_kv_blocks, "cuda_graphs": engine.decode_graphs is not None},
                    "gemm_flops_per_token_excl_lm_head": flops_per_token, "steps": {}}
    for kind, plan_fn, rows in (("decode", decode_plan, args.batch_size),
                                ("context", context_plan, args.prefill_requests * args.context)):
        for _ in range(3):  # warm-up: Triton compiles, graphs replay once
            execute(plan_fn)
        sync()
        with profile(activities=activities) as prof:
            started = time.perf_counter()
            for _ in range(args.steps):
                execute(plan_fn)
            sync()
            step_ms = (time.perf_counter() - started) * 1e3 / args.steps
        kernels, by_category = [], {}
        for row in kernel_rows(prof, args.steps, top=10_000):
            label = category(row["kernel"])
            kernels.append({"kernel": row["kernel"], "category": label, "calls_per_step": row["calls"],
                            "us_per_step": row["us"]})
            by_category[label] = by_category.get(label, 0.0) + row["us"]
        kernels.sort(key=lambda r: -r["us_per_step"])
        kernel_ms = sum(by_category.values()) / 1e3
        gemm_ms = by_category.get("gemm", 0.0) / 1e3
        entry = {
            "rows": rows, "step_ms": round(step_ms, 3), "kernel_ms": round(kernel_ms, 3),
            "by_category_ms": {k: round(v / 1e3, 3) for k, v in sorted(by_category.items(), key=lambda kv: -kv[1])},
            # layer GEMMs only; the LM head's rows (one per decode row, one per prompt) are in gemm_ms too
            "gemm_tflop_per_s_excl_lm_head": (round(rows * flops_per_token / (gemm_ms / 1e3) / 1e12, 1)
                                              if gemm_ms else None),
            "kernels": kernels[: args.top],
        }
        report["steps"][kind] = entry
        log(f"{kind}: {rows} rows, {step_ms:.2f} ms/step, kernels {kernel_ms:.2f} ms: "
            + ", ".join(f"{k} {v}" for k, v in entry["by_category_ms"].items()))
    write_report("bench/step_kernels.py", argv, args.device, args.output, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
