"""Choosing an implementation per layer kind at build time (TensorRT's tactic selection).

For each kind the builder asks for "auto" or a name. "auto" times every
registered candidate that supports the target device and dtype on inputs
shaped like the model's, on the target device, and keeps the fastest; the
timings go into the engine manifest so the choice can be read back and
reproduced. A named kernel that cannot run is a build error, or with
``allow_fallback`` a loud warning and the reference implementation, recorded
as a fallback. The rope and attention candidates are timed on a KV cache of
the engine's cache dtype (1-byte for an FP8 / INT8 cache).
"""

from __future__ import annotations

import importlib
import logging
import statistics
import time
from collections.abc import Callable

import torch

from executor_svc.build_config import PLUGIN_KINDS, BuildConfig
from executor_svc.engine_file import PluginChoice
from executor_svc.model.config import ModelConfig
from executor_svc.quantization.kv_cache import kv_cache_dtype
from plugins.attention_metadata import AttentionMetadata
from plugins.registry import KernelSpec, list_kernels
from plugins.timing import fastest_in_rounds, graph_time_us

log = logging.getLogger("inflight.build")

REFERENCE = "torch"
GEMV = "triton_gemv"  # plugins/gemm_decode.py: per-shape tactics, timed here at build
DECODE = "triton_decode"  # the gemm_fp8 / gemm_w4a16 candidate of plugins/quant_gemm_decode.py: per-shape tactics too
# The arguments of one call, or of several calls timed together (their times add up).
BenchArgs = Callable[[], tuple | list[tuple]]

BENCHMARKS = {
    "rmsnorm": "x[{tokens}, hidden] + residual",
    "rope": "q, k rotated + k, v written to the KV cache, {tokens} tokens",
    "activation": "[{tokens}, 2 x intermediate]",
    "gemm": "a layer's projections (qkv, o, gate_up, down) at 1 token, then qkv at {tokens} tokens",
    "attention": "generation step, 16 requests x 512 cached tokens",
    "argmax": "greedy choice over float32 logits of 1 row, then of {rows} rows",
}


class PluginUnavailableError(RuntimeError):
    """A requested plugin cannot run on the build target."""


