"""Convert a GGUF checkpoint into a Hugging Face-style model folder.

The executor only knows how to load HF folders (config.json + *.safetensors +
tokenizer files), while the default model ships as a quantized GGUF.  This
module bridges the two with our own reader on top of the ``gguf`` package:
weights are dequantized to float32 and renamed to HF names, config.json is
derived from the GGUF metadata.  transformers is used for the tokenizer only.

Supporting another architecture means adding one ``ArchSpec`` (a tensor-name
table, a config builder, expected shapes and optional per-tensor fixes) to
``ARCHITECTURES``; the conversion driver itself is architecture-agnostic.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import save_file
from tqdm import tqdm

logger = logging.getLogger("inflight.gguf_convert")

# Bump when the output of the converter changes: model_store folds it into the
# cache key so stale conversions are redone instead of silently reused.
CONVERTER_VERSION = 1

SOURCE_FILE = "inflight_gguf_source.json"  # provenance note written next to the weights

_MISSING = object()


class _Meta:
    """Typed access to GGUF key/value metadata with clear errors for missing keys."""

    def __init__(self, reader: GGUFReader) -> None:
        self._fields = reader.fields

    def get(self, key: str, default: Any = _MISSING) -> Any:
        if key not in self._fields:
            if default is _MISSING:
                raise ValueError(f"GGUF metadata is missing required key {key!r}")
            return default
        value = self._fields[key].contents()
        # numpy scalars -> plain Python, so json.dump and comparisons behave.
        return value.item() if isinstance(value, np.generic) else value


@dataclass(frozen=True)
class ArchSpec:
    """Everything architecture-specific the converter needs."""

    # GGUF tensor name -> HF name; "{i}" stands for the block index.
    tensor_names: Mapping[str, str]
    # (metadata, set of GGUF tensor names) -> config.json dict
    build_config: Callable[[_Meta, set[str]], dict[str, Any]]
    # config -> {HF name: shape}; also the list of tensors that must be present.
    expected_shapes: Callable[[dict[str, Any]], dict[str, tuple[int, ...]]]
    # (HF name, float32 array, config) -> array; layout fixes such as un-permuting.
    fix_tensor: Callable[[str, np.ndarray, dict[str, Any]], np.ndarray] = lambda n, w, c: w


# --------------------------------------------------------------------- llama

# GGUF -> Hugging Face names every decoder-only architecture here shares.
_DECODER_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}

_LLAMA_TENSORS = _DECODER_TENSORS | {
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
}


def _special_token_ids(meta: _Meta) -> dict[str, int]:
    names = {"bos": "bos", "eos": "eos", "pad": "padding", "unk": "unknown"}
    ids = {f"{hf}_token_id": meta.get(f"tokenizer.ggml.{g}_token_id", None) for hf, g in names.items()}
    return {k: int(v) for k, v in ids.items() if v is not None}


def _llama_config(meta: _Meta, tensor_names: set[str]) -> dict[str, Any]:
    a = "llama"
    scaling = meta.get(f"{a}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        # Silently ignoring RoPE scaling would give a model that loads but drifts.
        raise ValueError(f"GGUF uses RoPE scaling {scaling!r}, which the converter does not support yet")
    hidden = int(meta.get(f"{a}.embedding_length"))
    heads = int(meta.get(f"{a}.attention.head_count"))
    head_dim = meta.get(f"{a}.attention.key_length", None) or meta.get(f"{a}.rope.dimension_count", None)
    vocab = meta.get(f"{a}.vocab_size", None) or len(meta.get("tokenizer.ggml.tokens"))
    theta = float(meta.get(f"{a}.rope.freq_base", 10000.0))
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": int(meta.get(f"{a}.feed_forward_length")),
        "num_hidden_layers": int(meta.get(f"{a}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{a}.attention.head_count_kv", heads)),
        "head_dim": int(head_dim or hidden // heads), "hidden_act": "silu",
        "rms_norm_eps": float(meta.get(f"{a}.attention.layer_norm_rms_epsilon")),
        # transformers 5 reads rope_parameters; the flat key is for other readers.
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "max_position_embeddings": int(meta.get(f"{a}.context_length")),
        "vocab_size": int(vocab),
        # llama.cpp drops output.weight when the head is tied to the embedding.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": False, "mlp_bias": False,
        **_special_token_ids(meta), "torch_dtype": "float32",
    }


def _decoder_shapes(cfg: dict[str, Any], extra_layer_norms: dict[str, int] | None = None) -> dict[str, tuple[int, ...]]:
    """HF tensor shapes of a decoder-only checkpoint; ``extra_layer_norms`` maps more
    per-layer norm names to their size."""
    h, hd, ff = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (ff, h), p + "mlp.up_proj.weight": (ff, h),
            p + "mlp.down_proj.weight": (h, ff),
        })
        shapes.update({p + name: (size,) for name, size in (extra_layer_norms or {}).items()})
    return shapes


def _llama_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    return _decoder_shapes(cfg)


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (same as transformers' reverse_permute_weights).

    HF Llama applies RoPE with the "rotate half" layout (dims i and i+d/2 form a
    pair); GGML pairs adjacent dims.  llama.cpp's converter therefore reorders each
    head's rows as ``reshape(n_head, 2, d/2, ...).swapaxes(1, 2)``; this is the inverse.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama_fix(hf_name: str, w: np.ndarray, cfg: dict[str, Any]) -> np.ndarray:
    if hf_name.endswith("self_attn.q_proj.weight"):
        return unpermute_rope_rows(w, cfg["num_attention_heads"])
    if hf_name.endswith("self_attn.k_proj.weight"):
        # K was permuted with the KV head count (GQA), not the query head count.
        return unpermute_rope_rows(w, cfg["num_key_value_heads"])
    return w


# -------------------------------------------------------------------- gemma3

_GEMMA3_TENSORS = _DECODER_TENSORS | {
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    # llama.cpp's ffn_norm is Gemma's norm before the MLP, not Llama's post-attention norm.
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
}


def _gemma3_layer_types(meta: _Meta, layers: int) -> list[str]:
    # llama.cpp's default for Gemma-3: every 6th layer is global (HF's sliding_window_pattern).
    pattern = meta.get("gemma3.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # newer files: one flag per layer, True = sliding window
        return ["sliding_attention" if p else "full_attention" for p in pattern]
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]


def _gemma3_config(meta: _Meta, tensor_names: set[str]) -> dict[str, Any]:
    a = "gemma3"
    hidden = int(meta.get(f"{a}.embedding_length"))
    heads = int(meta.get(f"{a}.attention.head_count"))
    layers = int(meta.get(f"{a}.block_count"))
    head_dim = int(meta.get(f"{a}.attention.key_length"))
    if int(meta.get(f"{a}.attention.value_length", head_dim)) != head_dim:
        raise ValueError("Gemma-3 GGUF with key_length != value_length is not supported")
    vocab = meta.get(f"{a}.vocab_size", None) or len(meta.get("tokenizer.ggml.tokens"))
    # The GGUF stores the global layers' theta; the local one is fixed in llama.cpp (and HF's default).
    full_rope = {"rope_type": "default", "rope_theta": float(meta.get(f"{a}.rope.freq_base", 1_000_000.0))}
    local_rope = {"rope_type": "default", "rope_theta": 10_000.0}
    scaling = meta.get(f"{a}.rope.scaling.type", "none")
    if scaling == "linear":  # Gemma-3 4B and larger: global layers only
        full_rope = {**full_rope, "rope_type": "linear", "factor": float(meta.get(f"{a}.rope.scaling.factor"))}
    elif scaling not in ("none", None):
        raise ValueError(f"GGUF uses RoPE scaling {scaling!r}, which the converter does not support yet")
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "hidden_size": hidden, "intermediate_size": int(meta.get(f"{a}.feed_forward_length")),
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{a}.attention.head_count_kv", heads)),
        "head_dim": head_dim, "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": float(meta.get(f"{a}.attention.layer_norm_rms_epsilon")),
        # transformers 5 reads rope_parameters per layer type; the flat keys are for other readers.
        "rope_theta": full_rope["rope_theta"], "rope_local_base_freq": local_rope["rope_theta"],
        "rope_parameters": {"full_attention": full_rope, "sliding_attention": local_rope},
        "sliding_window": int(meta.get(f"{a}.attention.sliding_window")),
        "layer_types": _gemma3_layer_types(meta, layers),
        # llama.cpp scales attention by 1/sqrt(head_dim), except 27B (62 layers): 1/sqrt(hidden/heads).
        "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
        "attn_logit_softcapping": meta.get(f"{a}.attn_logit_softcapping", None),
        "final_logit_softcapping": meta.get(f"{a}.final_logit_softcapping", None),
        "max_position_embeddings": int(meta.get(f"{a}.context_length")),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": False, "use_bidirectional_attention": False,
        **_special_token_ids(meta), "torch_dtype": "float32",
    }


def _gemma3_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    return _decoder_shapes(cfg, {
        "pre_feedforward_layernorm.weight": h, "post_feedforward_layernorm.weight": h,
        "self_attn.q_norm.weight": hd, "self_attn.k_norm.weight": hd,
    })


def _gemma3_fix(hf_name: str, w: np.ndarray, cfg: dict[str, Any]) -> np.ndarray:
    # llama.cpp stores Gemma's zero-centred norm weights (the model scales by 1 + w) with
    # the 1 added; take it back off, in float32, exactly as transformers' GGUF loader does.
    # q/k are not permuted for Gemma (llama.cpp runs it with NeoX RoPE).
    return w - np.float32(1.0) if hf_name.endswith("norm.weight") else w


ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec(_LLAMA_TENSORS, _llama_config, _llama_shapes, _llama_fix),
    "gemma3": ArchSpec(_GEMMA3_TENSORS, _gemma3_config, _gemma3_shapes, _gemma3_fix),
}

# ------------------------------------------------------------------- driver

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def _hf_name(spec: ArchSpec, gguf_name: str) -> str | None:
    m = _BLOCK_RE.match(gguf_name)
    key, idx = (f"blk.{{i}}.{m.group(2)}", m.group(1)) if m else (gguf_name, None)
    template = spec.tensor_names.get(key)
    return None if template is None else template.format(i=idx)


def _read_weights(reader: GGUFReader, spec: ArchSpec, cfg: dict[str, Any],
                  progress: bool) -> dict[str, np.ndarray]:
    expected = spec.expected_shapes(cfg)
    out: dict[str, np.ndarray] = {}
    for t in tqdm(reader.tensors, desc="Dequantizing GGUF", unit="tensor", file=sys.stderr,
                  disable=not progress):
        name = _hf_name(spec, t.name)
        if name is None or name not in expected:
            # Dropping an unknown weight would give a silently wrong model.
            raise ValueError(f"GGUF tensor {t.name!r} has no Hugging Face mapping")
        # Copy (np.array) so nothing keeps pointing into the reader's memmap.
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32, order="C")
        if w.shape != expected[name]:
            raise ValueError(f"{t.name} -> {name}: shape {w.shape}, expected {expected[name]}")
        out[name] = np.ascontiguousarray(spec.fix_tensor(name, w, cfg))
    missing = sorted(set(expected) - set(out))
    if missing:  # a truncated or foreign file: fail now, not at model load time
        raise ValueError(f"GGUF is missing {len(missing)} tensors, e.g. {missing[:3]}")
    return out


def _save_tokenizer(gguf_path: Path, dest: Path, chat_template: str | None) -> None:
    from transformers import AutoTokenizer  # imported lazily: slow, and only needed here

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                        local_files_only=True)
    if chat_template and not tok.chat_template:
        tok.chat_template = chat_template
    tok.save_pretrained(str(dest))
    # transformers 5 stores the template only in chat_template.jinja; keep a copy
    # in tokenizer_config.json too for readers that look there (the jinja file
    # wins when transformers loads, and both hold the same text).  Also drop
    # load-time flags that are not properties of the tokenizer.
    cfg_path = dest / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    for key in ("is_local", "local_files_only"):
        tok_cfg.pop(key, None)
    if tok.chat_template:
        tok_cfg["chat_template"] = tok.chat_template
    cfg_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> Path:
    """Convert ``gguf_path`` into a Hugging Face model folder at ``out_dir``.

    Writes config.json, generation_config.json, model.safetensors (float32,
    HF tensor names, q/k un-permuted) and the tokenizer files including the
    chat template.  The folder is built in a temporary sibling and renamed into
    place, so ``out_dir`` either does not exist or is complete.

    Raises ValueError for unsupported architectures or malformed files and
    FileExistsError if ``out_dir`` already exists.  Returns ``out_dir``.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"refusing to overwrite existing {out_dir}")
    reader = GGUFReader(gguf_path)
    meta = _Meta(reader)
    spec = ARCHITECTURES.get(arch := meta.get("general.architecture"))
    if spec is None:
        raise ValueError(f"GGUF architecture {arch!r} is not supported "
                         f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    cfg = spec.build_config(meta, {t.name for t in reader.tensors})

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Leading dot + random suffix: never mistaken for a finished folder, and
    # concurrent converters do not trample each other.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        weights = _read_weights(reader, spec, cfg, progress)
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del weights
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        _save_tokenizer(gguf_path, tmp, meta.get("tokenizer.chat_template", None))
        source = {"source": str(gguf_path.resolve()), "size": gguf_path.stat().st_size,
                  "architecture": arch, "converter_version": CONVERTER_VERSION}
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
        # mkdtemp makes 0700 (and safetensors 0600) entries; a model cache may be
        # shared between users, so publish world-readable like a normal folder.
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
        try:
            tmp.rename(out_dir)
        except OSError:
            if not (out_dir / "config.json").exists():
                raise
            # Another process finished the same conversion first; use theirs.
            logger.info("%s appeared during conversion; discarding our copy", out_dir)
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
