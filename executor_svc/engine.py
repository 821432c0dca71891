"""Everything the executor loads once: model, KV cache, sampler settings.

``load_engine`` builds the model on its device, loads weights (or random ones),
and sizes the paged KV cache from a memory budget: an explicit number of
bytes, or what is free on the GPU after the weights minus a reserve of
``1 - kv_cache_fraction`` of the card for activations (vLLM's
gpu_memory_utilization idea).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from executor_svc.model.config import ModelConfig
from executor_svc.model.registry import architecture_for
from executor_svc.model.weights import init_dummy_weights
from kvcache.layout import KVCacheLayout
from plugins import get_kernel

log = logging.getLogger("inflight.executor")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class EngineConfig:
    """How to load and size an engine; the CLI fills it from flags."""

    model_dir: Path
    device: str = "auto"  # "auto" = cuda if available, else cpu
    dtype: str = "auto"  # "auto" = bfloat16 on cuda, float32 on cpu
    max_batch_size: int = 256
    max_num_tokens: int = 8192
    max_seq_len: int = 0  # 0 = the model's max_position_embeddings
    tokens_per_block: int = 32
    kv_cache_bytes: int = 0  # 0 = derive from kv_cache_fraction (GPU) or 2 GiB (CPU)
    kv_cache_fraction: float = 0.9  # of GPU memory, when kv_cache_bytes is 0
    attention: str = "torch"
    load_format: str = "auto"  # "auto" (safetensors) or "dummy" (random weights)


@dataclass(slots=True)
class Engine:
    config: EngineConfig
    model_config: ModelConfig
    model: nn.Module  # forward(input_ids, positions, kv_cache, meta) -> hidden; compute_logits(hidden)
    kv_cache: torch.Tensor  # [layers, 2, num_blocks, tokens_per_block, kv_heads, D]
    layout: KVCacheLayout
    num_kv_blocks: int
    device: torch.device
    dtype: torch.dtype
    max_seq_len: int

    @property
    def device_name(self) -> str:
        if self.device.type == "cuda":
            return f"{self.device} ({torch.cuda.get_device_name(self.device)})"
        return str(self.device)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r} asked for, but torch sees no CUDA GPU")
    return device


def load_engine(config: EngineConfig) -> Engine:
    device = resolve_device(config.device)
    dtype_name = config.dtype if config.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    if dtype_name not in DTYPES:
        raise ValueError(f"dtype {dtype_name!r} is not one of {sorted(DTYPES)}")
    dtype = DTYPES[dtype_name]
    model_config = ModelConfig.from_folder(config.model_dir)
    max_seq_len = config.max_seq_len or model_config.max_position_embeddings
    attention = get_kernel("attention", config.attention, device, dtype)

    arch = architecture_for(model_config)
    with torch.device(device):
        model = arch.model_class(model_config, max_positions=max_seq_len, attention=attention.fn)
    model = model.to(dtype)
    if config.load_format == "dummy":
        init_dummy_weights(model)
    elif config.load_format == "auto":
        arch.load_checkpoint(model, config.model_dir)
    else:
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {config.load_format!r}")
    model.eval().requires_grad_(False)

    layout = KVCacheLayout(
        num_layers=model_config.num_layers,
        num_kv_heads=model_config.num_kv_heads,
        head_dim=model_config.head_dim,
        tokens_per_block=config.tokens_per_block,
        dtype=dtype,
    )
    budget = config.kv_cache_bytes or _default_kv_budget(device, config.kv_cache_fraction)
    num_blocks = layout.num_blocks_for_budget(budget)
    min_blocks = -(-max_seq_len // config.tokens_per_block)
    if num_blocks < min_blocks:
        raise ValueError(
            f"KV cache budget of {budget / 2**20:.0f} MiB holds {num_blocks} blocks of {config.tokens_per_block} tokens, "
            f"fewer than one max_seq_len={max_seq_len} sequence needs ({min_blocks}); raise the KV cache size or lower max_seq_len"
        )
    kv_cache = layout.allocate(num_blocks, device)
    log.info(
        "engine ready: %s on %s (%s), %d KV blocks x %d tokens (%.0f MiB)",
        model_config.name, device, dtype_name, num_blocks, config.tokens_per_block, num_blocks * layout.bytes_per_block / 2**20,
    )
    return Engine(config, model_config, model, kv_cache, layout, num_blocks, device, dtype, max_seq_len)


def _default_kv_budget(device: torch.device, fraction: float) -> int:
    if device.type != "cuda":
        return 2 << 30
    free, total = torch.cuda.mem_get_info(device)
    # Leave (1 - fraction) of the whole card for activations and the allocator.
    return max(0, int(free - (1.0 - fraction) * total))
