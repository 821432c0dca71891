"""Where a quantization format's perplexity loss comes from, on real weights.

The accuracy table (``quant_accuracy.py``) scores whole engines; this script
takes one unquantized engine and rounds parts of it in place through the same
quantize / dequantize functions the engines use, to answer:

* weights or activations? FP8 weights alone, FP8 per-token activations alone,
  both; and the weights with one scale per output channel instead of one per
  tensor (a format inflight does not build; would finer scales help?);
* which decoder layer? FP8 weights and activations in one layer at a time
  (``--per-layer``: one perplexity pass per decoder layer);
* how much does GPTQ rounding take back? FP8 weights rounded by GPTQ on the
  calibration corpus, with and without the activations.
* FP8 activations' mantissa or their range (``--sections fp8_range``)? Per-token
  E4M3 against E4M3's 3-bit mantissa with no exponent limit (no value
  underflows or saturates), and the share of each projection's inputs that the
  per-token scale puts below E4M3's smallest normal: would smoothing the
  activations' outliers (SmoothQuant's migration) help FP8?
* INT4's grid (``--sections int4``): round to nearest in groups of 128, 64 and 32
  with the engines' integer zero points, and in groups of 32 with a float zero
  point (each group's minimum and maximum exact: Q4_1's grid, a format inflight
  does not build) -- is the loss the format's, or this checkpoint's grid?

Every row is the held-out perplexity and its change against the unquantized
model (lm_head and embeddings are never rounded, as in the engines).

    python bench/quant_error_sources.py --device cpu --output bench/results/cpu_quant_error_sources_smollm2.json

the INT4 rows (``cpu_quant_error_sources_int4_smollm2.json``) with ``--sections int4``, and the
FP8 range rows (``cpu_quant_error_sources_fp8_range_smollm2.json``) with ``--sections fp8_range``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import log, resolve_device_and_dtype, write_report  # noqa: E402
from quant_common import environment, scratch_dir  # noqa: E402
from tqdm import tqdm  # noqa: E402

import torch  # noqa: E402
from executor_svc.build_config import BuildConfig, QuantConfig  # noqa: E402
from executor_svc.builder import build_engine  # noqa: E402
from executor_svc.engine import RuntimeConfig, load_engine  # noqa: E402
from executor_svc.model.llama import Linear  # noqa: E402
from executor_svc.quantization.calibration import calibrate  # noqa: E402
from executor_svc.quantization.corpus import calibration_texts, encode_texts, held_out_texts  # noqa: E402
from executor_svc.quantization.forward import PromptForward  # noqa: E402
from executor_svc.quantization.gptq import fp8_tensor_grid, gptq_round  # noqa: E402
from executor_svc.quantization.perplexity import perplexity  # noqa: E402
from executor_svc.quantization.quantize import (  # noqa: E402
    FP8_MAX, INT4_MAX, fake_quantize_int4, fp8_tensor_scale, round_fp8,
)
from executor_svc.quantization.sensitivity import round_fp8_tokens as fp8_activation_per_token  # noqa: E402
from executor_svc.quantization.sensitivity import round_fp8_weight as fp8_weight_per_tensor  # noqa: E402
from inflight.model_store import resolve_model  # noqa: E402

Rounding = Callable[[torch.Tensor], torch.Tensor]


def fp8_weight_per_channel(w: torch.Tensor) -> torch.Tensor:
    scales = (w.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (round_fp8(w.float(), scales).float() * scales).to(w.dtype)


def fp8_mantissa_only(x: torch.Tensor) -> torch.Tensor:
    """E4M3's 3 mantissa bits with an unbounded exponent: every value keeps its relative precision (no subnormals,
    no saturation), which is what FP8 activations would cost if their range were no object."""
    xf = x.float()
    step = torch.exp2(torch.floor(torch.log2(xf.abs().clamp(min=1e-30))) - 3)
    return (torch.round(xf / step) * step).to(x.dtype)


def fp8_subnormal_share(x: torch.Tensor) -> float:
    """Share of the nonzero inputs that a per-token E4M3 scale (the row's max at 448) puts below the smallest
    normal (2^-6), where E4M3 keeps fewer than its 3 mantissa bits."""
    rows = x.float().reshape(-1, x.shape[-1])
    scaled = rows / (rows.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    nonzero = scaled != 0
    return float(((scaled.abs() < 2.0 ** -6) & nonzero).sum() / nonzero.sum().clamp(min=1))


def int4_integer_zero(group_size: int) -> Rounding:
    """The engines' INT4 grid (round to nearest, integer zero point), groups of ``group_size`` input channels."""
    return lambda w: fake_quantize_int4(w, group_size).to(w.dtype)


def int4_float_zero(group_size: int) -> Rounding:
    """INT4 with a float zero point: each group's minimum and maximum are grid points (Q4_1's grid)."""
    def rounding(w: torch.Tensor) -> torch.Tensor:
        groups = w.float().reshape(w.shape[0], -1, group_size)
        low, high = groups.amin(dim=2, keepdim=True), groups.amax(dim=2, keepdim=True)
        step = ((high - low) / INT4_MAX).clamp(min=1e-12)
        return (torch.round((groups - low) / step) * step + low).reshape(w.shape).to(w.dtype)
    return rounding


class RoundedModel:
    """The engine's Linear layers (lm_head aside), with weights and inputs rounded on demand."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear) and n != "lm_head"}
        self.original = {n: m.weight.data.clone() for n, m in self.linears.items()}

    def apply(
        self, weights: dict[str, torch.Tensor] | Rounding | None = None, activations: Rounding | None = None,
        only: Callable[[str], bool] = lambda name: True,
    ) -> None:
        """Round the chosen layers: ``weights`` a function of the weight or a table of rounded weights."""
        for name, module in self.linears.items():
            chosen = only(name)
            weight = self.original[name]
            if chosen and weights is not None:
                weight = weights[name] if isinstance(weights, dict) else weights(weight)
            module.weight.data = weight
            rounding = activations if chosen else None
            module.forward = (  # an instance attribute shadows Linear.forward
                (lambda x, m=module, r=rounding: m.kernel(r(x), m.weight)) if rounding else
                (lambda x, m=module: m.kernel(x, m.weight))
            )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--eval-texts", type=int, default=1000, help="held-out texts (all 171 by default)")
    p.add_argument("--eval-max-tokens", type=int, default=512)
    p.add_argument("--calib-size", type=int, default=32, help="calibration texts for the GPTQ rows")
    p.add_argument("--calib-max-tokens", type=int, default=256)
    p.add_argument("--per-layer", action="store_true", help="add the one-layer-at-a-time rows")
    p.add_argument("--sections", default="fp8",
                   help="comma-separated: fp8 (FP8's sources and GPTQ), fp8_range (activations' mantissa or range), "
                        "int4 (INT4 grids)")
    p.add_argument("--work-dir", default=None)
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    sections = {part for part in args.sections.split(",") if part}
    if not sections or sections - {"fp8", "fp8_range", "int4"}:
        raise SystemExit(f"--sections takes fp8, fp8_range and/or int4, got {args.sections!r}")
    args.device, dtype = resolve_device_and_dtype(args.device, args.dtype)
    checkpoint = resolve_model(args.model)
    engine_dir = scratch_dir(args.work_dir) / "unquantized"
    config = BuildConfig(max_seq_len=1024, tokens_per_block=16, dtype=dtype, max_batch_size=16,
                         quant_config=QuantConfig(quant_algo="none"))
    build_engine(checkpoint, engine_dir, config, device=args.device, progress=False)
    engine = load_engine(engine_dir, RuntimeConfig(device=args.device, kv_cache_bytes=64 << 20))
    max_tokens = max(args.eval_max_tokens, args.calib_max_tokens)
    runner = PromptForward.create(
        engine.model, engine.model_config, max_tokens, engine.tokens_per_block, engine.device, engine.dtype
    )
    eval_ids = encode_texts(checkpoint, held_out_texts(args.eval_texts)[0], args.eval_max_tokens)
    rounded = RoundedModel(engine.model)

    def score() -> float:
        return perplexity(runner, eval_ids, progress=False)[0]

    baseline = score()
    log(f"unquantized perplexity {baseline:.4f}")
    rows: dict[str, dict] = {}

    def row(label: str, **apply) -> float:
        rounded.apply(**apply)
        ppl = score()
        rows[label] = {"perplexity": round(ppl, 4), "change": round(ppl - baseline, 4)}
        log(f"{label}: {ppl:.4f} ({ppl - baseline:+.4f})")
        return ppl

    if "int4" in sections:
        for group in (128, 64, 32):
            row(f"INT4 weights (groups of {group}, integer zero)", weights=int4_integer_zero(group))
        row("INT4 weights (groups of 32, float zero: Q4_1's grid)", weights=int4_float_zero(32))
    if "fp8" in sections:
        row("FP8 weights (per tensor)", weights=fp8_weight_per_tensor)
        row("FP8 weights (per output channel)", weights=fp8_weight_per_channel)
        row("FP8 activations (per token)", activations=fp8_activation_per_token)
        row("FP8 weights (per tensor) + activations (per token)", weights=fp8_weight_per_tensor,
            activations=fp8_activation_per_token)
        row("FP8 weights (per channel) + activations (per token)", weights=fp8_weight_per_channel,
            activations=fp8_activation_per_token)

        rounded.apply()
        calib_ids = encode_texts(checkpoint, calibration_texts("", args.calib_size)[0], args.calib_max_tokens)
        stats = calibrate(runner, rounded.linears, calib_ids, progress=True, hessians=True)
        gptq = {}
        for name in tqdm(rounded.linears, desc="GPTQ", unit="layer"):
            weight = rounded.original[name]
            found = gptq_round(weight, stats.layers[name].hessian, fp8_tensor_grid(fp8_tensor_scale(weight)))
            gptq[name] = found.weight.to(weight.dtype)
        del stats
        row("FP8 weights (per tensor, GPTQ)", weights=gptq)
        row("FP8 weights (per tensor, GPTQ) + activations (per token)", weights=gptq,
            activations=fp8_activation_per_token)

    subnormal_share = {}
    if "fp8_range" in sections:
        row("FP8 activations (per token)", activations=fp8_activation_per_token)
        row("FP8 activations (3-bit mantissa, unbounded exponent)", activations=fp8_mantissa_only)
        shares: dict[str, list[float]] = {}

        def record(x: torch.Tensor, name: str) -> torch.Tensor:
            shares.setdefault(name.rsplit(".", 1)[-1], []).append(fp8_subnormal_share(x))
            return x

        # Every projection's inputs over the first 16 held-out texts, each by its kind (qkv, o, gate_up, down).
        for name, module in rounded.linears.items():
            module.forward = lambda x, m=module, n=name: m.kernel(record(x, n), m.weight)
        perplexity(runner, eval_ids[:16], progress=False)
        subnormal_share = {kind: round(sum(v) / len(v), 6) for kind, v in shares.items()}
        log(f"inputs below E4M3's smallest normal after per-token scaling: {subnormal_share}")

    per_layer = {}
    if args.per_layer:
        for index in tqdm(range(engine.model_config.num_layers), desc="one layer at a time", unit="layer"):
            prefix = f"layers.{index}."
            rounded.apply(weights=fp8_weight_per_tensor, activations=fp8_activation_per_token,
                          only=lambda name, prefix=prefix: name.startswith(prefix))
            per_layer[index] = round(score() - baseline, 4)
    rounded.apply()

    payload = {
        "environment": environment(), "model": args.model, "dtype": dtype,
        "settings": {k: v for k, v in vars(args).items() if k not in ("output", "work_dir")},
        "eval": {"texts": len(eval_ids), "corpus": held_out_texts(0)[1]},
        "unquantized_perplexity": round(baseline, 4),
        "rows": rows,
        "fp8_subnormal_share_by_projection": subnormal_share or None,
        "per_layer_fp8_change": per_layer,
        "per_layer_fp8_change_sum": round(sum(per_layer.values()), 4) if per_layer else None,
    }
    if args.output:
        write_report("bench/quant_error_sources.py", argv, args.device, Path(args.output), payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
