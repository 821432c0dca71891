"""Serving benchmark: inflight over its real gRPC path vs. Hugging Face ``generate``.

Starts ``python -m inflight serve`` as a subprocess on free ports, waits until
it answers, sends N concurrent streaming requests of exactly ``--input-len``
prompt tokens and ``--output-len`` output tokens (greedy, ``ignore_eos``),
measures throughput, TTFT, TPOT and inter-token latency, and stops the server
(always, also on error or Ctrl-C). With ``--peer`` it then loads the same model
in transformers and times ``generate`` on the same prompts, one at a time and
as one left-padded batch, after the server is gone so the two never share CPU.

    python bench/serving.py --concurrency 1,16 --input-len 128 --output-len 128 \\
        --device cpu --plot --output bench/results/cpu_smollm2_128x128.json

See bench/README.md for the JSON fields.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import shlex
import signal
import sys
from pathlib import Path

from bench_common import build_prompts, device_info, git_info, log, resolve_device_and_dtype
from hf_peer import agreement, run_peer
from inflight_load import InflightServer, run_inflight

TARGETS = {  # acceptance criteria (CPU, SmolLM2): ratio name -> minimum
    "inflight_c16_over_hf_one_at_a_time": 3.0,
    "inflight_c16_over_hf_padded_batch_16": 1.0,
    "inflight_c1_over_hf_one_at_a_time": 1.0,  # batch 1 vs batch 1
}


# --------------------------------------------------------------------------- report


def ratios(inflight: dict, peer: dict | None) -> tuple[dict, dict]:
    if not peer:
        return {}, {}
    one = peer["one_at_a_time"]
    # Other processes only slow the peer down, which would flatter inflight: when some of its
    # requests were disturbed, compare with the undisturbed ones.
    if 0 < one["num_clean_requests"] < one["num_requests"]:
        hf_one, basis = one["output_tokens_per_s_clean_requests"], f"{one['num_clean_requests']} undisturbed requests"
    else:
        hf_one, basis = one["output_tokens_per_s"], f"all {one['num_requests']} requests"
    out: dict = {"hf_one_at_a_time_output_tokens_per_s_used": hf_one, "hf_one_at_a_time_basis": basis}
    for c, m in inflight.items():
        tps = m["output_tokens_per_s"]
        out[f"inflight_c{c}_over_hf_one_at_a_time"] = tps / hf_one
        if c in peer["padded_batch"]:
            out[f"inflight_c{c}_over_hf_padded_batch_{c}"] = tps / peer["padded_batch"][c]["output_tokens_per_s"]
    acceptance = {
        name: {"value": out[name], "target": f">= {target:g}", "met": bool(out[name] >= target)}
        for name, target in TARGETS.items()
        if name in out
    }
    return out, acceptance


def contention_warnings(result: dict, limit: float = 0.05) -> list[str]:
    """Phases during which other processes took more than ``limit`` of the machine's CPU."""
    phases = [(f"inflight c={c}", m["cpu"]) for c, m in result["inflight"].items()]
    if result.get("peer"):
        phases.append(("hf one-at-a-time", result["peer"]["one_at_a_time"]["cpu"]))
        phases += [(f"hf padded batch {b}", m["cpu"]) for b, m in result["peer"]["padded_batch"].items()]
    return [
        f"{name}: other processes used {cpu['foreign_share']:.0%} of the machine's CPU during the timed phase"
        for name, cpu in phases
        if cpu.get("foreign_share") is not None and cpu["foreign_share"] > limit
    ]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, values, colors = [], [], []
    for c, m in result["inflight"].items():
        labels.append(f"inflight\n{c} concurrent")
        values.append(m["output_tokens_per_s"])
        colors.append("tab:blue")
    peer = result.get("peer")
    if peer:
        labels.append("HF generate\none at a time")
        values.append(peer["one_at_a_time"]["output_tokens_per_s"])
        colors.append("tab:orange")
        for b, m in peer["padded_batch"].items():
            labels.append(f"HF generate\npadded batch {b}")
            values.append(m["output_tokens_per_s"])
            colors.append("tab:red")
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(labels)), 4.5))
    bars = ax.bar(range(len(values)), values, color=colors)
    ax.bar_label(bars, labels=[f"{v:.0f}" for v in values], padding=2)
    ax.set_xticks(range(len(values)), labels)
    ax.set_ylabel("output tokens / s")
    dev = result["device"]
    where = dev.get("gpu") or f"{dev.get('cpu_model')}, {dev.get('cpu_affinity', dev.get('cpu_count'))} cores"
    ax.set_title(f"{Path(result['model']).name}: {result['input_len']} in / {result['output_len']} out tokens\n{where}", fontsize=10)
    ax.margins(y=0.15)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--concurrency", default="1,16", help="comma-separated concurrency levels, run in order")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    p.add_argument("--model", default="smollm2-135m-instruct", help="model name, HF folder or .gguf (as `inflight serve`)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto = float32 on CPU, bfloat16 on GPU (server and peer alike)")
    p.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True, help="also time transformers generate")
    p.add_argument("--output", default="bench/results/serving.json", help="JSON result path")
    p.add_argument("--plot", action="store_true", help="also write a PNG bar chart next to the JSON")
    p.add_argument("--wait-idle", type=float, default=300.0,
                   help="before each timed phase, wait up to this many seconds for other processes to leave the CPUs; 0 = don't")
    p.add_argument("--idle-threshold", type=float, default=0.10,
                   help="'idle' = other processes use less than this share of the machine's CPUs")
    p.add_argument("--attempts", type=int, default=3,
                   help="measure a phase up to this many times while other processes took more than --max-foreign of the CPUs "
                        "during it; the least disturbed attempt is kept, all are listed")
    p.add_argument("--max-foreign", type=float, default=0.05, help="see --attempts")
    p.add_argument("--warmup-tokens", type=int, default=8,
                   help="output tokens of the untimed warmup batch (max-concurrency requests, other prompts); 0 = none")
    g = p.add_argument_group("server")
    g.add_argument("--port", type=int, default=0, help="client port (0 = a free one)")
    g.add_argument("--executor-port", type=int, default=0, help="executor port (0 = a free one)")
    g.add_argument("--max-batch-size", type=int, default=256)
    g.add_argument("--max-num-tokens", type=int, default=8192)
    g.add_argument("--max-seq-len", type=int, default=0, help="0 = input-len + output-len")
    g.add_argument("--tokens-per-block", type=int, default=32)
    g.add_argument("--kv-cache-gb", type=float, default=0.0, help="0 = the server's default")
    g.add_argument("--server-arg", action="append", default=[], help="extra argument for `inflight serve` (repeatable)")
    g.add_argument("--server-log", default="", help="keep the server's log here (default: a temp file)")
    g.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for the server")
    args = p.parse_args(argv)
    args.levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    if not args.levels or min(args.levels) < 1:
        p.error("--concurrency needs positive integers")
    if args.input_len < 1 or args.output_len < 1:
        p.error("--input-len and --output-len must be positive")
    if args.max_seq_len == 0:
        args.max_seq_len = args.input_len + args.output_len
    args.warmup_tokens = max(0, min(args.warmup_tokens, args.output_len))
    args.attempts = max(1, args.attempts)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM -> SystemExit, so the server is stopped by the finally/with blocks below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from transformers import AutoTokenizer

    from inflight.model_store import resolve_model

    device, dtype = resolve_device_and_dtype(args.device, args.dtype)
    model_dir = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    n = max(args.levels)
    prompt_sets = [build_prompts(tokenizer, n, args.input_len, offset=k * (n + 3)) for k in range(args.attempts + 1)]
    prompts, warmup_prompts = prompt_sets[0], prompt_sets.pop()
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    result: dict = {
        "benchmark": "inflight serving (gRPC)",
        "command": shlex.join(sys.argv if argv is None else ["bench/serving.py", *argv]),
        "git": git_info(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": device_info(device),
        "model": args.model,
        "dtype": dtype,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "concurrency_levels": args.levels,
        "sampling": {"temperature": 0.0, "ignore_eos": True, "max_tokens": args.output_len},
        "warmup_tokens": args.warmup_tokens,
    }

    server = InflightServer(args, device, dtype)
    # The server as `python -m inflight ...`: no paths of the machine that ran it.
    result["server_command"] = shlex.join(["python", *server.cmd[1:]])
    with server:
        server_info, inflight, inflight_outputs = asyncio.run(run_inflight(args, server, prompt_sets, warmup_prompts, args.levels))
    result["server"] = server_info
    result["inflight"] = inflight

    peer = None
    if args.peer:  # the server is stopped: the peer has the machine to itself
        peer, hf_outputs = run_peer(args, model_dir, device, dtype, prompts, args.levels, pad_token_id)
        peer["agreement_with_inflight"] = agreement(inflight_outputs[n], hf_outputs)
    result["peer"] = peer
    result["ratios"], result["acceptance"] = ratios(inflight, peer)
    result["contention_warnings"] = contention_warnings(result)
    for w in result["contention_warnings"]:
        log(f"WARNING: {w}")

    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {out}")
    if args.plot:
        png = out.with_suffix(".png")
        plot(result, png)
        log(f"wrote {png}")
    for name, r in result["ratios"].items():
        if not name.startswith("inflight_"):
            continue
        target = result["acceptance"].get(name)
        log(f"{name} = {r:.2f}" + (f"  (target {target['target']}: {'met' if target['met'] else 'MISSED'})" if target else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
