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

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        raw = json.loads((folder / "config.json").read_text())
        architectures = raw.get("architectures") or ["LlamaForCausalLM"]
        architecture = architectures[0]
        heads = raw["num_attention_heads"]
        rope_theta = raw.get("rope_theta")
        rope_scaling = raw.get("rope_scaling")
        if rope_theta is None:  # transformers 5 nests rope settings under rope_parameters
            params = raw.get("rope_parameters") or {}
            rope_theta = params.get("rope_theta", 10000.0)
            if params.get("rope_type", "default") != "default":
                rope_scaling = params
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
        )
