"""Model hyper-parameters read from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any



@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    # Gemma-3 style fields; the defaults are what Llama-family models mean.
    hidden_act: str = "silu"  # "gelu_pytorch_tanh" for Gemma's GeGLU
    layer_types: tuple[str, ...] | None = None  # per layer: "full_attention" or "sliding_attention"
    sliding_window: int = 0  # window of the "sliding_attention" layers; 0 = none
    rope_local_theta: float | None = None  # RoPE theta of sliding-window layers (Gemma-3: 10000)
    query_pre_attn_scalar: float | None = None  # attention scale is this ** -0.5; None = head_dim
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        raw = json.loads((folder / "config.json").read_text())
        architectures = raw.get("architectures") or ["LlamaForCausalLM"]
        architecture = architectures[0]
        heads = raw["num_attention_heads"]
        rope_theta = raw.get("rope_theta")
        rope_scaling = raw.get("rope_scaling")
        rope_local_theta = raw.get("rope_local_base_freq")
        params = raw.get("rope_parameters") or {}
        if "full_attention" in params:  # transformers 5 Gemma-3: one RoPE setting per layer type
            local = params.get("sliding_attention") or {}
            params = params["full_attention"] or {}
            rope_theta = params.get("rope_theta", rope_theta)
            rope_local_theta = local.get("rope_theta", rope_local_theta)
            if local.get("rope_type", "default") != "default":
                raise ValueError(f"{folder}: RoPE scaling of sliding-window layers is not supported")
            if params.get("rope_type", "default") != "default":
                rope_scaling = params
        elif rope_theta is None:  # transformers 5 nests rope settings under rope_parameters
            rope_theta = params.get("rope_theta", 10000.0)
            if params.get("rope_type", "default") != "default":
                rope_scaling = params
        layer_types = raw.get("layer_types")
        if layer_types is None and raw.get("model_type") == "gemma3_text":
            # Older Gemma-3 configs give only the pattern: every n-th layer is global.
            pattern = raw.get("sliding_window_pattern", 6)
            layer_types = [
                "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(raw["num_hidden_layers"])
            ]
        return cls(
            # Folders of the model store end in a content hash; the name is what precedes it.
            name=raw.get("_name_or_path") or re.sub(r"-[0-9a-f]{12}$", "", folder.name),
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "silu",
            layer_types=tuple(layer_types) if layer_types is not None else None,
            sliding_window=raw.get("sliding_window") or 0,
            rope_local_theta=float(rope_local_theta) if rope_local_theta is not None else None,
            query_pre_attn_scalar=raw.get("query_pre_attn_scalar"),
            attn_logit_softcapping=raw.get("attn_logit_softcapping"),
            final_logit_softcapping=raw.get("final_logit_softcapping"),
        )
