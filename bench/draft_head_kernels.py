"""GPU time of a recurrent draft head's chain: the Triton kernels' tiles against torch's kernels.

For a model shape's hidden and vocabulary sizes (random 16-bit weights: the
time does not depend on them), times ``heads_triton.recurrent_drafts`` for
every ``ChainConfig`` of a grid, and the torch chain
(``RecurrentDraftHead.propose`` with ``fused`` off, cuBLAS for the LM head;
the engine's chain runs its own tuned GEMV), each as one CUDA graph of
a chain of ``--drafts`` drafts, for each row count of ``--rows``. Each timed
chain's drafts are checked against torch's. What it reports per row count:
the grid sorted by time, the best tiles, and the torch chain's time; the
defaults of ``ChainConfig`` come from such a run.

Example:
  python bench/draft_head_kernels.py --shape smollm2-135m --output bench/results/h200_draft_head_kernels_smollm2.json
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_common import log, time_us, write_report  # noqa: E402
from model_shapes import SHAPES  # noqa: E402

GRID = {
    "block_hidden": (4, 8),
    "block_k_hidden": (512, 1024, 2048),
    "warps_hidden": (2, 4, 8),
    "block_vocab": (16, 32, 64),
    "block_k_vocab": (32, 64),
    "warps_vocab": (1, 2, 4),
}


def _target(vocab: int, hidden: int, dtype, device, gen):
    """A layerless Llama of the shape's vocabulary and hidden size: what a draft head reads of its target (the
    token embedding and the LM head tied to it, a plain 16-bit Linear on torch's GEMM), random weights."""
    import torch

    from executor_svc.model.config import ModelConfig
    from executor_svc.model.llama import LlamaForCausalLM
    from plugins.kernels import Kernels

    config = ModelConfig(
        name="chain", architecture="LlamaForCausalLM", vocab_size=vocab, hidden_size=hidden,
        intermediate_size=hidden, num_layers=0, num_heads=1, num_kv_heads=1, head_dim=hidden,
        rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=16,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config, 16, Kernels.reference(device, dtype)).to(device, dtype)
    with torch.no_grad():
        model.embed_tokens.weight.normal_(0.0, 0.05, generator=gen)
    return model


def _config_of(timed: dict):
    """The ``ChainConfig`` a timed grid entry ran."""
    from executor_svc.speculative import heads_triton

    return heads_triton.ChainConfig(**{k: timed[k] for k in GRID})


def run(args: argparse.Namespace) -> dict:
    import torch

    from executor_svc.speculative import heads_triton
    from executor_svc.speculative.draft_heads import RecurrentDraftHead

    device, dtype = torch.device("cuda"), torch.bfloat16
    shape = SHAPES[args.shape]
    hidden, vocab = shape["hidden_size"], shape["vocab_size"]
    gen = torch.Generator(device=device).manual_seed(0)
    model = _target(vocab, hidden, dtype, device, gen)
    head = RecurrentDraftHead(args.drafts, hidden, vocab).to(device, dtype)
    with torch.no_grad():
        head.w_out.normal_(0.0, 0.02, generator=gen)  # a state that moves, as a trained head's does
    parts = [model.embed_tokens.weight, head.w_in, head.b_in, head.w_out, head.b_out, model.lm_head.weight]

    def graphed(fn):
        fn()  # compile
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        return graph, out

    out: dict = {"shape": args.shape, "hidden_size": hidden, "vocab_size": vocab, "drafts": args.drafts,
                 "intermediate_size": head.intermediate_size, "grid": {k: list(v) for k, v in GRID.items()}, "rows": {}}
    configs = [heads_triton.ChainConfig(**dict(zip(GRID, values))) for values in itertools.product(*GRID.values())]
    with torch.inference_mode():
        for rows in args.rows:
            states = torch.randn(rows, hidden, generator=gen, device=device, dtype=dtype)
            tokens = torch.randint(0, vocab, (rows,), generator=gen, device=device)
            head.fused = False
            graph, expected = graphed(lambda: head.propose(states, model, args.drafts, tokens))
            torch_us = time_us(graph.replay, device, warmup=5, repeats=args.repeats)
            head.fused = True
            timed = []
            for config in configs:
                graph, drafts = graphed(lambda: heads_triton.recurrent_drafts(states, tokens, *parts, args.drafts, config))
                us = time_us(graph.replay, device, warmup=5, repeats=args.repeats)
                timed.append({**config.__dict__, "us": round(us, 2), "agree": float((drafts == expected).float().mean())})
            timed.sort(key=lambda t: t["us"])
            default = next((t for t in timed if _config_of(t) == heads_triton.DEFAULT_CONFIG), None)
            out["rows"][str(rows)] = {"torch_us": round(torch_us, 2), "best": timed[0], "default": default,
                                      "min_agree": min(t["agree"] for t in timed), "all": timed}
            log(f"rows {rows}: torch {torch_us:.1f} us, best {timed[0]}, default {default and default['us']} us")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    p.add_argument("--drafts", type=int, default=4, help="drafts per chain")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4], help="requests per chain (at most MAX_ROWS)")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--output", type=Path, default=Path("bench/results/draft_head_kernels.json"))
    args = p.parse_args(argv)
    write_report("bench/draft_head_kernels.py", argv, "cuda", args.output, run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
