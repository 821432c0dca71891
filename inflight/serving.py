"""``inflight serve``, ``inflight scheduler`` and ``inflight executor``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import subprocess
import sys
from pathlib import Path

from executor_svc.engine_file import is_engine_dir
from inflight.engines import build_config_from_args, prepare_engine
from inflight.gc_tuning import settle_garbage_collector

log = logging.getLogger("inflight")


def _prepare_engine(model: str, args: argparse.Namespace) -> Path:
    """``prepare_engine`` for a server: a bad model name or build setting, or a build that cannot write its
    engine (a full disk), ends the process with its message (the traceback at --log-level DEBUG)."""
    from executor_svc.engine_file import EngineMismatchError
    from executor_svc.kernel_selection import PluginUnavailableError

    try:
        return prepare_engine(model, build_config_from_args(args), args.device, args.load_format)
    except (ValueError, ModuleNotFoundError, PluginUnavailableError, EngineMismatchError, OSError) as exc:
        log.debug("preparing the engine for %r failed", model, exc_info=True)
        raise SystemExit(f"inflight: cannot prepare the engine for {model!r}: {exc}") from None


def _check_port_free(host: str, port: int, flag: str) -> None:
    """End the process when a server's port is taken, before it loads a model (minutes, on a large one)
    rather than after. Binding again later can still fail; the servers then say so too."""
    if port == 0:  # any free port
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise SystemExit(f"inflight: cannot listen on {host}:{port}: {exc.strerror}") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: a port in TIME_WAIT is free
        try:
            probe.bind(address)
        except OSError as exc:
            raise SystemExit(f"inflight: cannot listen on {host}:{port} ({flag}): {exc.strerror}") from None


def speculative_config_from_args(args: argparse.Namespace):
    """The executor's SpeculativeConfig from the ``speculative decoding`` flags (builds a draft model when needed)."""
    from executor_svc.speculative.proposer import SpeculativeConfig, SpeculativeMode

    mode = SpeculativeMode("" if args.speculative == "none" else args.speculative)
    draft_dir = None
    if mode is SpeculativeMode.DRAFT_MODEL:
        if not args.draft_model:
            raise SystemExit("inflight: --speculative draft_model needs --draft-model")
        # Built with the target's flags: the same tokens per block, dtype and limits.
        draft_dir = _prepare_engine(args.draft_model, args)
    from executor_svc.speculative.draft_tree import DraftTree, parse_tree

    try:
        tree = parse_tree(args.draft_tree)
        if tree is not None:
            DraftTree(tree)  # checks the shape now, before any engine loads
    except ValueError as exc:
        raise SystemExit(f"inflight: --draft-tree: {exc}") from None
    if tree is not None and mode is not SpeculativeMode.DRAFT_HEADS:
        raise SystemExit(f"inflight: --draft-tree needs --speculative draft_heads, not {args.speculative}")
    try:
        return SpeculativeConfig(mode, args.num_draft_tokens, args.ngram_min, args.ngram_max, draft_dir,
                                 args.speculative_rounds, tree, heads_lookup=args.heads_lookup,
                                 draft_heads_dir=Path(args.draft_heads) if args.draft_heads else None,
                                 draft_vocab=args.draft_vocab)
    except ValueError as exc:
        raise SystemExit(f"inflight: speculative decoding: {exc}") from None


def run_executor(args: argparse.Namespace) -> None:
    from executor_svc.engine import RuntimeConfig, load_engine
    from executor_svc.service import serve_executor

    _check_port_free(args.host, args.port, "--port")
    engine_dir = _prepare_engine(args.model, args)
    runtime = RuntimeConfig(
        device=args.device, kv_cache_bytes=int(args.kv_cache_gb * 2**30), kv_cache_fraction=args.kv_cache_fraction,
        cuda_graphs=not args.enforce_eager, host_cache_bytes=int(args.host_cache_gb * 2**30),
        speculative=speculative_config_from_args(args),
    )
    engine = load_engine(engine_dir, runtime)
    try:
        server, runner = serve_executor(engine, f"{args.host}:{args.port}")
    except OSError as exc:
        raise SystemExit(f"inflight: {exc}") from None
    settle_garbage_collector()

    def shutdown(*_: object) -> None:
        server.stop(grace=2)
        runner.stop()

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    runner.run_forever()  # the model runs on this, the main, thread


