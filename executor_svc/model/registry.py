"""Which model class serves which Hugging Face architecture, and how its
checkpoint tensors are loaded. Adding an architecture is one entry here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from executor_svc.model.config import ModelConfig
from executor_svc.model.llama import LlamaForCausalLM
from executor_svc.model.weights import load_hf_weights


@dataclass(frozen=True, slots=True)
class Architecture:
    model_class: Callable[..., nn.Module]  # (config, max_positions, attention) -> model
    load_checkpoint: Callable[[nn.Module, Path], None]  # copies HF tensors into the model


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(LlamaForCausalLM, load_hf_weights),
    "MistralForCausalLM": Architecture(LlamaForCausalLM, load_hf_weights),
}


def architecture_for(config: ModelConfig) -> Architecture:
    try:
        return ARCHITECTURES[config.architecture]
    except KeyError:
        raise ValueError(
            f"architecture {config.architecture!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
        ) from None