def benchmark_inputs(kind: str, model: ModelConfig, build: BuildConfig, device: torch.device, dtype: torch.dtype) -> BenchArgs:
    """Arguments shaped like one of the model's layers, for timing ``kind``."""
    tokens = min(build.max_num_tokens, 256)
    gen = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    kv_dtype = kv_cache_dtype(build.quant_config.kv_cache_quant_algo, dtype)

    def kv_randn(*shape: int) -> torch.Tensor:  # cache contents, in the cache's dtype
        return torch.randn(*shape, generator=gen).to(device=device, dtype=kv_dtype)

    hidden, heads, kv_heads, dim = model.hidden_size, model.num_heads, model.num_kv_heads, model.head_dim
    if kind == "rmsnorm":
        x, residual, weight = randn(tokens, hidden), randn(tokens, hidden), randn(hidden)
        return lambda: (x, weight, model.rms_norm_eps, residual)
    if kind == "rope":
        q, k, v = randn(tokens, heads, dim), randn(tokens, kv_heads, dim), randn(tokens, kv_heads, dim)
        cos, sin = randn(4096, dim), randn(4096, dim)
        positions = torch.arange(tokens, device=device)
        # Twice the slots the tokens need, scattered: requests' blocks are not contiguous in the pool.
        block = build.tokens_per_block
        num_blocks = 2 * -(-tokens // block)
        k_cache, v_cache = kv_randn(num_blocks, block, kv_heads, dim), kv_randn(num_blocks, block, kv_heads, dim)
        slots = torch.randperm(num_blocks * block, generator=gen)[:tokens].to(device)
        return lambda: (q, k, v, cos, sin, positions, k_cache, v_cache, slots)
    if kind == "activation":
        x = randn(tokens, 2 * model.intermediate_size)
        return lambda: (x,)
    if kind == "gemm":
        # A batch-1 decode step's layer (each weight read once: what GEMV kernels are for), then a
        # context chunk's qkv projection (what tensor-core tiles are for).
        calls = [(randn(1, k), randn(n, k)) for n, k in linear_shapes(model)[:4]]
        calls.append((randn(tokens, hidden), calls[0][1]))
        return lambda: calls
    if kind == "attention":
        return _attention_inputs(build, heads, kv_heads, dim, randn, kv_randn, device)
    if kind == "argmax":  # logits come out of the LM head in float32: a batch-1 step, then a small batch
        calls = [(torch.randn(rows, model.vocab_size, generator=gen).to(device),) for rows in argmax_rows(build)]
        return lambda: calls
    raise ValueError(f"unknown kind {kind!r}")


def argmax_rows(build: BuildConfig) -> tuple[int, ...]:
    """Rows of the argmax timings: one (batch-1 decode), then the largest batch up to 16."""
    return tuple(sorted({1, min(build.max_batch_size, 16)}))


def linear_shapes(model: ModelConfig) -> list[tuple[int, int]]:
    """(N, K) of a decoder layer's fused projections (qkv, o, gate_up, down), then of the LM head."""
    hidden, q_size, kv_size = model.hidden_size, model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    return [(q_size + 2 * kv_size, hidden), (hidden, q_size), (2 * model.intermediate_size, hidden),
            (hidden, model.intermediate_size), (model.vocab_size, hidden)]


def _attention_inputs(
    build: BuildConfig, heads: int, kv_heads: int, dim: int, randn, kv_randn, device: torch.device
) -> BenchArgs:
    """A generation step: min(max_batch_size, 16) requests with 512 cached tokens each."""
    block, batch, context = build.tokens_per_block, min(build.max_batch_size, 16), 512
    blocks_per_request = -(-context // block)
    k_cache = kv_randn(batch * blocks_per_request, block, kv_heads, dim)
    v_cache = kv_randn(batch * blocks_per_request, block, kv_heads, dim)
    tables = torch.arange(batch * blocks_per_request, device=device).view(batch, blocks_per_request)
    lens = torch.full((batch,), context, device=device)
    meta = AttentionMetadata(
        query_start=list(range(batch + 1)), context_lens=[context] * batch, block_tables=tables, context_lens_t=lens,
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device=device),
        single_query_rows=torch.arange(batch, device=device), single_query_tokens=torch.arange(batch, device=device),
        multi_query_rows=[],
    )
    q = randn(batch, heads, dim)
    return lambda: (q, k_cache, v_cache, meta, dim**-0.5)


def time_kernel(fn: Callable, args: BenchArgs, device: torch.device, repeats: int = 7) -> float:
    """Time of one call in microseconds.

    On a GPU: the GPU time of the call replayed from a CUDA graph (median of
    ``repeats`` timings of 20 replays each), because generation steps run from
    graphs, where launch overhead is gone and only the kernels' own time
    counts. A call that cannot be captured is timed by CUDA events around 20
    back-to-back calls instead. On the CPU: the median wall time of one call.
    """
    made = args()
    arg_sets = made if isinstance(made, list) else [made]

    def run() -> None:
        for call_args in arg_sets:
            fn(*call_args)

    for _ in range(2):  # warm-up: compiles and autotunes outside any measurement
        run()
    if device.type == "cuda":
        return _time_on_gpu(run, device, repeats)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def _time_on_gpu(run: Callable[[], None], device: torch.device, repeats: int, calls: int = 20) -> float:
    try:
        return graph_time_us([run] * calls, device, repeats, warmup=0)  # time_kernel warmed up already
    except Exception:  # noqa: BLE001 - not capturable (host reads, allocations): time it eagerly
        torch.cuda.synchronize(device)
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(samples)


def choose(
    kind: str, requested: str, candidates: list[KernelSpec], device: torch.device, dtype: torch.dtype,
    args: BenchArgs, allow_fallback: bool,
) -> PluginChoice:
    """Pick one of ``candidates`` (all registered kernels of ``kind``) for the target."""
    runnable = [c for c in candidates if c.supports(device, dtype)]
    if requested != "auto":
        spec = next((c for c in candidates if c.name == requested), None)
        if spec is not None and spec.supports(device, dtype):
            return PluginChoice(name=spec.name, requested=requested, timings_us={spec.name: time_kernel(spec.fn, args, device)})
        why = (
            f"no {kind} plugin named {requested!r} (registered: {sorted(c.name for c in candidates)})"
            if spec is None
            else f"{kind} plugin {requested!r} cannot run on {device.type} with {dtype} "
            f"(it supports {sorted(spec.device_types)}, {sorted(map(str, spec.dtypes))})"
        )
        if not allow_fallback:
            raise PluginUnavailableError(f"{why}; choose another, use 'auto', or pass --allow-fallback")
        log.warning("FALLBACK: %s; using the %r reference implementation instead", why, REFERENCE)
        reference = next(c for c in runnable if c.name == REFERENCE)
        return PluginChoice(
            name=REFERENCE, requested=requested, fallback=True, note=why,
            timings_us={REFERENCE: time_kernel(reference.fn, args, device)},
        )
    if not runnable:
        raise PluginUnavailableError(f"no {kind} plugin can run on {device.type} with {dtype}")
    specs = {candidate.name: candidate for candidate in runnable}
    # A kernel that refuses this model's shapes (e.g. a head_dim it cannot hold) raises ValueError; the
    # reference must serve every model.
    timings, refusals = fastest_in_rounds(
        list(specs), lambda name: time_kernel(specs[name].fn, args, device),
        skips=lambda name, exc: isinstance(exc, ValueError) and name != REFERENCE,
    )
    refused = []
    for name, exc in refusals.items():
        log.info("%s plugin %r cannot serve this model: %s", kind, name, exc)
        refused.append(f"{name}: {exc}")
    best = min(timings, key=timings.__getitem__)
    return PluginChoice(name=best, requested="auto", timings_us=timings, note="; ".join(refused))


# Candidates with per-shape variants (tactics), by kind: (candidate, its module, the function that times
# the variants on weight shapes and installs the fastest, the one that installs recorded ones).
TACTIC_KERNELS = {
    "gemm": (GEMV, "plugins.gemm_decode", "tune_tactics", "set_tactics"),
    "gemm_fp8": (DECODE, "plugins.quant_gemm_decode", "tune_fp8_tactics", "set_fp8_tactics"),
    "gemm_w4a16": (DECODE, "plugins.quant_gemm_decode", "tune_int4_tactics", "set_int4_tactics"),
}


def tune_tactics(
    kind: str, requested: str, candidates: list[KernelSpec], model: ModelConfig, device: torch.device,
    dtype: torch.dtype, **weight_format,
) -> dict[str, dict[str, dict]]:
    """Per-shape variants of the candidates that have them, timed on the model's weight shapes before the
    candidates are timed against each other: candidate -> {"NxK": {"tactic": variant, "timings_us": ...}}.
    ``weight_format``: what else the kind's timing function takes (an INT4 ``group_size``)."""
    if kind not in TACTIC_KERNELS:
        return {}
    name, module, tune, _ = TACTIC_KERNELS[kind]
    if requested not in ("auto", name) or not any(c.name == name and c.supports(device, dtype) for c in candidates):
        return {}
    report = getattr(importlib.import_module(module), tune)(linear_shapes(model), device, dtype, **weight_format)
    for key, entry in report.items():
        log.info("%s %s: %s (%s)", kind, key, entry["tactic"],
                 ", ".join(f"{n} {t:.1f} us" for n, t in entry["timings_us"].items()))
    return {name: report}


def record_tactics(choice: PluginChoice, tactics: dict[str, dict[str, dict]]) -> None:
    """Put the chosen candidate's tuning report (from ``tune_tactics``) into the engine's record of it."""
    report = tactics.get(choice.name)
    if report:
        choice.tactics = {key: entry["tactic"] for key, entry in report.items()}
        choice.tactic_timings_us = {key: entry["timings_us"] for key, entry in report.items()}


def apply_tactics(plugins: dict[str, PluginChoice]) -> None:
    """Install the per-shape variants an engine's chosen kernels were built with (before they run).

    An engine built by another version of the kernels may name variants this one no longer has: its
    shapes then run the default variant (a warning says so) rather than the engine failing to load.
    """
    for kind, (name, module, _, install) in TACTIC_KERNELS.items():
        choice = plugins.get(kind)
        if choice is not None and choice.name == name and choice.tactics:
            try:
                getattr(importlib.import_module(module), install)(choice.tactics)
            except ValueError as exc:
                log.warning("%s: the engine's per-shape tiles are not this version's (%s); its shapes run the "
                            "default tile, rebuild the engine to time them again", kind, exc)


def select_plugins(model: ModelConfig, build: BuildConfig, device: torch.device, dtype: torch.dtype) -> dict[str, PluginChoice]:
    registered = list_kernels()
    choices = {}
    for kind in PLUGIN_KINDS:
        candidates = [spec for spec in registered if spec.kind == kind]
        tactics = tune_tactics(kind, build.plugin_for(kind), candidates, model, device, dtype)
        args = benchmark_inputs(kind, model, build, device, dtype)
        choices[kind] = choose(kind, build.plugin_for(kind), candidates, device, dtype, args, build.allow_fallback)
        record_tactics(choices[kind], tactics)
        choices[kind].benchmark = BENCHMARKS[kind].format(tokens=min(build.max_num_tokens, 256),
                                                          rows=argmax_rows(build)[-1])
        log.info("%s: %s (%s)", kind, choices[kind].name, ", ".join(f"{n} {t:.0f} us" for n, t in choices[kind].timings_us.items()))
    return choices
