"""Smoke run of bench/serving.py: tiny lengths, real server over gRPC, real peer.

Checks that the run completes and the JSON has its fields; no timing assertions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def interpreted_smoke(script: str, tmp_path: Path, timeout: float) -> dict:
    """``bench/<script> --device cpu --smoke`` through Triton's interpreter: its JSON, after a clean exit."""
    out = tmp_path / (Path(script).stem + ".json")
    cmd = [sys.executable, str(REPO / "bench" / script), "--device", "cpu", "--smoke", "--output", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"stderr:\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


@pytest.mark.timeout(180)
def test_bench_serving_smoke(tmp_path: Path) -> None:
    out = tmp_path / "smoke.json"
    cmd = [
        sys.executable, str(REPO / "bench" / "serving.py"),
        "--concurrency", "1,2", "--input-len", "16", "--output-len", "4", "--device", "cpu",
        "--warmup-tokens", "2", "--wait-idle", "0", "--attempts", "1", "--kv-cache-gb", "0.05", "--plot", "--output", str(out),
        "--server-log", str(tmp_path / "server.log"),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, f"stderr:\n{proc.stderr[-4000:]}"

    result = json.loads(out.read_text())
    for key in ("command", "git", "date", "device", "model", "dtype", "input_len", "output_len", "server",
                "inflight", "peer", "ratios", "acceptance"):
        assert key in result, key
    assert result["input_len"] == 16 and result["output_len"] == 4
    assert "commit" in result["git"] and "dirty" in result["git"]
    assert result["device"]["device"] == "cpu" and result["device"]["torch"]

    assert set(result["inflight"]) == {"1", "2"}
    for c, level in result["inflight"].items():
        assert level["concurrency"] == int(c)
        assert level["total_output_tokens"] == int(c) * 4
        assert level["output_tokens_per_s"] > 0
        for metric in ("ttft_ms", "tpot_ms", "itl_ms"):
            assert level[metric]["p50"] is not None and level[metric]["p99"] is not None

    peer = result["peer"]
    assert peer["one_at_a_time"]["total_output_tokens"] == 2 * 4
    assert peer["one_at_a_time"]["output_tokens_per_s"] > 0
    assert peer["padded_batch"]["2"]["output_tokens_per_s"] > 0
    assert peer["agreement_with_inflight"]["num_requests"] == 2
    for name in ("inflight_c1_over_hf_one_at_a_time", "inflight_c2_over_hf_one_at_a_time", "inflight_c2_over_hf_padded_batch_2"):
        assert result["ratios"][name] > 0
    assert "inflight_c1_over_hf_one_at_a_time" in result["acceptance"]

    assert out.with_suffix(".png").stat().st_size > 0


@pytest.mark.timeout(300)
def test_bench_quant_gemm_kernels_smoke(tmp_path: Path) -> None:
    """bench/quant_gemm_kernels.py on tiny shapes through Triton's interpreter: the JSON has every candidate."""
    result = interpreted_smoke("quant_gemm_kernels.py", tmp_path, timeout=280)
    for key in ("command", "git", "date", "device", "layers", "rows", "defaults", "summary", "best", "results",
                "variants"):
        assert key in result, key
    assert result["device"]["device"] == "cpu" and result["rows"] == [1, 3]
    impls = {(row["format"], row["impl"]) for row in result["results"]}
    assert {("bf16", "torch F.linear"), ("int8", "triton_decode"), ("int4", "triton_decode"),
            ("fp8", "triton_decode"), ("int8", "triton"), ("int4", "triton")} <= impls
    for row in result["results"] + result["variants"]:
        assert "error" not in row, row
        if row.get("format") != "bf16":
            assert row["max_rel_diff"] < 1e-3, row  # float32 through the interpreter: the reference's result
    assert set(result["best"]) == {"int8", "int4", "fp8"} and set(result["summary"]) == {"int8", "int4", "fp8"}


def test_wire_cost_smoke(tmp_path: Path) -> None:
    """The wire-format benchmark round-trips a generation step's plan and result at a small batch."""
    out = tmp_path / "wire.json"
    cmd = [sys.executable, str(REPO / "bench" / "wire_cost.py"), "--batch-sizes", "8", "--reps", "2", "--output", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"stderr:\n{proc.stderr[-4000:]}"
    row = json.loads(out.read_text())["batches"]["8"]
    assert set(row["ms"]) == {"scheduler_plan_to_bytes", "executor_bytes_to_plan", "executor_result_to_bytes",
                              "scheduler_bytes_to_result"}
    assert row["bytes"]["plan"] > 0 and row["bytes"]["result"] > 0


def test_detokenize_cost_smoke(tmp_path: Path, model_dir: Path) -> None:
    """The detokenization benchmark times every way for each batch and run length."""
    out = tmp_path / "detok.json"
    cmd = [sys.executable, str(REPO / "bench" / "detokenize_cost.py"), "--batch-sizes", "2", "--tokens", "1,3",
           "--steps", "2", "--output", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, f"stderr:\n{proc.stderr[-4000:]}"
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["tokens_per_request"]) for r in rows] == [(2, 1), (2, 3)]
    for row in rows:
        assert set(row["ms_per_step"]) == {"transformers_per_token", "rust_per_token", "batch"}
        assert all(ms > 0 for ms in row["ms_per_step"].values())


@pytest.mark.timeout(120)
def test_bench_dense_gemv_smoke(tmp_path: Path) -> None:
    """bench/dense_gemv.py on tiny shapes through Triton's interpreter: cuBLAS and the GEMV agree, all reported."""
    result = interpreted_smoke("dense_gemv.py", tmp_path, timeout=110)
    assert set(result["best"]) == {"qkv rows 1", "qkv rows 2", "down rows 1", "down rows 2"}
    for entry in result["best"].values():
        assert entry["cublas_us"] > 0 and entry["gemv_best_us"] > 0 and entry["gemv_default_us"] > 0
    for row in result["results"]:
        assert row["max_rel_diff"] < 1e-5, row


@pytest.mark.timeout(120)
def test_int4_dequant_layouts_smoke_every_layout_matches_the_served_pass(tmp_path: Path) -> None:
    """bench/int4_dequant_layouts.py through Triton's interpreter: each layout's bits equal the served pass's."""
    rows = interpreted_smoke("int4_dequant_layouts.py", tmp_path, timeout=110)["results"]
    layouts = {"bytes", "words", "words_k_first", "planes", "join"}
    assert {row["variant"] for row in rows} == layouts | {"int8", "copy_bf16"}
    assert all(row.get("exact") is True for row in rows), [row for row in rows if row.get("exact") is not True]


@pytest.mark.timeout(120)
def test_decode_attention_splits_smoke_every_tiling_matches_the_reference(tmp_path: Path) -> None:
    """bench/decode_attention_splits.py through Triton's interpreter: every tiling of every case is reported
    and agrees with the torch reference."""
    result = interpreted_smoke("decode_attention_splits.py", tmp_path, timeout=110)
    cases = {row["case"] for row in result["results"]}
    assert cases == {"b1 ctx40 table96", "b2 ctx40 table96"}
    assert {row["variant"] for row in result["results"]} >= {"default", "min_split32_n32", "w2"}
    assert all(row["max_abs_diff"] < 1e-4 for row in result["results"])  # float32 on the CPU


def test_step_kernels_names_each_kernels_category() -> None:
    """Kernel names seen in an H200 profile of a Llama-3.1-8B step fall in the categories they belong to."""
    sys.path.insert(0, str(REPO / "bench"))
    from step_kernels import category

    assert category("_decode_split_kernel") == category("_context_kernel") == "attention"
    assert category("nvjet_sm90_qqtst_128x128_128x6_1x1_h_bz_coopA_algo2_ovscale_TNT") == "gemm"
    assert category("void cublasLt::splitKreduce_kernel<32, 16, int, float>") == "gemm"
    assert category("_weight_dot_kernel") == "gemm"
    assert category("_fp8_per_token_kernel") == "activation_quant"
    assert category("_rms_norm_kernel") == "norm" and category("_rope_write_kv_kernel") == "rotary"
    assert category("_act_and_mul_kernel") == "activation"
    assert category("void at::native::reduce_kernel<512, 1, ArgMaxOps<float>>") == "sampling"
    assert category("Memset (Unknown)") == "other"


def test_fp8_range_helpers_round_as_e4m3_without_its_range() -> None:
    """quant_error_sources' unbounded-exponent rounding keeps 3 mantissa bits at any magnitude (E4M3's own
    rounding where E4M3 is normal), and the subnormal share counts what a per-token scale puts below 2^-6."""
    sys.path.insert(0, str(REPO / "bench"))
    import torch
    from quant_error_sources import fp8_mantissa_only, fp8_subnormal_share

    x = torch.tensor([1.06, 1.07, -1000.0, 3e-9, 0.0, 300.0])
    assert fp8_mantissa_only(x).tolist() == pytest.approx([1.0, 1.125, -1024.0, 2.0 ** -29 * 1.625, 0.0, 288.0])
    normal = torch.linspace(-448, 448, 1001)
    normal = normal[normal.abs() >= 2.0 ** -6]
    assert torch.equal(fp8_mantissa_only(normal), normal.to(torch.float8_e4m3fn).float())
    # One token: max 448 after scaling; 1e-3 * 448 / 448 = 1e-3 < 2^-6 is below normal, 1.0 is not; zeros not counted.
    assert fp8_subnormal_share(torch.tensor([[448.0, 1.0, 1e-3, 0.0]])) == pytest.approx(1 / 3)


@pytest.mark.timeout(170)
def test_step_kernels_smoke(tmp_path: Path) -> None:
    """bench/step_kernels.py on the CPU (steps run, no device kernels to see): the report has both step kinds."""
    out = tmp_path / "steps.json"
    cmd = [sys.executable, str(REPO / "bench" / "step_kernels.py"), "--shape", "tiny-host", "--device", "cpu",
           "--batch-size", "8", "--context", "32", "--prefill-requests", "50", "--max-num-tokens", "128",
           "--steps", "2", "--output", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=160)
    assert proc.returncode == 0, f"stderr:\n{proc.stderr[-4000:]}"
    steps = json.loads(out.read_text())["steps"]
    assert steps["decode"]["rows"] == 8
    assert steps["context"]["rows"] == 128  # 50 prompts capped to what --max-num-tokens holds: 4 x 32
    assert steps["decode"]["step_ms"] > 0 and steps["context"]["step_ms"] > 0


def test_the_bandwidth_limit_counts_the_weight_bytes_an_engine_stores(tmp_path: Path) -> None:
    """offline_throughput's batch-1 limit reads each weight at its stored width: an FP8 engine's
    projections at 1 byte plus their scales, its 16-bit LM head and norms as they are, and a table
    tied to the LM head once."""
    sys.path.insert(0, str(REPO / "bench"))
    from model_shapes import SHAPES, engine_weight_bytes, shape_folder

    from executor_svc.build_config import BuildConfig, QuantConfig
    from executor_svc.builder import build_engine
    from executor_svc.engine import RuntimeConfig, load_engine

    c = SHAPES["tiny-host"]
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    projections = h * (q + 2 * kv) + q * h + 3 * h * i  # qkv, o, gate and up, down
    rest = 2 * h + h + h * c["vocab_size"]  # two norms, the final norm, the (tied) LM head
    folder = shape_folder("tiny-host", tmp_path)
    measured = {}
    for algo in ("none", "FP8"):
        build = BuildConfig(max_batch_size=2, max_num_tokens=64, max_seq_len=128, tokens_per_block=16,
                            quant_config=QuantConfig(quant_algo=algo))
        build_engine(folder, tmp_path / algo, build, device="cpu", progress=False, load_format="dummy")
        engine = load_engine(tmp_path / algo, RuntimeConfig(device="cpu", kv_cache_bytes=1 << 20))
        measured[algo] = engine_weight_bytes(engine.model)
    assert measured["none"] == (projections + rest) * 4  # float32 on the CPU
    assert measured["FP8"] == projections + 4 * 4 + rest * 4  # four projections with one float32 scale each


@pytest.mark.timeout(170)
def test_fused_kernels_smoke_times_the_fp8_rows_variants_against_two_kernels(tmp_path: Path) -> None:
    """bench/fused_kernels.py through Triton's interpreter: every kernel has a row, and the FP8-rows
    variants store the rows that the plain kernel and the projection's quantizer make."""
    out = tmp_path / "fused.json"
    cmd = [sys.executable, str(REPO / "bench" / "fused_kernels.py"), "--device", "cpu", "--small", "--dtype", "float16",
           "--tokens", "3", "--warmup", "0", "--repeats", "1", "--output", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=160)
    assert proc.returncode == 0, f"stderr:\n{proc.stderr[-4000:]}"
    rows = {row["kernel"]: row for row in json.loads(out.read_text())["results"]}
    assert set(rows) == {"rope_write_kv", "swiglu", "rmsnorm_residual", "swiglu_fp8_rows", "rmsnorm_fp8_rows"}
    for name in ("swiglu_fp8_rows", "rmsnorm_fp8_rows"):
        assert rows[name]["reference"] == "triton + quantize" and rows[name]["max_abs_diff"] == 0.0


@pytest.mark.timeout(200)
def test_serving_rates_smoke(tmp_path: Path) -> None:
    """bench/serving_rates.py over gRPC on the one-layer shape: Poisson arrivals at two rates, a JSON row and a plot each."""
    out = tmp_path / "rates.json"
    cmd = [sys.executable, str(REPO / "bench" / "serving_rates.py"), "--shape", "tiny-host", "--device", "cpu",
           "--rates", "20,80", "--num-requests", "6", "--input-len", "16", "--output-len", "4", "--kv-cache-gb", "0.05",
           "--server-log", str(tmp_path / "server.log"), "--output", str(out), "--plot"]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                          timeout=190)
    assert proc.returncode == 0, f"stderr:\n{proc.stderr[-4000:]}"
    result = json.loads(out.read_text())
    assert [row["request_rate"] for row in result["rates"]] == [20.0, 80.0]
    for row in result["rates"]:
        assert row["total_output_tokens"] == 6 * 4
        for metric in ("ttft_ms", "tpot_ms", "itl_ms"):
            assert row[metric]["p50"] is not None and row[metric]["p99"] is not None
    assert out.with_suffix(".png").stat().st_size > 0


@pytest.mark.timeout(200)
def test_offline_throughput_smoke_runs_grpc_and_in_process(tmp_path: Path) -> None:
    """bench/offline_throughput.py on the one-layer shape through both paths; every request's tokens arrive."""
    out = tmp_path / "offline.json"
    cmd = [sys.executable, str(REPO / "bench" / "offline_throughput.py"), "--shape", "tiny-host", "--device", "cpu",
           "--scenarios", "16x8", "--grpc-scenarios", "16x8", "--paths", "inprocess,grpc", "--no-overlap-scenarios=",
           "--peer-batches", "--num-requests", "12", "--max-batch-size", "8", "--batch1", "16", "4",
           "--server-log", str(tmp_path / "server.log"), "--output", str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "INFLIGHT_SOURCE_COMMIT": "0123abc"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=190)
    assert proc.returncode == 0, f"stderr:\n{proc.stderr[-4000:]}"
    result = json.loads(out.read_text())
    assert result["git"]["commit"] == "0123abc"  # a copied tree names its commit
    for path in ("inprocess", "grpc"):
        scenario = result[path]["16x8"]
        assert scenario["num_requests"] == 12 and scenario["output_tokens_per_s"] > 0, path


@pytest.mark.timeout(200)
def test_draft_head_variants_smoke_trains_each_variant_on_one_data_set(tmp_path: Path) -> None:
    """bench/draft_head_variants.py on SmolLM2 (the chat template and a vocabulary that holds the tokenizer's ids),
    a few short answers: one data set, two variants, both evaluation sets."""
    out = tmp_path / "variants.json"
    cmd = [sys.executable, str(REPO / "bench" / "draft_head_variants.py"), "--device", "cpu", "--num-texts", "4",
           "--num-eval-texts", "2", "--max-tokens", "48", "--epochs", "1", "--num-heads", "2",
           "--variants", "default;narrow:intermediate_size=64,lr=0.002", "--output", str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=190)
    assert proc.returncode == 0, f"stderr:\n{proc.stderr[-4000:]}"
    result = json.loads(out.read_text())
    assert result["bench_chat_prompts"] == 24 and result["training_positions"] > 0  # speculative.py's chat set
    assert result["variants"]["narrow"]["overrides"] == {"intermediate_size": 64, "lr": 0.002}
    for variant in result["variants"].values():
        for judged in (variant["held_out"], variant["bench_chat"]):
            assert len(judged["agreement"]) == 2 and 0 <= judged["walk_accepted"] <= 2


@pytest.mark.timeout(200)
def test_speculative_generate_smoke_compares_mode_settings_in_one_run(tmp_path: Path) -> None:
    out = tmp_path / "spec.json"
    cmd = [
        sys.executable, str(REPO / "bench" / "speculative.py"), "generate", "--shape", "tiny-host", "--device", "cpu",
        "--num-prompts", "1", "--max-tokens", "6", "--batch-sizes", "1,2", "--batch-max-tokens", "6",
        "--modes", "none,ngram,ngram:k6:min1:stop0", "--trace-policy", "--arrival-probes", "2", "--cycles", "2",
        "--output", str(out),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=190)
    assert proc.returncode == 0, f"stderr:\n{proc.stderr[-4000:]}"
    result = json.loads(out.read_text())
    assert list(result["modes"]) == ["none", "ngram", "ngram:k6:min1:stop0"]  # the first cycle's order
    assert "reverse" in result["mode_order"]
    assert result["engine"]["max_batch_size"] >= 7  # one request's rows at the largest draft length of any mode
    for name, mode in result["modes"].items():
        assert mode["batch1"]["output_tokens"] > 0 and "speedup" in mode["batch1"]
        assert len(mode["batch1"]["cycles"]["speedup"]) == len(mode["batch2"]["cycles"]["speedup"]) == 2
        assert len(mode["batch1"]["by_prompt"]["speedup"]) == 1  # one prompt: its own rate against plain decoding's
        assert len(mode["arrivals"]["ttft_ms"]) == 2 and mode["arrivals"]["max_ttft_ms"] > 0
        if name != "none":  # the policy's trace, at batch 1 and in the batch-2 run: the step costs it learned from
            for run in (mode["batch1"], mode["batch2"]):
                assert any("tokens" in event for event in run["policy_trace"])

    bad = subprocess.run([*cmd[:-9], "--modes", "ngram:q3", "--output", str(tmp_path / "bad.json")], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=190)
    assert bad.returncode != 0 and "unknown setting 'q3'" in bad.stderr


def test_speculative_generate_serves_several_trained_head_sets_in_one_run(tmp_path: Path, model_dir: Path) -> None:
    """--more-train-draft-args trains heads into folders of their own beside the engine's, and a mode's headsN
    serves set N, all against the same plain decoding (a two-layer random-weight engine, the real tokenizer);
    vocab0 serves a set trained with a draft vocabulary from every token."""
    from executor_svc.build_config import BuildConfig
    from executor_svc.builder import build_engine
    from tests.conftest import tiny_llama_config

    folder = tmp_path / "tiny"
    folder.mkdir()
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    (folder / "config.json").write_text(json.dumps(tiny_llama_config(vocab, 512)))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((model_dir / name).read_bytes())
    build = BuildConfig(max_batch_size=8, max_num_tokens=512, max_seq_len=256, tokens_per_block=16, dtype="float32")
    build_engine(folder, folder / "engine", build, device="cpu", load_format="dummy", progress=False)
    train = "--num-heads 2 --max-tokens-per-text 48 --epochs 1 --num-eval-texts 1"
    out = tmp_path / "heads.json"
    cmd = [
        sys.executable, str(REPO / "bench" / "speculative.py"), "generate", "--engine-dir", str(folder / "engine"),
        "--device", "cpu", "--prompts", "chat", "--num-prompts", "1", "--max-tokens", "6", "--batch-sizes", "1",
        "--modes", "none,draft_heads,draft_heads:vocab0,draft_heads:heads1", "--train-heads",
        "--train-draft-args", f"{train} --num-texts 2 --draft-vocab 64",
        "--more-train-draft-args", f"{train} --num-texts 3", "--output", str(out),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"stderr:\n{proc.stderr[-4000:]}"
    result = json.loads(out.read_text())
    assert list(result["modes"]) == ["none", "draft_heads", "draft_heads:vocab0", "draft_heads:heads1"]
    assert result["draft_heads"]["training"]["num_texts"] == 2 and result["draft_heads1"]["training"]["num_texts"] == 3
    assert result["draft_heads"]["training"]["draft_vocab_size"] == 64
    for mode in result["modes"].values():
        assert mode["batch1"]["output_tokens"] > 0 and mode["batch1"]["same_tokens_as_none"]

    bad = subprocess.run([*cmd[:-2], "--modes", "none,draft_heads:heads2", "--output", str(tmp_path / "bad.json")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "no draft heads set 2" in bad.stderr

    # --more-heads serves heads trained before, from their folder (here the engine's own, trained above), as the
    # set after the trained ones; without --train-heads that is set 1.
    given = tmp_path / "given.json"
    # refresh0: the policy never runs a longer draft length again to re-measure it.
    reuse = [*cmd[:cmd.index("--modes")], "--modes", "none,draft_heads:heads1,draft_heads:heads1:refresh0",
             "--more-heads", str(folder / "engine"), "--output", str(given)]
    proc = subprocess.run(reuse, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"stderr:\n{proc.stderr[-4000:]}"
    result = json.loads(given.read_text())
    assert result["draft_heads1"]["training"]["num_texts"] == 2 and result["draft_heads1"]["train_seconds"] is None
    assert result["modes"]["draft_heads:heads1"]["batch1"]["same_tokens_as_none"]
    assert result["modes"]["draft_heads:heads1:refresh0"]["batch1"]["draft_length_refreshes"] == 0
    missing = subprocess.run([*reuse[:-4], "--more-heads", str(tmp_path), "--output", str(tmp_path / "bad.json")],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert missing.returncode != 0 and "no draft_heads.json there" in missing.stderr


@pytest.mark.timeout(300)
def test_sm90_kernel_census_compiles_every_case_and_one_dot_issues_one_wgmma_group(tmp_path: Path) -> None:
    """bench/sm90_kernel_census.py compiles for Hopper with Triton's own ptxas (no GPU): every case compiles,
    and at 64 rows the INT4 tile's one dot a step is one warpgroup MMA op where the plane dots are eight."""
    from importlib.util import find_spec

    if find_spec("triton.backends.nvidia") is None:
        pytest.skip("Triton's NVIDIA backend is not installed")
    out = tmp_path / "census.json"
    cmd = [sys.executable, str(REPO / "bench" / "sm90_kernel_census.py"), "--output", str(out)]
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    if proc.returncode != 0 and "ptxas" in proc.stderr:
        pytest.skip(f"no ptxas to compile with: {proc.stderr[-500:]}")
    assert proc.returncode == 0, f"stderr:\n{proc.stderr[-4000:]}"
    kernels = {row["kernel"]: row for row in json.loads(out.read_text())["kernels"]}
    planes, one = kernels["int4 tl.dot 64 rows: eight plane dots"], kernels["int4 tl.dot 64 rows: one dot"]
    assert planes["ttgir"]["warp_group_dot "] == 8 and one["ttgir"]["warp_group_dot "] == 1
    assert one["hgmma"] == planes["hgmma"] == 8 and one["spills"] == 0
    assert kernels["int4 dequant: words"]["sass_instructions_per_weight"] > 0
