"""Model shapes for benchmarks with random weights (``--load-format dummy``).

No machine here reaches a model hub, so a shape is a Hugging Face folder with
only a ``config.json`` (the published config of the model) and the default
model's tokenizer, which is enough to build an engine with random weights of
that shape. The tokenizer only matters for text; the benchmarks send token ids.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SHAPES: dict[str, dict] = {
    # meta-llama/Llama-3.1-8B-Instruct config.json
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16",
    },
    # meta-llama/Llama-3.2-1B config.json (a draft-sized member of the same family)
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
        "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
        "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
    },
    # HuggingFaceTB/SmolLM2-135M config.json: a small model whose steps are short enough that the
    # host's share shows (random weights; the real checkpoint is `--model smollm2-135m-instruct`)
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
        "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    },
    # Not a published model: one tiny layer, so a step's device work costs next to nothing and
    # what a benchmark measures is the host's share (scheduling, packing, streaming per request).
    "tiny-host": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 8192, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    },
}


def shape_folder(name: str, root: Path, tokenizer_from: str = "smollm2-135m-instruct") -> Path:
    """A config-only Hugging Face folder of shape ``name`` under ``root`` (made once).

    ``tokenizer_from``: a folder holding tokenizer files, or a model name or .gguf whose
    tokenizer files are copied in.
    """
    from inflight.model_store import resolve_model

    if name not in SHAPES:
        raise KeyError(f"unknown shape {name!r}; known: {sorted(SHAPES)}")
    folder = root / f"shape-{name}"
    if not (folder / "config.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        given = Path(tokenizer_from).expanduser()
        tokenizer_source = given if given.is_dir() else resolve_model(tokenizer_from, progress=False)
        for path in tokenizer_source.iterdir():
            if path.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
                (folder / path.name).write_bytes(path.read_bytes())
        (folder / "config.json").write_text(json.dumps(SHAPES[name], indent=2))
    return folder


def engine_weight_bytes(model) -> int:
    """Bytes one decode step reads from a loaded engine's weights, as stored (a quantized matrix at
    its own width, with its scales): every parameter and buffer but the embedding table, of which
    a step reads one row per token, and the rotary tables, of which it reads one row per position.
    A table tied to the LM head counts once, as the head."""
    head = getattr(model, "lm_head", None)
    head_ptrs = {t.data_ptr() for t in [*head.parameters(), *head.buffers()]} if head is not None else set()
    seen, total = set(), 0
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        ptr = tensor.data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        if ("embed_tokens" in name and ptr not in head_ptrs) or name.endswith((".cos", ".sin")):
            continue
        total += tensor.numel() * tensor.element_size()
    return total


def kv_bytes_per_token(config: dict, bytes_per_value: int = 2) -> int:
    d = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * d * bytes_per_value


def add_model_source_args(p: argparse.ArgumentParser) -> None:
    """--shape or --model, --load-format and --tokenizer-from: what every engine benchmark builds."""
    src = p.add_mutually_exclusive_group()
    src.add_argument("--shape", choices=sorted(SHAPES), help="random weights of a known model's shape")
    src.add_argument("--model", default="smollm2-135m-instruct", help="model name, Hugging Face folder or .gguf")
    p.add_argument("--load-format", default=None, choices=["auto", "dummy"], help="default: dummy with --shape, else auto")
    p.add_argument("--tokenizer-from", default="smollm2-135m-instruct", help="with --shape: whose tokenizer to use")


def default_load_format(args: argparse.Namespace) -> None:
    """After parsing: --load-format defaults to random weights for a shape, the checkpoint's otherwise."""
    if args.load_format is None:
        args.load_format = "dummy" if args.shape else "auto"


def resolve_model_source(args: argparse.Namespace) -> tuple[Path, dict]:
    """The checkpoint folder and its config for the parsed model-source flags."""
    from inflight.model_store import default_cache_dir, resolve_model

    if args.shape:
        return shape_folder(args.shape, default_cache_dir(), args.tokenizer_from), SHAPES[args.shape]
    checkpoint = resolve_model(args.model)
    return checkpoint, json.loads((checkpoint / "config.json").read_text())
