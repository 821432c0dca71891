"""From what a user names (a model, a checkpoint, an engine folder) to an engine folder.

``--model`` everywhere accepts an engine folder (built by ``inflight build``),
a Hugging Face folder, a ``.gguf`` file, or a known model name; anything but an
engine is built on the fly and cached, keyed by checkpoint, build config and
device, so ``inflight serve`` stays one command.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from executor_svc.build_config import PLUGIN_KINDS, BuildConfig, QuantConfig
from executor_svc.engine_cache import build_cached
from executor_svc.engine_file import is_engine_dir
from inflight.model_store import default_cache_dir, resolve_model


def add_build_flags(p: argparse.ArgumentParser) -> None:
    """Flags of BuildConfig, shared by build, serve and executor."""
    g = p.add_argument_group("build")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--max-batch-size", type=int, default=256, help="most requests per step")
    g.add_argument("--max-num-tokens", type=int, default=8192, help="most tokens per step")
    g.add_argument("--max-seq-len", type=int, default=0, help="longest prompt + output (default: the model's)")
    g.add_argument("--tokens-per-block", type=int, default=32, help="tokens per KV-cache block")
    g.add_argument("--quant-algo", default="none",
                   help="none, W8A16, W4A16_AWQ, W8A8_SQ_PER_CHANNEL_PER_TOKEN or FP8 (see `inflight build --help`)")
    g.add_argument(
        "--kv-cache-quant-algo", default="none",
        help="none, FP8 or INT8: a 1-byte KV cache (twice the tokens per byte) with calibrated per-layer scales",
    )
    g.add_argument(
        "--plugin", action="append", default=[], metavar="KIND=NAME",
        help=f"implementation for a layer kind ({', '.join(PLUGIN_KINDS)}); default auto = fastest measured",
    )
    g.add_argument("--allow-fallback", action="store_true", help="use the reference kernel (loudly) when a plugin cannot run")
    g.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks (1)")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"], help="dummy = random weights of the model's shape")
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (GPU when there is one)")


def build_config_from_args(args: argparse.Namespace) -> BuildConfig:
    plugins = {}
    for item in args.plugin:
        kind, sep, name = item.partition("=")
        if not sep:
            raise SystemExit(f"--plugin takes KIND=NAME, got {item!r}")
        plugins[kind] = name
    return BuildConfig(
        max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len, max_num_tokens=args.max_num_tokens,
        tokens_per_block=args.tokens_per_block, dtype=args.dtype,
        quant_config=QuantConfig(args.quant_algo, args.kv_cache_quant_algo), plugin_config=plugins,
        tp_size=args.tp_size, allow_fallback=args.allow_fallback,
    )


def prepare_engine(model: str, build: BuildConfig, device: str, load_format: str, progress: bool = True) -> Path:
    """The engine folder for ``model``: as given when it is one, else built (once) into the cache."""
    path = Path(model).expanduser()
    if path.is_dir() and is_engine_dir(path):
        return path
    checkpoint = resolve_model(model, progress=progress)
    return build_cached(checkpoint, build, default_cache_dir(), device, load_format, progress)
