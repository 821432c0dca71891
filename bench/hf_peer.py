"""The peer side of the serving benchmark: Hugging Face transformers ``generate`` on the same prompts."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from bench_common import MONITOR, foreign, log, summarize_ms, wait_idle


# --------------------------------------------------------------------------- the peer


def run_peer(args, model_dir: Path, device: str, dtype: str, prompts: list[list[int]], batch_sizes: list[int], pad_token_id: int) -> tuple[dict, list[list[int]]]:
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    log(f"loading transformers peer ({dtype} on {device})")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype).to(device).eval()
    gen_kwargs = dict(
        max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False,
        temperature=None, top_p=None, top_k=None, pad_token_id=pad_token_id,
    )

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def generate(batch: list[list[int]], max_new: int | None = None) -> torch.Tensor:
        # Left padding + attention mask (all prompts have the same length here, so nothing is padded,
        # but the code path is the general one).
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, p in enumerate(batch):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        kwargs = dict(gen_kwargs)
        if max_new is not None:
            kwargs.update(max_new_tokens=max_new, min_new_tokens=max_new)
        with torch.inference_mode():
            out = model.generate(ids.to(device), attention_mask=mask.to(device), **kwargs)
        sync()
        return out[:, width:]

    if args.warmup_tokens > 0:
        generate(prompts[: max(batch_sizes)], args.warmup_tokens)
        generate(prompts[:1], args.warmup_tokens)

    def timed(fn, what: str) -> tuple:
        """fn() timed after an idle wait; again (up to --attempts) while others took > --max-foreign of the CPUs."""
        best, tries = None, []
        for attempt in range(args.attempts):
            idle = wait_idle(args, what)
            snap = MONITOR.snapshot()
            t0 = time.perf_counter()
            out = fn()
            seconds = time.perf_counter() - t0
            cpu = MONITOR.report(snap)
            tries.append({"seconds": seconds, "foreign_share": cpu["foreign_share"]})
            if best is None or foreign(cpu) < foreign(best[2]):
                best = (out, seconds, cpu, idle)
            if foreign(cpu) <= args.max_foreign:
                break
            log(f"{what}: other processes took {foreign(cpu):.0%} of the CPUs; measuring again")
        return (*best, tries)

    n = max(batch_sizes)
    latencies, outputs, cpu_windows, waited, retried = [], [], [], 0.0, 0
    # Only the requests are timed (throughput = tokens / sum of request times), so the
    # idle wait and any repeat can be per request.
    for i, p in enumerate(tqdm(prompts[:n], desc="hf one-at-a-time", unit="req", file=sys.stderr, leave=False)):
        out, seconds, cpu, idle, tries = timed(lambda: generate([p]), f"hf one-at-a-time request {i}")
        latencies.append(seconds)
        cpu_windows.append(cpu)
        waited += (idle or {}).get("waited_s", 0.0)
        retried += len(tries) - 1
        assert out.shape[1] == args.output_len, out.shape
        outputs.append(out[0].tolist())
    cpu = MONITOR.merge(cpu_windows)
    clean = [i for i, w in enumerate(cpu_windows) if foreign(w) <= args.max_foreign]
    idle = {
        "waited_s": round(waited, 1), "repeated_requests": retried,
        "per_request_foreign_share": [None if w["foreign_share"] is None else round(w["foreign_share"], 3) for w in cpu_windows],
    }
    total = n * args.output_len
    peer: dict = {
        "library": "transformers",
        "transformers_version": __import__("transformers").__version__,
        "dtype": dtype,
        "one_at_a_time": {
            "num_requests": n,
            "wall_s": sum(latencies),
            "total_output_tokens": total,
            "output_tokens_per_s": total / sum(latencies),
            # the same over the requests during which others took <= --max-foreign of the CPUs
            "num_clean_requests": len(clean),
            "output_tokens_per_s_clean_requests": len(clean) * args.output_len / sum(latencies[i] for i in clean) if clean else None,
            "request_latency_ms": summarize_ms(latencies),
            "cpu": cpu,
            "idle_wait": idle,
        },
        "padded_batch": {},
    }
    log(f"hf one-at-a-time: {peer['one_at_a_time']['output_tokens_per_s']:.1f} out tok/s")
    for b in batch_sizes:
        if b == 1:
            continue
        with tqdm(total=1, desc=f"hf padded batch {b}", unit="batch", file=sys.stderr, leave=False) as bar:
            out, wall, cpu, idle, tries = timed(lambda: generate(prompts[:b]), f"hf padded batch {b}")
            bar.update()
        assert out.shape == (b, args.output_len), out.shape
        peer["padded_batch"][str(b)] = {
            "batch_size": b, "wall_s": wall, "total_output_tokens": b * args.output_len,
            "output_tokens_per_s": b * args.output_len / wall, "cpu": cpu, "idle_wait": idle, "attempts": tries,
        }
        log(f"hf padded batch {b}: {b * args.output_len / wall:.1f} out tok/s")
    del model
    return peer, outputs


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How closely inflight's greedy outputs match transformers' one-at-a-time ones (sanity, not a target)."""
    prefix = []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefix.append(n)
    return {
        "num_requests": len(prefix),
        "identical_outputs": sum(1 for x, y in zip(a, b) if x == y),
        "mean_matching_prefix_tokens": float(np.mean(prefix)) if prefix else None,
        "min_matching_prefix_tokens": min(prefix) if prefix else None,
    }
