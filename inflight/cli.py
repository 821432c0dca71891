"""The ``inflight`` command line.

    inflight build     checkpoint -> engine folder (kernels chosen on this device)
    inflight inspect   what an engine runs, layer by layer; which plugins exist
    inflight serve     scheduler + one executor (two processes)
    inflight scheduler / inflight executor   each service alone (compose, scaling)
    inflight generate  stream a completion from a running server to stdout
    inflight train-draft  Medusa-style draft heads for an engine (speculative decoding)
    inflight cache     the engines built on the fly: list them, or trim them

Logs go to stderr; ``generate`` writes only the completion to stdout.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50051
DEFAULT_EXECUTOR_PORT = 50052
DEFAULT_MODEL = "smollm2-135m-instruct"


def _add_runtime_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("runtime")
    g.add_argument("--kv-cache-gb", type=float, default=0.0, help="KV cache size in GiB (default: 2 on CPU, --kv-cache-fraction on GPU)")
    g.add_argument("--kv-cache-fraction", type=float, default=0.9, help="fraction of GPU memory for weights + KV cache")
    g.add_argument("--host-cache-gb", type=float, default=0.0,
                   help="host-memory tier of the prefix cache in GiB (pinned on a GPU): evicted blocks wait there; 0 = none")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs: run every step eagerly")
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--speculative", default="none", choices=["none", "ngram", "draft_model", "draft_heads"],
                   help="ngram: drafts copied from the request's own tokens; draft_model: a small model of the same "
                        "tokenizer (--draft-model); draft_heads: heads trained by `inflight train-draft`")
    g.add_argument("--num-draft-tokens", type=int, default=None,
                   help="most draft tokens per request per step (default: 15 for ngram, 4 otherwise)")
    g.add_argument("--draft-model", default=None,
                   help="draft_model: engine folder, model name, Hugging Face folder or .gguf (built like the target)")
    g.add_argument("--ngram-min", type=int, default=1, help="ngram: shortest suffix to look up")
    g.add_argument("--ngram-max", type=int, default=4, help="ngram: longest suffix to look up")
    g.add_argument("--speculative-rounds", type=int, default=32,
                   help="ngram, draft_heads: most verification rounds one step chains on the device, drafting each "
                        "from the tokens the last accepted; a stream gets a step's tokens together, and an arriving "
                        "request ends the step's rounds early (1 = one round a step)")
    g.add_argument("--heads-lookup", type=int, default=0, metavar="N",
                   help="draft_heads: where a request's last N or more tokens (up to --ngram-max) occurred earlier "
                        "in its own tokens, draft what followed there instead of the heads' guesses, up to "
                        "--num-draft-tokens; 0 = the heads alone")
    g.add_argument("--draft-heads", default=None, metavar="DIR",
                   help="draft_heads: the folder of the heads to draft with (`inflight train-draft --output`); "
                        "default: the engine's folder")
    g.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="draft_heads: draft from the N tokens the heads' training answers used most (0 = every "
                        "token); default: what the heads were trained with (`inflight train-draft --draft-vocab`)")
    g.add_argument("--draft-tree", default="chain",
                   help="draft_heads: 'chain' (k drafts in a row), 'default' (a 14-node tree to depth 4) or the "
                        "tree's paths of guess ranks, e.g. '0;1;2;0,0;1,0;0,0,0': requests verify the tree")


def _milliseconds(text: str) -> float:
    """An argparse type: a time in milliseconds, 0 or more."""
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more milliseconds, got {text}")
    return value


def _add_scheduler_flags(p: argparse.ArgumentParser, with_limits: bool) -> None:
    p.add_argument("--host", default=DEFAULT_HOST)
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="client port")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (0: off)")
    p.add_argument("--max-queue-size", type=int, default=1024, help="waiting requests before RESOURCE_EXHAUSTED")
    p.add_argument(
        "--capacity-policy", default="guaranteed_no_evict", choices=["guaranteed_no_evict", "max_utilization"],
        help="guaranteed_no_evict: admit only with blocks for the whole request; "
             "max_utilization: admit optimistically, preempt (and recompute) when blocks run out",
    )
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of common prompt prefixes")
    p.add_argument("--overlap-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="plan step N+1 while the executor runs step N (the executor feeds in the token still on its way; "
                        "off while speculative decoding runs)")
    p.add_argument("--adaptive-draft-length", action=argparse.BooleanOptionalAction, default=True,
                   help="speculative decoding: draft length follows measured acceptance and step cost (off: always the most)")
    p.add_argument("--max-chained-step-ms", type=_milliseconds, default=50.0, metavar="MS",
                   help="speculative decoding: a step chains no more verification rounds than its measured costs "
                        "fit in MS milliseconds, so a stream's chunks come at most about MS apart (0 = as many "
                        "rounds as the executor's --speculative-rounds)")
    if with_limits:  # a standalone scheduler may serve below the engine's limits
        g = p.add_argument_group("limits (0 = the executor's)")
        g.add_argument("--max-batch-size", type=int, default=0)
        g.add_argument("--max-num-tokens", type=int, default=0)
        g.add_argument("--max-seq-len", type=int, default=0)
        g.add_argument("--num-kv-blocks", type=int, default=0, help="KV blocks to use of the executor's pool")
        g.add_argument("--max-host-blocks", type=int, default=0, help="host-tier blocks to use of the executor's")


def build_parser() -> argparse.ArgumentParser:
    from inflight.build_commands import add_quant_build_flags
    from inflight.engines import add_build_flags

    parser = argparse.ArgumentParser(prog="inflight", description="LLM inference server with inflight batching.")
    parser.add_argument("--log-level", default=os.environ.get("INFLIGHT_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)
    model_help = "engine folder, model name, Hugging Face folder or .gguf file"

    build = sub.add_parser("build", help="build an engine folder from a checkpoint")
    build.add_argument("--model", default=DEFAULT_MODEL, help="model name, Hugging Face folder or .gguf file")
    build.add_argument("--output", required=True, help="engine folder to write")
    add_build_flags(build)
    add_quant_build_flags(build)

    inspect = sub.add_parser("inspect", help="show what an engine runs, or the registered plugins")
    inspect.add_argument("engine_dir", nargs="?", help="engine folder")
    inspect.add_argument("--layer-info", action="store_true", help="the implementation of every layer")
    inspect.add_argument("--plugins", action="store_true", help="registered plugins and what this machine can run")

    serve = sub.add_parser("serve", help="run the scheduler and one executor")
    serve.add_argument("--model", default=DEFAULT_MODEL, help=model_help)
    serve.add_argument("--executor-port", type=int, default=DEFAULT_EXECUTOR_PORT)
    _add_scheduler_flags(serve, with_limits=False)
    add_build_flags(serve)
    _add_runtime_flags(serve)

    sched = sub.add_parser("scheduler", help="run the scheduler service alone")
    sched.add_argument("--model", default=DEFAULT_MODEL, help=f"{model_help} (for the tokenizer)")
    sched.add_argument("--executor", default=f"{DEFAULT_HOST}:{DEFAULT_EXECUTOR_PORT}", help="executor address host:port")
    _add_scheduler_flags(sched, with_limits=True)

    ex = sub.add_parser("executor", help="run one executor alone")
    ex.add_argument("--model", default=DEFAULT_MODEL, help=model_help)
    ex.add_argument("--host", default=DEFAULT_HOST)
    ex.add_argument("--port", type=int, default=DEFAULT_EXECUTOR_PORT)
    add_build_flags(ex)
    _add_runtime_flags(ex)

    gen = sub.add_parser("generate", help="stream a completion from a running server to stdout")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    gen.add_argument("--server", default=f"{DEFAULT_HOST}:{DEFAULT_PORT}")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    gen.add_argument("--priority", type=int, default=0, help="admission priority, higher first ([-100, 100])")
    gen.add_argument("--cache-salt", default="", help="share cached prefix blocks only with requests of the same salt")

    from inflight.train_draft import add_train_draft_parser

    add_train_draft_parser(sub)
    from inflight.cache_command import add_cache_parser

    add_cache_parser(sub)
    return parser


def run_generate(args: argparse.Namespace) -> int:
    import grpc

    from inflight.client import Client

    kwargs = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop,
                  priority=args.priority, cache_salt=args.cache_salt)
    prompt = None if args.chat else args.prompt
    if args.chat:
        kwargs["messages"] = [{"role": "user", "content": args.prompt}]
    with Client(args.server) as client:
        try:
            for chunk in client.generate_stream(prompt, timeout=args.timeout, **kwargs):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if chunk.finish_reason == "error":
                    print(f"\ninflight: request failed: {chunk.error}", file=sys.stderr)
                    return 1
        except grpc.RpcError as exc:
            print(f"inflight: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 2
    sys.stdout.write("\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.command == "generate":
        return run_generate(args)
    if args.command == "cache":
        from inflight.cache_command import run_cache

        return run_cache(args)
    if args.command == "train-draft":
        from inflight.train_draft import run_train_draft

        return run_train_draft(args)
    if args.command in ("build", "inspect"):
        from inflight import build_commands

        return build_commands.run_build(args) if args.command == "build" else build_commands.run_inspect(args)
    from inflight import serving

    {"serve": serving.run_serve, "scheduler": serving.run_scheduler, "executor": serving.run_executor}[args.command](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
