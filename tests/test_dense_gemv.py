"""The 16-bit decode GEMV (plugins/gemm_decode.py) against torch, and its per-shape tactics.

Under Triton's CPU interpreter in float32 and float16 on small odd shapes (N
and K off the tiles, K split or not); on a GPU (INFLIGHT_TEST_DEVICE=cuda)
also bfloat16 on Llama-3.1-8B's shapes and inside a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from executor_svc.engine_file import PluginChoice
from executor_svc.kernel_selection import GEMV, apply_tactics, benchmark_inputs, linear_shapes
from plugins.quant_gemm_decode_config import DecodeConfig
from tests.conftest import TEST_DEVICE

gemv = pytest.importorskip("plugins.gemm_decode")
from plugins import gemv_tactics  # noqa: E402

DEVICE = torch.device(TEST_DEVICE)
ON_GPU = TEST_DEVICE == "cuda"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.fixture
def fresh_tactics(monkeypatch):
    """An empty tactic table for the test, the process's own one back after it."""
    monkeypatch.setattr(gemv_tactics, "_tables", {})


def _operands(rows: int, n: int, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(n * 31 + k)
    x = torch.randn(rows, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(DEVICE, dtype)
    return x, w


def _check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    expected = F.linear(x.float(), w.float())
    assert out.shape == expected.shape and out.dtype == x.dtype
    scale = expected.abs().max().item()
    torch.testing.assert_close(out.float(), expected, atol=TOL[x.dtype] * scale, rtol=TOL[x.dtype])


# (rows, N, K, config): N and K off the tiles, split-K with an uneven last split, unsplit.
CASES = [
    (1, 40, 200, gemv.TACTICS["n16 k128 w8"]),  # K = 200: masked last step
    (1, 96, 512, gemv.TACTICS["n32 k128 w4"]),  # split-K from the SM count
    (2, 72, 384, gemv.TACTICS["n32 k128 w4"]),
    (1, 33, 640, DecodeConfig(fma=True, block_n=16, block_k=128, split_k=3, num_stages=1)),  # 5 steps, 3 splits
    (2, 64, 256, DecodeConfig(fma=True, block_n=32, block_k=64, split_k=1, num_stages=2)),  # unsplit, prefetch
    # products summed per thread in runs of 8 channels: masked last step, two rows, prefetch
    (1, 40, 200, gemv.TACTICS["n32 k256 w4 t8"]),
    (2, 72, 384, DecodeConfig(fma=True, block_n=16, block_k=128, split_k=2, num_stages=2, thread_k=8)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,n,k,config", CASES)
def test_gemv_matches_torch(rows, n, k, config, dtype):
    x, w = _operands(rows, n, k, dtype)
    _check(gemv.dense_gemv(x, w, config), x, w)


# (rows, N, K, tile): the tl.dot path of 3 to 16 rows, N and K off its tiles, split or not.
DOT_CASES = [
    (3, 40, 200, gemv.DOT_TACTICS["dot n32 k128"]),
    (5, 96, 512, gemv.DOT_TACTICS["dot n64 k128"]),
    (16, 72, 384, gemv.DOT_TACTICS["dot n16 k128"]),
    (8, 33, 640, gemv.DOT_TACTICS["dot n32 k64 w2"]),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,n,k,config", DOT_CASES)
def test_dot_matches_torch(rows, n, k, config, dtype):
    x, w = _operands(rows, n, k, dtype)
    _check(gemv.dense_dot(x, w, config), x, w)


def test_row_classes():
    assert [gemv.row_class(m) for m in (0, 1, 2, 3, 8, 16, 17)] == [None, 1, 2, 16, 16, 16, None]


def test_gemv_refuses_what_it_cannot_compute():
    x, w = _operands(3, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="at most 2 rows"):
        gemv.dense_gemv(x, w)
    with pytest.raises(ValueError, match="x \\[M, K\\] and weight \\[N, K\\]"):
        gemv.dense_gemv(x[:1], w[:, :8])
    with pytest.raises(ValueError, match="unit stride"):
        gemv.dense_gemv(x[:1, :8], w.t())
    x17, _ = _operands(17, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="at most 16 rows"):
        gemv.dense_dot(x17, w)


def test_tactics_route_each_shape(fresh_tactics):
    """A shape set to cuBLAS runs F.linear, a named tactic runs the GEMV with its tiles; two rows run the GEMV
    only with a two-row entry, more rows always run F.linear."""
    x, w = _operands(1, 48, 256, torch.float32)
    calls = []
    original = gemv.dense_gemv
    try:
        gemv.dense_gemv = lambda x, w, config=None: calls.append(config) or original(x, w, config)
        gemv.set_tactics({gemv_tactics.shape_key(48, 256): "n16 k128 w8"})
        _check(gemv.linear_gemv(x, w), x, w)
        assert calls == [gemv.TACTICS["n16 k128 w8"]]
        wt = w.t().contiguous().t()  # the same values, not contiguous along K: F.linear takes it
        _check(gemv.linear_gemv(x, wt), x, wt)
        gemv.set_tactics({gemv_tactics.shape_key(48, 256): gemv.CUBLAS})
        _check(gemv.linear_gemv(x, w), x, w)
        x2 = torch.cat([x, -x])
        _check(gemv.linear_gemv(x2, w), x2, w)
        assert len(calls) == 1  # two rows, timed at one row only: cuBLAS
        gemv.set_tactics({gemv_tactics.shape_key(48, 256, 2): "n32 k128 w4"})
        assert gemv_tactics.lookup("dense", 48, 256, 2) == "n32 k128 w4"
        assert gemv_tactics.lookup("dense", 48, 256) == gemv.CUBLAS
        _check(gemv.linear_gemv(x2, w), x2, w)
        assert calls[1:] == [gemv.TACTICS["n32 k128 w4"]]
        x3 = torch.cat([x2, x])
        _check(gemv.linear_gemv(x3, w), x3, w)
        assert len(calls) == 2  # three rows, no 16-row entry: cuBLAS
    finally:
        gemv.dense_gemv = original


def test_tactics_route_three_to_sixteen_rows_to_the_dot_tile(fresh_tactics, monkeypatch):
    x, w = _operands(17, 48, 256, torch.float32)
    calls = []
    original = gemv.dense_dot
    monkeypatch.setattr(gemv, "dense_dot", lambda x, w, config=None: calls.append(config) or original(x, w, config))
    gemv.set_tactics({gemv_tactics.shape_key(48, 256, gemv.DOT_ROWS): "dot n32 k128"})
    for rows in (3, 5, 16, 17):
        _check(gemv.linear_gemv(x[:rows], w), x[:rows], w)
    assert calls == [gemv.DOT_TACTICS["dot n32 k128"]] * 3  # 17 rows: past one tile, cuBLAS
    # A name of the wrong class (a table written by hand) runs cuBLAS rather than a kernel that cannot take it.
    gemv.set_tactics({gemv_tactics.shape_key(48, 256, gemv.DOT_ROWS): "n32 k128 w4",
                      gemv_tactics.shape_key(48, 256, 2): "dot n32 k128"})
    _check(gemv.linear_gemv(x[:5], w), x[:5], w)
    _check(gemv.linear_gemv(x[:2], w), x[:2], w)
    assert len(calls) == 3
    with pytest.raises(ValueError, match="unknown dense GEMV tactic"):
        gemv.set_tactics({"8x8": "fastest"})


def test_engine_tactics_are_installed_at_load(fresh_tactics, caplog):
    choice = PluginChoice(name=GEMV, requested="auto", tactics={"24x16": "n32 k128 w4", "24x16@2": gemv.CUBLAS})
    apply_tactics({"gemm": choice})
    assert gemv_tactics.lookup("dense", 24, 16) == "n32 k128 w4"
    assert gemv_tactics.lookup("dense", 24, 16, 2) == gemv.CUBLAS
    # An engine from another version of the kernels, naming a tile this one lacks, still loads.
    apply_tactics({"gemm": PluginChoice(name=GEMV, requested="auto", tactics={"48x16": "n7 k7 w7"})})
    assert gemv_tactics.lookup("dense", 48, 16) is None
    assert "rebuild the engine" in caplog.text


def test_gemm_selection_times_a_decode_layer_and_a_context_chunk():
    from executor_svc.build_config import BuildConfig
    from executor_svc.model.config import ModelConfig

    model = ModelConfig(
        name="tiny", architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=48,
        num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=1e4,
        rope_scaling=None, max_position_embeddings=128, tie_word_embeddings=False,
    )
    assert linear_shapes(model) == [(64, 32), (32, 32), (96, 32), (32, 48), (64, 32)]
    calls = benchmark_inputs("gemm", model, BuildConfig(max_num_tokens=64), torch.device("cpu"), torch.float32)()
    assert [tuple(w.shape) for _, w in calls] == [(64, 32), (32, 32), (96, 32), (32, 48), (64, 32)]
    assert [x.shape[0] for x, _ in calls] == [1, 1, 1, 1, 64]


@pytest.mark.skipif(not ON_GPU, reason="Llama-3.1-8B shapes in bfloat16 and CUDA graphs need a GPU")
@pytest.mark.parametrize("name", list(gemv.TACTICS))
def test_llama_shapes_in_a_cuda_graph(name):
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]:
        x, w = _operands(1, n, k, torch.bfloat16)
        gemv.dense_gemv(x, w, gemv.TACTICS[name])  # outside capture first: the split-K counters exist
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = gemv.dense_gemv(x, w, gemv.TACTICS[name])
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, x, w)


@pytest.mark.skipif(not ON_GPU, reason="tactics are timed from CUDA graphs")
def test_tactics_are_timed_per_row_class(fresh_tactics):
    report = gemv.tune_tactics([(1024, 4096), (576, 576)], DEVICE, torch.bfloat16)
    assert set(report) == {f"{shape}{rows}" for shape in ("1024x4096", "576x576") for rows in ("", "@2", "@16")}
    for key, entry in report.items():
        rows = int(key.split("@")[1]) if "@" in key else 1
        assert set(entry["timings_us"]) == {gemv.CUBLAS, *(gemv.DOT_TACTICS if rows == 16 else gemv.TACTICS)}
        # The report rounds to 0.01 us; the pick is made before rounding, so two tiles may tie in the report.
        assert entry["timings_us"][entry["tactic"]] == min(entry["timings_us"].values())
        n, k = (int(v) for v in key.split("@")[0].split("x"))
        assert gemv_tactics.lookup("dense", n, k, rows) == entry["tactic"]
        x, w = _operands(rows, n, k, torch.bfloat16)
        _check(gemv.linear_gemv(x, w), x, w)


def test_tuning_keeps_each_tactics_fastest_round(fresh_tactics, monkeypatch):
    """Tiles are timed in turn, round after round, and each keeps its fastest: one slow timing does not decide."""
    import plugins.gemv_tactics as tactics
    from plugins.timing import TIMING_ROUNDS

    rounds = {"steady": iter([2.0, 2.1, 2.2]), "usually_fast": iter([9.0, 1.0, 1.1])}
    order = []

    def fake_time(calls, device):
        name = calls[0]()
        order.append(name)
        return next(rounds[name])

    monkeypatch.setattr(tactics, "graph_time_us", fake_time)
    candidates = {"steady": lambda x, w: "steady", "usually_fast": lambda x, w: "usually_fast"}
    # As many bytes a weight as the tuning reads: one copy, not the 2^19 copies of an 8x16 weight it would make.
    report = tactics.tune("dense", [(8, 16)], torch.device("cpu"), tactics.TUNE_BYTES,
                          lambda n, k, gen: (torch.ones(n, k),), lambda k, gen: torch.ones(1, k), candidates)
    assert report["8x16"] == {"tactic": "usually_fast", "timings_us": {"steady": 2.0, "usually_fast": 1.0}}
    assert order == ["steady", "usually_fast"] * TIMING_ROUNDS


def test_a_tactic_that_fails_is_skipped_at_tuning(fresh_tactics, monkeypatch):
    """A tile the GPU cannot compile costs that tile, not the build: the others are timed and one is chosen."""
    import plugins.gemv_tactics as tactics

    def fake_time(calls, device):
        calls[0]()
        return 1.0

    monkeypatch.setattr(tactics, "graph_time_us", fake_time)

    def broken(x, w):
        raise RuntimeError("out of resources: shared memory")

    x_of = lambda k, gen: torch.ones(1, k)  # noqa: E731
    one_copy = tactics.TUNE_BYTES  # bytes a weight: the tuning makes one copy of it (a fake timing reads one)
    report = tactics.tune("dense", [(8, 16)], torch.device("cpu"), one_copy, lambda n, k, gen: (torch.ones(n, k),),
                          x_of, {"broken": broken, gemv.CUBLAS: lambda x, w: F.linear(x, w)}, rows=(1, 2))
    for key in ("8x16", "8x16@2"):
        assert report[key]["tactic"] == gemv.CUBLAS and "shared memory" in report[key]["failed"]["broken"]
    with pytest.raises(RuntimeError, match="no dense GEMV candidate ran"):
        tactics.tune("dense", [(8, 16)], torch.device("cpu"), one_copy, lambda n, k, gen: (torch.ones(n, k),), x_of,
                     {"broken": broken})
