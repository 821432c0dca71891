"""Decode attention at small batches: how finely to split a request's keys, timed as a decode step runs it.

At batch 1 a decoder layer's attention reads well under a megabyte, so its time is latency: the chain of
dependent loads in one program (step metadata, a block-table entry, then the K and V tiles it points to, once
per ``block_n`` keys) plus the merge kernel after it. The tile defaults of
``plugins/attention_triton_decode.py`` were chosen on 16 to 1,024 requests, where there are programs enough to
fill the GPU; this sweep asks what small batches want: shorter splits (fewer dependent iterations per program,
more partial results to merge), smaller key tiles, fewer warps, and splits cut from each row's own keys instead
of the padded table (``DecodeTiles.dynamic_split``).

Each case is Llama-3.1-8B's attention shape (32 heads, 8 KV heads, head dim 128, 32 tokens per block, bfloat16)
for ``--layers`` layers with their own caches, the block table padded to ``--table-tokens`` as a CUDA-graph
bucket pads it (the splits come from that width, so most are empty at short contexts). One CUDA graph calls
the layers back to back (``plugins.timing.graph_time_us``), so the figure per call includes the gap to the next
kernel, as in a step; every output is checked against the torch reference.

    python bench/decode_attention_splits.py --output bench/results/h100_decode_attention_splits.json

On the CPU ``--smoke`` runs two tiny cases through Triton's interpreter (times mean nothing).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import log, write_report  # noqa: E402  (also puts the repository on sys.path)

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 32


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--contexts", default="192,512,2000")
    p.add_argument("--table-tokens", default="384,2048", help="padded block-table widths (graph buckets)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args(argv)
    if args.smoke:
        args.batches, args.contexts, args.table_tokens, args.layers, args.repeats = "1,2", "40", "96", 2, 1
    return args


def tile_variants(default):
    """(name, DecodeTiles): the default, then one or two knobs at a time."""
    out = [("default", default)]
    for min_split in (32, 64):
        for block_n in sorted({32, default.block_n}):
            if block_n <= min_split:
                out.append((f"min_split{min_split}_n{block_n}", replace(default, min_split_tokens=min_split,
                                                                         block_n=block_n)))
    out.append(("n32", replace(default, block_n=32)))
    out.append(("w2", replace(default, num_warps=2)))
    out.append(("min_split64_w2", replace(default, min_split_tokens=64, num_warps=2)))
    out.append(("min_split32_n32_w2", replace(default, min_split_tokens=32, block_n=32, num_warps=2)))
    out.append(("stages1", replace(default, num_stages=1)))
    out.append(("min_split64_stages1", replace(default, min_split_tokens=64, num_stages=1)))
    # Splits cut from each row's own keys (DecodeTiles.dynamic_split), alone and with more, shorter splits.
    dynamic = replace(default, dynamic_split=True)
    out.append(("dynamic", dynamic))
    out.append(("dynamic_min_split64", replace(dynamic, min_split_tokens=64)))
    out.append(("dynamic_min_split32_n32", replace(dynamic, min_split_tokens=32, block_n=32)))
    out.append(("dynamic_w2", replace(dynamic, num_warps=2)))
    return out


def make_layers(batch: int, context: int, table_tokens: int, layers: int, device, dtype, gen):
    """Per layer: (q, k_cache, v_cache); one AttentionMetadata for all (the same requests in every layer)."""
    import torch

    from plugins.attention_metadata import AttentionMetadata

    lens = [max(1, context - (37 * i) % max(1, context // 8)) for i in range(batch)]
    width = -(-table_tokens // BLOCK)
    blocks = sum(-(-n // BLOCK) for n in lens)
    ids = torch.randperm(blocks, generator=torch.Generator().manual_seed(batch)).tolist()
    tables = []
    for n in lens:
        row = [ids.pop() for _ in range(-(-n // BLOCK))]
        tables.append(row + [0] * (width - len(row)))

    def tensor(values):
        return torch.tensor(values, dtype=torch.int64, device=device)

    meta = AttentionMetadata(
        query_start=list(range(batch + 1)), context_lens=lens, block_tables=tensor(tables),
        context_lens_t=tensor(lens), slot_mapping=tensor([0] * batch), single_query_rows=tensor(list(range(batch))),
        single_query_tokens=tensor(list(range(batch))), multi_query_rows=[],
    )
    shape = (blocks, BLOCK, KV_HEADS, HEAD_DIM)
    per_layer = [(torch.randn((batch, HEADS, HEAD_DIM), generator=gen, device=device, dtype=dtype),
                  torch.randn(shape, generator=gen, device=device, dtype=dtype),
                  torch.randn(shape, generator=gen, device=device, dtype=dtype)) for _ in range(layers)]
    return meta, per_layer


def run(args: argparse.Namespace) -> dict:
    import torch

    from plugins.attention_torch import paged_attention
    from plugins.attention_triton import num_sms
    from plugins.attention_triton_decode import decode_attention, decode_splits, decode_tiles

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sms = num_sms(device)
    gen = torch.Generator(device=device).manual_seed(0)
    default = decode_tiles(HEAD_DIM, dtype, dtype)
    rows, sums = [], {}
    for table_tokens in map(int, args.table_tokens.split(",")):
        for context in map(int, args.contexts.split(",")):
            if context > table_tokens:
                continue
            for batch in map(int, args.batches.split(",")):
                meta, layers = make_layers(batch, context, table_tokens, args.layers, device, dtype, gen)
                scale = HEAD_DIM**-0.5
                expected = [paged_attention(q, k, v, meta, scale) for q, k, v in layers]
                outs = [torch.empty_like(q) for q, _, _ in layers]
                for name, tiles in tile_variants(default):
                    splits, split_len = decode_splits(batch, KV_HEADS, table_tokens, sms, tiles)

                    def call(i, tiles=tiles):
                        q, k, v = layers[i]
                        decode_attention(q, k, v, meta, scale, 0, outs[i], tiles, sms)

                    for i in range(len(layers)):
                        call(i)
                    diff = max((o.float() - e.float()).abs().max().item() for o, e in zip(outs, expected))
                    us = None
                    if device.type == "cuda":
                        from plugins.timing import graph_time_us

                        us = graph_time_us([lambda i=i: call(i) for i in range(len(layers))], device, args.repeats)
                    case = f"b{batch} ctx{context} table{table_tokens}"
                    row = {"case": case, "batch": batch, "context": context, "table_tokens": table_tokens,
                           "variant": name, "splits": splits, "split_tokens": split_len, "block_n": tiles.block_n,
                           "num_warps": tiles.num_warps, "num_stages": tiles.num_stages, "max_abs_diff": diff}
                    if us is not None:
                        row["us_per_layer"] = round(us, 2)
                        sums.setdefault(case, {})[name] = round(us, 2)
                    rows.append(row)
                    log(f"{case:26s} {name:22s} splits {splits:3d} x {split_len:4d}  "
                        f"{row.get('us_per_layer', float('nan')):7.2f} us/layer  max|diff| {diff:.3g}")
                del layers, expected, outs
    best = {case: min(times, key=times.get) for case, times in sums.items()}
    return {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "default_tiles": repr(default), "results": rows, "us_per_layer_by_case": sums, "fastest_by_case": best}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":  # the kernels run through the interpreter; it is read when they are defined
        os.environ.setdefault("TRITON_INTERPRET", "1")
    payload = run(args)
    if args.output:
        write_report("bench/decode_attention_splits.py", argv, args.device, args.output, payload)
    bad = [r for r in payload["results"] if r["max_abs_diff"] > 2e-2]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
