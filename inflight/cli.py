"""The ``inflight`` command line: serve, scheduler, executor, generate.

``inflight serve`` runs the two services of the architecture as two processes
(an executor child process and the scheduler in this one), exactly as
``inflight scheduler`` and ``inflight executor`` run them separately under
compose. Logs go to stderr; ``inflight generate`` writes only the completion
to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50051
DEFAULT_EXECUTOR_PORT = 50052


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (GPU when there is one)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--tokens-per-block", type=int, default=32, help="tokens per KV-cache block")
    g.add_argument("--kv-cache-gb", type=float, default=0.0, help="KV cache size in GiB (default: 2 on CPU, --kv-cache-fraction on GPU)")
    g.add_argument("--kv-cache-fraction", type=float, default=0.9, help="fraction of GPU memory for weights + KV cache")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"], help="dummy = random weights of the model's shape")


def _add_batch_flags(p: argparse.ArgumentParser, default: int | None) -> None:
    g = p.add_argument_group("batching")
    g.add_argument("--max-batch-size", type=int, default=default if default is not None else 256, help="most requests per step")
    g.add_argument("--max-num-tokens", type=int, default=default if default is not None else 8192, help="most tokens per step")
    g.add_argument("--max-seq-len", type=int, default=0, help="longest prompt + output (default: the model's)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inflight", description="LLM inference server with inflight batching.")
    parser.add_argument("--log-level", default=os.environ.get("INFLIGHT_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the scheduler and one executor")
    serve.add_argument("--model", default="smollm2-135m-instruct", help="model name, HF folder or .gguf file")
    serve.add_argument("--host", default=DEFAULT_HOST)
    serve.add_argument("--port", type=int, default=DEFAULT_PORT, help="client port")
    serve.add_argument("--executor-port", type=int, default=DEFAULT_EXECUTOR_PORT)
    serve.add_argument("--max-queue-size", type=int, default=1024)
    _add_engine_flags(serve)
    _add_batch_flags(serve, None)

    sched = sub.add_parser("scheduler", help="run the scheduler service alone")
    sched.add_argument("--model", default="smollm2-135m-instruct", help="model (for its tokenizer)")
    sched.add_argument("--host", default=DEFAULT_HOST)
    sched.add_argument("--port", type=int, default=DEFAULT_PORT)
    sched.add_argument("--executor", default=f"{DEFAULT_HOST}:{DEFAULT_EXECUTOR_PORT}", help="executor address host:port")
    sched.add_argument("--max-queue-size", type=int, default=1024)
    _add_batch_flags(sched, 0)

    ex = sub.add_parser("executor", help="run one executor alone")
    ex.add_argument("--model", default="smollm2-135m-instruct")
    ex.add_argument("--host", default=DEFAULT_HOST)
    ex.add_argument("--port", type=int, default=DEFAULT_EXECUTOR_PORT)
    _add_engine_flags(ex)
    _add_batch_flags(ex, None)

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
    return parser


def run_executor(args: argparse.Namespace) -> None:
    from executor_svc.engine import EngineConfig, load_engine
    from executor_svc.service import serve_executor
    from inflight.model_store import resolve_model

    engine = load_engine(
        EngineConfig(
            model_dir=resolve_model(args.model), device=args.device, dtype=args.dtype,
            max_batch_size=args.max_batch_size, max_num_tokens=args.max_num_tokens, max_seq_len=args.max_seq_len,
            tokens_per_block=args.tokens_per_block, kv_cache_bytes=int(args.kv_cache_gb * 2**30),
            kv_cache_fraction=args.kv_cache_fraction, load_format=args.load_format,
        )
    )
    server = serve_executor(engine, f"{args.host}:{args.port}")
    signal.signal(signal.SIGTERM, lambda *_: server.stop(grace=2))
    server.wait_for_termination()


async def _run_scheduler(args: argparse.Namespace, executor_address: str) -> None:
    from inflight.model_store import resolve_model
    from scheduler_svc.engine_loop import AsyncEngine, EngineLimits
    from scheduler_svc.executor_client import GrpcExecutorConnection
    from scheduler_svc.service import start_scheduler_server
    from scheduler_svc.tokenizer import Tokenizer

    tokenizer = Tokenizer(resolve_model(args.model))
    limits = EngineLimits(
        max_batch_size=args.max_batch_size, max_num_tokens=args.max_num_tokens,
        max_seq_len=args.max_seq_len, max_queue_size=args.max_queue_size,
    )
    engine = AsyncEngine(GrpcExecutorConnection(executor_address), tokenizer, limits)
    await engine.start()
    server = await start_scheduler_server(engine, f"{args.host}:{args.port}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logging.getLogger("inflight").info("shutting down")
    await server.stop()
    await engine.stop()


def run_scheduler(args: argparse.Namespace) -> None:
    asyncio.run(_run_scheduler(args, args.executor))


def run_serve(args: argparse.Namespace) -> None:
    from inflight.model_store import resolve_model

    model_dir = resolve_model(args.model)  # convert once here, not in both processes
    executor_cmd = [
        sys.executable, "-m", "inflight", "--log-level", args.log_level, "executor", "--model", str(model_dir),
        "--host", "127.0.0.1", "--port", str(args.executor_port), "--device", args.device, "--dtype", args.dtype,
        "--tokens-per-block", str(args.tokens_per_block), "--kv-cache-gb", str(args.kv_cache_gb),
        "--kv-cache-fraction", str(args.kv_cache_fraction), "--load-format", args.load_format,
        "--max-batch-size", str(args.max_batch_size), "--max-num-tokens", str(args.max_num_tokens),
        "--max-seq-len", str(args.max_seq_len),
    ]
    child = subprocess.Popen(executor_cmd)
    args.model = str(model_dir)
    try:
        asyncio.run(_run_scheduler(args, f"127.0.0.1:{args.executor_port}"))
    finally:
        child.terminate()
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()


def run_generate(args: argparse.Namespace) -> int:
    import grpc

    from inflight.client import Client

    kwargs = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop)
    if args.chat:
        kwargs["messages"] = [{"role": "user", "content": args.prompt}]
        prompt = None
    else:
        prompt = args.prompt
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
    {"serve": run_serve, "scheduler": run_scheduler, "executor": run_executor}[args.command](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
