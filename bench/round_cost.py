"""GPU time of a verification forward by row count, and of a chained draft-heads round by draft length.

What bounds a draft head's speedup at batch 1 is the ratio of a round's cost
(a forward over 1 + k rows, the verdict, k steps of the head) to a plain
step's (a forward over one row). This measures both from CUDA events over
CUDA-graph replays, on random weights of a shape (acceptance plays no part):

* ``forward_{rows}_rows_ms``: one generation forward of one request's ``rows``
  single-token rows, as a verification step runs it;
* ``round_k{k}_ms``: one of eight chained rounds verifying k drafts with a
  recurrent head drafting between them (``RoundsRunner``), the head's chain
  running as Triton kernels (executor_svc/speculative/heads_triton.py);
  ``round_k{k}_torch_head_ms`` the same with the chain in torch's kernels;
* ``chain_k{k}_ms`` / ``chain_k{k}_torch_ms``: the head's chain of k drafts
  for one request alone (its CUDA graph), each way; ``chain_drafts_agree`` the
  share of drafts the two chains agree on over 64 random states (the Triton
  chain rounds where torch's kernels do, so only float32 sums that land on
  the other side of a 16-bit rounding can differ);
* ``round_k{k}_vocab{n}_ms`` / ``chain_k{k}_vocab{n}_ms``: the Triton chain
  drafting from a draft vocabulary of n tokens (``--draft-vocab``), whose
  LM-head GEMV reads n rows instead of the whole vocabulary's (which n tokens
  plays no part in the time);
* ``kernels`` (with ``--kernels N``): device time by kernel, under the torch
  profiler over N replays, of the one-row forward, the two-row one, one of 1 + k rows
  (k = ``--kernels-drafts``) and one chained round verifying k drafts (heads
  with prompt lookup, as ``draft_heads:lookup2`` serves them), with
  each one's summed kernel time (what the device is busy for, against the
  CUDA-event times above, which include its idle gaps).

``--gemv-rows N`` is an experiment: route up to N rows through the 16-bit
GEMV with its one-row tile, whatever the build timed (0: the engine's own
routing). Speedup at acceptance giving T tokens a round is about
``T * forward_1_rows_ms / round_k{k}_ms``.

Example:
  python bench/round_cost.py --shape smollm2-135m --output bench/results/h200_round_cost_smollm2.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_common import kernel_rows, log, time_us, write_report  # noqa: E402
from model_shapes import SHAPES, shape_folder  # noqa: E402


def _route_rows_to_gemv(max_rows: int) -> None:
    """Make the 16-bit GEMV take up to ``max_rows`` rows with the tile it would use for one."""
    import plugins.gemm_decode as gemm

    gemm.MAX_ROWS = max_rows
    one_row = gemm._gemv_config

    def config(x, weight):
        if x.dim() == 2 and 1 < x.shape[0] <= max_rows:
            return one_row(x[:1], weight)
        return one_row(x, weight)

    gemm._gemv_config = config


def run(args: argparse.Namespace) -> dict:
    import torch
    import torch.nn.functional as F

    if args.gemv_rows:
        _route_rows_to_gemv(args.gemv_rows)  # before the engine loads: its CUDA graphs capture the routing
    import plugins.gemm_decode as gemm
    from executor_svc.build_config import BuildConfig
    from executor_svc.builder import build_engine
    from executor_svc.engine import RuntimeConfig, load_engine
    from executor_svc.packed_forward import Segment, pack, run_packed
    from executor_svc.sampler import RequestSamplingState
    from executor_svc.speculative.draft_heads import RecurrentDraftHead
    from executor_svc.speculative.heads_proposer import HeadsChain
    from executor_svc.speculative.rounds import RoundsRequest, RoundsRunner
    from inflight.model_store import default_cache_dir
    from protos.plan import SamplingConfig

    device = torch.device(args.device)
    root = default_cache_dir() / "round-cost"
    engine_dir = root / f"{args.shape}-engine"
    if not (engine_dir / "engine.json").exists():
        build = BuildConfig(max_batch_size=256, max_num_tokens=8192, max_seq_len=2048, tokens_per_block=16,
                            dtype="bfloat16")
        build_engine(shape_folder(args.shape, root, args.tokenizer_from), engine_dir, build, device=args.device,
                     load_format="dummy", progress=False)
    eng = load_engine(engine_dir, RuntimeConfig(device=args.device, kv_cache_fraction=0.3))
    out: dict = {"shape": args.shape, "gemv_rows": args.gemv_rows, "gemm_kernel": eng.manifest.plugins["gemm"].name,
                 "gemm_tactics": eng.manifest.plugins["gemm"].tactics}
    # The routed GEMV against float32 torch on the model's layer shapes (the experiment's correctness).
    gen = torch.Generator(device=device).manual_seed(0)
    config = eng.model_config
    diffs = []
    for n, k in {(config.hidden_size, config.hidden_size), (config.intermediate_size, config.hidden_size),
                 (config.hidden_size, config.intermediate_size), (config.vocab_size, config.hidden_size)}:
        w = torch.randn(n, k, generator=gen, device=device, dtype=torch.bfloat16) * 0.05
        for m in (2, 5, 8):
            x = torch.randn(m, k, generator=gen, device=device, dtype=torch.bfloat16)
            ref = F.linear(x.float(), w.float())
            got = gemm.linear_gemv(x, w)
            diffs.append(float((got.float() - ref).abs().max() / ref.abs().max()))
    out["max_rel_diff"] = max(diffs)
    head = RecurrentDraftHead(4, config.hidden_size, config.vocab_size).to(device, eng.dtype)
    with torch.no_grad():  # a head whose state moves (an untrained one's W_out is zero), as a trained one's does
        head.w_out.normal_(0.0, 0.02, generator=gen)
        head.b_in.normal_(0.0, 0.02, generator=gen)
    torch_head = RecurrentDraftHead(4, config.hidden_size, config.vocab_size).to(device, eng.dtype)
    torch_head.load_state_dict(head.state_dict())
    torch_head.fused = False
    heads = [("", head), ("_torch_head", torch_head)]
    for size in args.draft_vocab:
        small = RecurrentDraftHead(4, config.hidden_size, config.vocab_size).to(device, eng.dtype)
        small.load_state_dict(head.state_dict())
        small.token_counts = torch.arange(config.vocab_size, 0, -1)  # any ranking: the first n ids
        small.use_draft_vocab(size)
        heads.append((f"_vocab{size}", small))
    runners, chains = {}, {}
    for name, h in heads:
        chains[name] = HeadsChain(h, eng.model, 128, device, eng.dtype)
        runners[name] = RoundsRunner(eng.model, eng.kv_cache, eng.decode_graphs, eng.tokens_per_block, (1, 1),
                                     chains[name])
        runners[name].warm_up(range(1, 5))
    with torch.inference_mode():
        agree = []
        for _ in range(8):
            states = torch.randn(8, config.hidden_size, generator=gen, device=device, dtype=eng.dtype)
            tokens = torch.randint(0, config.vocab_size, (8,), generator=gen, device=device)
            agree.append((head.propose(states, eng.model, 4, tokens) == torch_head.propose(states, eng.model, 4, tokens))
                         .float().mean().item())
    out["chain_drafts_agree"] = sum(agree) / len(agree)
    table = list(range(40))  # 640 slots: the 300-token context and eight rounds of up to five rows
    history = list(range(100, 400))

    def request() -> RoundsRequest:
        return RoundsRequest(history, table, [5, 6, 7, 8],
                             RequestSamplingState(SamplingConfig(temperature=0.0), history, device))

    def forward(rows: int) -> torch.Tensor:
        packed = pack([Segment(table, 299, rows, True)], eng.tokens_per_block)
        logits, _ = run_packed(eng.model, eng.kv_cache, eng.decode_graphs, packed, [7] * rows, list(range(rows)),
                               None, True)
        return logits

    def gpu_ms(fn, repeats: int) -> float:
        return time_us(fn, device, warmup=3, repeats=repeats) / 1e3

    with torch.inference_mode():
        for rows in (1, 2, 3, 5, 8):
            out[f"forward_{rows}_rows_ms"] = round(gpu_ms(lambda: forward(rows), 30), 4)
        hidden_rows = torch.randn(1, config.hidden_size, generator=gen, device=device, dtype=eng.dtype)
        for name, runner in runners.items():
            for k in (1, 2, 3, 4):
                out[f"round_k{k}{name}_ms"] = round(gpu_ms(lambda: runner.run([request()], k, 8, k), 10) / 8, 4)
        for name, chain in (("", chains[""]), ("_torch", chains["_torch_head"]),
                            *((f"_vocab{size}", chains[f"_vocab{size}"]) for size in args.draft_vocab)):
            for k in (1, 2, 3, 4):
                out[f"chain_k{k}{name}_ms"] = round(gpu_ms(lambda: chain.draft(hidden_rows, 1, k), 50), 4)
        if args.kernels:
            k = args.kernels_drafts
            # As served with heads and prompt lookup (draft_heads:lookup2): a round verifies k drafts whether
            # the heads make that many or not (prefer_lookup pads them).
            chain = chains[f"_vocab{args.draft_vocab[-1]}" if args.draft_vocab else ""]
            runner = RoundsRunner(eng.model, eng.kv_cache, eng.decode_graphs, eng.tokens_per_block, (2, 4), chain,
                                  heads_lookup=True)
            runner.warm_up([k])
            out["kernels"] = {
                "forward_1_rows": _kernel_profile(lambda: forward(1), args.kernels),
                "forward_2_rows": _kernel_profile(lambda: forward(2), args.kernels),
                f"forward_{k + 1}_rows": _kernel_profile(lambda: forward(k + 1), args.kernels),
                f"round_k{k}": _kernel_profile(lambda: runner.run([request()], k, 8, k), args.kernels, per_call=8),
            }
    log(", ".join(f"{key} {value}" for key, value in out.items() if key.endswith("_ms")))
    return out


def _kernel_profile(fn, repeats: int, per_call: int = 1) -> dict:
    """Device time by kernel of one of ``per_call`` units that each ``fn()`` runs, over ``repeats`` calls."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    rows = kernel_rows(prof, repeats * per_call, top=10_000)
    return {"kernel_us": round(sum(r["us"] for r in rows), 1), "launches": round(sum(r["calls"] for r in rows), 1),
            "kernels": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    p.add_argument("--tokenizer-from", default="smollm2-135m-instruct", help="whose tokenizer the shape folder gets")
    p.add_argument("--device", default="cuda", choices=["cuda"], help="CUDA graphs and events: a GPU only")
    p.add_argument("--gemv-rows", type=int, default=0, help="experiment: up to this many rows on the GEMV (0: off)")
    p.add_argument("--draft-vocab", default="8192,16384",
                   help="comma-separated draft vocabulary sizes to time the Triton chain with ('' for none)")
    p.add_argument("--kernels", type=int, default=0, metavar="N",
                   help="also profile N replays of the 1-, 2- and (1 + k)-row forwards and a round by kernel")
    p.add_argument("--kernels-drafts", type=int, default=8, metavar="K", help="the drafts k of --kernels")
    p.add_argument("--output", type=Path, default=Path("bench/results/round_cost.json"))
    args = p.parse_args(argv)
    args.draft_vocab = [int(v) for v in args.draft_vocab.split(",") if v]
    write_report("bench/round_cost.py", argv, args.device, args.output, run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
