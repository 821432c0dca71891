"""Which model class serves which Hugging Face architecture, and how its
checkpoint tensors are loaded. Adding an architecture is one entry here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from executor_svc.model.config import ModelConfig
from executor_svc.model.gemma3 import Gemma3ForCausalLM, load_gemma3_weights
from executor_svc.model.llama import LlamaForCausalLM
from executor_svc.model.weights import load_hf_weights
from plugins.kernels import Kernels


@dataclass(frozen=True, slots=True)
class Architecture:
    model_class: Callable[..., nn.Module]  # (config, max_positions, kernels) -> model
    load_checkpoint: Callable[[nn.Module, Path], None]  # copies HF tensors into the model


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(LlamaForCausalLM, load_hf_weights),
    "MistralForCausalLM": Architecture(LlamaForCausalLM, load_hf_weights),
    "Gemma3ForCausalLM": Architecture(Gemma3ForCausalLM, load_gemma3_weights),
}


def architecture_for(config: ModelConfig) -> Architecture:
    try:
        return ARCHITECTURES[config.architecture]
    except KeyError:
        raise ValueError(
            f"architecture {config.architecture!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
        ) from None


def build_model(
    config: ModelConfig, max_positions: int, kernel_names: dict[str, str], device: torch.device, dtype: torch.dtype
) -> nn.Module:
    """An inference-mode model of ``config`` on ``device`` in ``dtype``, weights not yet loaded."""
    kernels = Kernels.from_names(kernel_names, device, dtype)
    with torch.device(device):
        model = architecture_for(config).model_class(config, max_positions=max_positions, kernels=kernels)
    return model.to(dtype).eval().requires_grad_(False)
