"""Paged attention: the Triton plugin against the torch reference.

Times both attention plugins on Llama-3.1-8B's attention shape (32 heads,
8 KV heads, head dim 128, 32 tokens per KV block) in bfloat16: generation
steps at batch 1, 16, 64 and 256 with 512 and 2048 cached tokens per request,
a context step of 4 prompts of 2048 tokens, and a 2048-token chunk after 2048
cached tokens. Each case records the median time of one call (CUDA events,
after a warm-up, L2 flushed before every call), the torch/triton ratio, the
largest absolute difference of the Triton output from the reference's, and
for generation steps also both plugins replayed from a CUDA graph (how the
executor runs decode steps).

    python bench/attention_kernels.py --output bench/results/h200_attention_kernels.json

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
    heads: int
    kv_heads: int
    head_dim: int
    tokens_per_block: int
    batches: tuple[int, ...]  # generation steps: requests per step
    contexts: tuple[int, ...]  # generation steps: cached tokens per request
    prompt: int  # context steps: prompt length (4 prompts) and chunk length (after as many cached tokens)


LLAMA_3_1_8B = Shapes(heads=32, kv_heads=8, head_dim=128, tokens_per_block=32,
                      batches=(1, 16, 64, 256), contexts=(512, 2048), prompt=2048)
SMALL = Shapes(heads=8, kv_heads=2, head_dim=64, tokens_per_block=16, batches=(1, 3), contexts=(40, 100), prompt=48)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True, type=Path, help="JSON file for the results")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (through Triton's interpreter)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="auto: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--small", action="store_true", help="tiny shapes (smoke run)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 10; small: 1)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls, median kept (default 50; small: 2)")
    p.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph replays of generation steps")
    args = p.parse_args(argv)
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    args.warmup = args.warmup if args.warmup is not None else (1 if args.small else 10)
    args.repeats = args.repeats if args.repeats is not None else (2 if args.small else 50)
    return args


@dataclass(slots=True)
class Step:
    """One packed attention step with its inputs, ready to call a plugin on."""

    name: str
    requests: list[tuple[int, int]]  # (cached tokens, new query tokens)
    args: tuple  # q, k_cache, v_cache, meta, scale
    kv_bytes: int  # keys and values the step must read at least once
    flops: int  # multiply-adds x 2 of QK^T and PV over the visible (causal) pairs


def make_step(name: str, requests: list[tuple[int, int]], s: Shapes, dtype, device, gen, device_gen) -> Step:
    """Requests packed as the runner packs them, KV blocks at shuffled ids, random cache contents.

    ``gen`` (CPU) draws the block ids, ``device_gen`` the tensors, on the device (GiBs at batch 256).
    """
    import torch

    from plugins.attention_metadata import AttentionMetadata

    block = s.tokens_per_block
    num_blocks = sum(-(-(c + n) // block) for c, n in requests)
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables, query_start, context_lens = [], [0], []
    for cached, new in requests:
        tables.append([ids.pop() for _ in range(-(-(cached + new) // block))])
        query_start.append(query_start[-1] + new)
        context_lens.append(cached + new)
    width = max(map(len, tables))
    single = [i for i, (_, new) in enumerate(requests) if new == 1]

    def tensor(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(device)

    meta = AttentionMetadata(
        query_start=query_start, context_lens=context_lens,
        block_tables=tensor([t + [0] * (width - len(t)) for t in tables]), context_lens_t=tensor(context_lens),
        slot_mapping=tensor([0] * query_start[-1]),
        single_query_rows=tensor(single), single_query_tokens=tensor([query_start[i] for i in single]),
        multi_query_rows=[i for i, (_, new) in enumerate(requests) if new > 1],
    )
    cache_shape = (num_blocks, block, s.kv_heads, s.head_dim)
    k_cache = torch.randn(cache_shape, generator=device_gen, device=device, dtype=dtype)
    v_cache = torch.randn(cache_shape, generator=device_gen, device=device, dtype=dtype)
    q = torch.randn((query_start[-1], s.heads, s.head_dim), generator=device_gen, device=device, dtype=dtype)
    size = torch.finfo(dtype).bits // 8
    pairs = sum(n * c + n * (n + 1) // 2 for c, n in requests)  # query-key pairs under the causal mask
    return Step(
        name=name, requests=requests, args=(q, k_cache, v_cache, meta, s.head_dim**-0.5),
        kv_bytes=2 * sum(context_lens) * s.kv_heads * s.head_dim * size, flops=4 * pairs * s.heads * s.head_dim,
    )


def steps(s: Shapes, dtype, device, gen, device_gen):
    """The benchmark's cases, one at a time (each owns its KV cache until the next)."""
    gens = (gen, device_gen)
    for context in s.contexts:
        for batch in s.batches:
            # Cached tokens differ a little per request, as in a real batch (at most `context`).
            requests = [(context - 1 - (37 * i) % max(1, context // 8), 1) for i in range(batch)]
            yield "generation", make_step(f"generation_b{batch}_ctx{context}", requests, s, dtype, device, *gens)
    yield "context", make_step(f"context_4x{s.prompt}", [(0, s.prompt)] * 4, s, dtype, device, *gens)
    yield "context", make_step(f"chunk_{s.prompt}_after_{s.prompt}", [(s.prompt, s.prompt)], s, dtype, device, *gens)


def time_graph(name: str, fn: Callable[[], object], expected, device, args: argparse.Namespace, flush) -> dict:
    """``fn`` (already warmed up) captured in a CUDA graph: replay time and output difference, or the capture error."""
    import torch

    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # one eager call on a side stream, as torch's docs advise before capture
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        graph.replay()
        diff = (out.float() - expected.float()).abs().max().item()
        return {f"{name}_graph_us": round(time_us(graph.replay, device, args.warmup, args.repeats, flush.zero_ if flush is not None else None), 2),
                f"{name}_graph_max_abs_diff": diff}
    except Exception as exc:  # a plugin that cannot be captured is a result, not a crash
        return {f"{name}_graph_error": f"{type(exc).__name__}: {exc}"}


def measure(kind: str, step: Step, shapes: Shapes, args: argparse.Namespace, flush) -> dict:
    """Both plugins on one step: times, ratio, output difference; graph replays for generation steps."""
    import torch

    from plugins.attention_torch import paged_attention
    from plugins.attention_triton import num_sms, paged_attention_triton
    from plugins.attention_triton_decode import decode_splits, decode_tiles

    device = torch.device(args.device)
    q, _, _, meta, _ = step.args

    def reference() -> torch.Tensor:
        return paged_attention(*step.args)

    def fast() -> torch.Tensor:
        return paged_attention_triton(*step.args)

    expected = reference()
    diff = (fast().float() - expected.float()).abs().max().item()
    torch_us = time_us(reference, device, args.warmup, args.repeats, flush.zero_ if flush is not None else None)
    triton_us = time_us(fast, device, args.warmup, args.repeats, flush.zero_ if flush is not None else None)
    lens = [cached + new for cached, new in step.requests]
    row = {
        "case": step.name, "kind": kind, "requests": len(step.requests), "query_tokens": q.shape[0],
        "context_len_min": min(lens), "context_len_max": max(lens),
        "torch_us": round(torch_us, 2), "triton_us": round(triton_us, 2),
        "torch_over_triton": round(torch_us / triton_us, 3), "max_abs_diff": diff,
        "triton_kv_gb_per_s": round(step.kv_bytes / triton_us / 1e3, 1),
        "triton_tflop_per_s": round(step.flops / triton_us / 1e6, 2),
    }
    if kind == "generation":
        # How the decode kernel cut the sequences (a tuning knob), then both plugins as graph replays.
        span = meta.block_tables.shape[1] * shapes.tokens_per_block
        tiles = decode_tiles(shapes.head_dim, q.dtype, step.args[1].dtype)
        splits, split_len = decode_splits(len(step.requests), shapes.kv_heads, span, num_sms(device), tiles)
        row.update(decode_splits=splits, decode_split_tokens=split_len)
        if device.type == "cuda" and not args.no_graphs:
            for name, fn in (("torch", reference), ("triton", fast)):
                row.update(time_graph(name, fn, expected, device, args, flush))
            if "torch_graph_us" in row and "triton_graph_us" in row:
                row["graph_torch_over_triton"] = round(row["torch_graph_us"] / row["triton_graph_us"], 3)
    graph_note = f"  graph triton {row['triton_graph_us']:8.1f} us" if "triton_graph_us" in row else ""
    print(f"{step.name:28s} torch {torch_us:9.1f} us  triton {triton_us:9.1f} us  x{row['torch_over_triton']:<6.2f}"
          f" {row['triton_kv_gb_per_s']:7.1f} GB/s {row['triton_tflop_per_s']:7.1f} TFLOP/s  max|diff| {diff:.3g}"
          f"{graph_note}", file=sys.stderr)
    return row


def run(args: argparse.Namespace) -> dict:
    import torch
    import triton

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    shapes = SMALL if args.small else LLAMA_3_1_8B
    gen, device_gen = torch.Generator().manual_seed(0), torch.Generator(device=device).manual_seed(0)
    flush = torch.empty(256 << 20, dtype=torch.int8, device=device) if device.type == "cuda" else None
    results = []
    for kind, step in steps(shapes, dtype, device, gen, device_gen):
        results.append(measure(kind, step, shapes, args, flush))
        if device.type == "cuda":  # the step's cache is gone once the next one is made; hand its memory back
            torch.cuda.empty_cache()
    return {
        "shapes": asdict(shapes), "dtype": args.dtype, "triton": triton.__version__,
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        "timing": {
            "warmup": args.warmup, "repeats": args.repeats,
            "method": ("median of CUDA events per call, 256 MiB written before each call to flush L2"
                       if device.type == "cuda" else "median wall clock per call"),
            "per_step_tensors": "kept in meta.derived after the first call, as for every layer after the first",
        },
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":  # the kernels run through the interpreter; it is read when they are defined
        os.environ.setdefault("TRITON_INTERPRET", "1")
    write_report("bench/attention_kernels.py", argv, args.device, args.output, run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