async def _run_scheduler(args: argparse.Namespace, model_dir: str, executor_address: str) -> None:
    from inflight.model_store import resolve_model
    from scheduler_svc.engine_loop import AsyncEngine, EngineLimits
    from scheduler_svc.executor_client import GrpcExecutorConnection
    from scheduler_svc.metrics import start_metrics_server
    from scheduler_svc.scheduler import CapacityPolicy
    from scheduler_svc.service import start_scheduler_server
    from scheduler_svc.tokenizer import Tokenizer

    path = Path(model_dir).expanduser()
    try:
        tokenizer = Tokenizer(path if is_engine_dir(path) else resolve_model(model_dir))
    except (ValueError, ModuleNotFoundError) as exc:
        raise SystemExit(f"inflight: --model {model_dir}: {exc}") from None
    limits = EngineLimits(
        max_batch_size=getattr(args, "max_batch_size", 0), max_num_tokens=getattr(args, "max_num_tokens", 0),
        max_seq_len=getattr(args, "max_seq_len", 0), max_queue_size=args.max_queue_size,
        num_kv_blocks=getattr(args, "num_kv_blocks", 0), max_host_blocks=getattr(args, "max_host_blocks", 0),
        capacity_policy=CapacityPolicy(args.capacity_policy.upper()), enable_prefix_caching=args.enable_prefix_caching,
        overlap_scheduling=args.overlap_scheduling, adaptive_draft_length=args.adaptive_draft_length,
        max_chained_step_ms=args.max_chained_step_ms,
    )
    engine = AsyncEngine(GrpcExecutorConnection(executor_address), tokenizer, limits)
    await engine.start()
    settle_garbage_collector()
    metrics = None
    try:
        server = await start_scheduler_server(engine, f"{args.host}:{args.port}")
        if args.metrics_port:
            metrics = await start_metrics_server(engine.metrics_page, args.host, args.metrics_port)
    except OSError as exc:
        await engine.stop()
        raise SystemExit(f"inflight: {exc}") from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down")
    if metrics is not None:
        metrics.close()
    await server.stop()
    await engine.stop()


def run_scheduler(args: argparse.Namespace) -> None:
    _check_port_free(args.host, args.port, "--port")
    if args.metrics_port:
        _check_port_free(args.host, args.metrics_port, "--metrics-port")
    asyncio.run(_run_scheduler(args, args.model, args.executor))


def run_serve(args: argparse.Namespace) -> None:
    """The executor as a child process on loopback, the scheduler in this one."""
    _check_port_free(args.host, args.port, "--port")
    _check_port_free("127.0.0.1", args.executor_port, "--executor-port")
    if args.metrics_port:
        _check_port_free(args.host, args.metrics_port, "--metrics-port")
    # Build (or find) the engine here, once, so both processes use the same folder.
    engine_dir = _prepare_engine(args.model, args)
    draft_dir = speculative_config_from_args(args).draft_engine_dir
    executor_cmd = [
        sys.executable, "-m", "inflight", "--log-level", args.log_level, "executor", "--model", str(engine_dir),
        "--host", "127.0.0.1", "--port", str(args.executor_port), "--device", args.device,
        "--kv-cache-gb", str(args.kv_cache_gb), "--kv-cache-fraction", str(args.kv_cache_fraction),
        "--host-cache-gb", str(args.host_cache_gb),
        *(["--enforce-eager"] if args.enforce_eager else []),
        "--speculative", args.speculative,
        *(["--num-draft-tokens", str(args.num_draft_tokens)] if args.num_draft_tokens is not None else []),
        "--ngram-min", str(args.ngram_min), "--ngram-max", str(args.ngram_max),
        "--speculative-rounds", str(args.speculative_rounds), "--draft-tree", args.draft_tree,
        "--heads-lookup", str(args.heads_lookup),
        *(["--draft-model", str(draft_dir)] if draft_dir else []),
        *(["--draft-heads", str(Path(args.draft_heads).resolve())] if args.draft_heads else []),
        *(["--draft-vocab", str(args.draft_vocab)] if args.draft_vocab is not None else []),
    ]
    child = subprocess.Popen(executor_cmd)
    try:
        asyncio.run(_run_scheduler(args, str(engine_dir), f"127.0.0.1:{args.executor_port}"))
    finally:
        child.terminate()
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
