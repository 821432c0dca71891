"""Load a Hugging Face checkpoint folder into a packed-token decoder model.

Hugging Face keeps q/k/v and gate/up as separate matrices; the model here
wants them fused, so they are concatenated while loading, one tensor at a time
so peak memory stays near one copy of the weights.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from executor_svc.model.llama import LlamaForCausalLM


def _checkpoint_tensors(folder: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file that holds it."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files")
    index: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                index[name] = file
    return index


LLAMA_LAYER_NORMS = {"input_layernorm": "input_layernorm", "post_attention_layernorm": "post_attention_layernorm"}


def load_decoder_weights(model: nn.Module, folder: Path, layer_norms: dict[str, str]) -> None:
    """Copy a decoder-only checkpoint into ``model``, fusing q/k/v and gate/up.

    ``layer_norms`` maps each layer's norm submodule to its checkpoint name
    (the part after ``model.layers.N.``); norms are copied as stored.
    """
    index = _checkpoint_tensors(folder)
    handles: dict[Path, object] = {}

    def get(name: str) -> torch.Tensor:
        file = index.get(name)
        if file is None:
            raise KeyError(f"{folder}: checkpoint has no tensor {name!r}")
        if file not in handles:
            handles[file] = safe_open(str(file), framework="pt")
        return handles[file].get_tensor(name)  # type: ignore[attr-defined]

    with torch.no_grad():
        model.embed_tokens.weight.copy_(get("model.embed_tokens.weight"))
        model.norm.weight.copy_(get("model.norm.weight"))
        if not model.config.tie_word_embeddings:  # tied: the model already shares one tensor
            model.lm_head.weight.copy_(get("lm_head.weight"))
        for i, layer in enumerate(model.layers):
            prefix = f"model.layers.{i}."
            for module_name, checkpoint_name in layer_norms.items():
                layer.get_submodule(module_name).weight.copy_(get(prefix + checkpoint_name + ".weight"))
            layer.qkv_proj.weight.copy_(
                torch.cat([get(prefix + f"self_attn.{p}_proj.weight") for p in ("q", "k", "v")], dim=0)
            )
            layer.o_proj.weight.copy_(get(prefix + "self_attn.o_proj.weight"))
            layer.gate_up_proj.weight.copy_(
                torch.cat([get(prefix + f"mlp.{p}_proj.weight") for p in ("gate", "up")], dim=0)
            )
            layer.down_proj.weight.copy_(get(prefix + "mlp.down_proj.weight"))


def load_hf_weights(model: LlamaForCausalLM, folder: Path) -> None:
    """Copy a Llama-family checkpoint's tensors into ``model`` (converting to its dtype)."""
    load_decoder_weights(model, folder, LLAMA_LAYER_NORMS)


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights of the right scale, for benchmarks where only shapes matter.

    Norms get the weight that makes them scale by one (1, or 0 for Gemma's
    zero-centred ``1 + weight`` norms), so activations stay in range.
    """
    from executor_svc.model.llama import RMSNorm

    # Drawn on the parameters' device: on a GPU, an 8B model's weights take seconds, not minutes.
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        norm_weights = {id(m.weight): 1.0 - m.weight_offset for m in model.modules() if isinstance(m, RMSNorm)}
        for param in model.parameters():
            if id(param) in norm_weights:
                param.fill_(norm_weights[id(param)])
            else:
                fan_in = param.shape[-1]
                generator = generators.get(param.device)
                if generator is None:
                    generator = generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
                values = torch.randn(param.shape, generator=generator, device=param.device) * fan_in**-0.5
                param.copy_(values.to(param.dtype))
