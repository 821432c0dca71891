"""Loading an engine folder for serving: model, weights, KV cache.

``load_engine`` checks that the engine was built for this device, builds the
model with the kernels the builder chose, loads the prepared weights (or
re-draws random ones for a dummy engine), and sizes the paged KV cache from a
memory budget: an explicit number of bytes, or what is free on the GPU after
the weights minus a reserve of ``1 - kv_cache_fraction`` of the card for
activations (vLLM's gpu_memory_utilization idea). An engine built with
``kv_cache_quant_algo`` FP8 or INT8 stores the cache in 1-byte elements (twice
the tokens for the same budget) and gets each layer's KV scales from its
manifest. On a GPU the largest prompt step runs once before the engine is
returned (``warm_up.py``), so the first batch of prompts does not pay for
kernel compilation and allocator growth.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_model
from torch import nn

from executor_svc.cuda_graphs import DecodeGraphs
from executor_svc.engine_file import WEIGHTS_NAME, EngineManifest, check_device, read_manifest
from executor_svc.kernel_selection import apply_tactics
from executor_svc.kv_offload import KVOffload
from executor_svc.model.config import ModelConfig
from executor_svc.model.weights import init_dummy_weights
from executor_svc.packed_forward import MAX_ROWS_PER_CHUNK
from executor_svc.quantization.kv_cache import apply_kv_cache_scales, kv_cache_dtype
from executor_svc.quantization.linear import Int4AWQLinear
from executor_svc.quantization.records import KVCacheQuant
from executor_svc.speculative.proposer import SpeculativeConfig, SpeculativeMode
from executor_svc.warm_up import warm_up_prompt_step
from kvcache.layout import KVCacheLayout

log = logging.getLogger("inflight.executor")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class RuntimeConfig:
    """Settings of one executor process (the rest is baked into the engine)."""

    device: str = "auto"  # "auto" = the engine's device type, index 0
    kv_cache_bytes: int = 0  # 0 = derive from kv_cache_fraction (GPU) or 2 GiB (CPU)
    kv_cache_fraction: float = 0.9  # of GPU memory, when kv_cache_bytes is 0
    cuda_graphs: bool = True  # capture generation steps on a GPU; False = always eager
    host_cache_bytes: int = 0  # host-memory tier of the KV cache (pinned on a GPU); 0 = none
    num_kv_blocks: int = 0  # > 0: exactly this many blocks, whatever the budget says
    warm_up: bool = True  # on a GPU, run the largest prompt step once at load (executor_svc/warm_up.py)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)


@dataclass(slots=True)
class Engine:
    engine_dir: Path
    manifest: EngineManifest
    model: nn.Module  # forward(input_ids, positions, kv_cache, meta) -> hidden; compute_logits(hidden)
    # [layers, 2, num_kv_blocks + 1, tokens_per_block, kv_heads, D]: the last block is
    # scratch space for the padding rows of CUDA graphs, never given to the scheduler.
    kv_cache: torch.Tensor
    layout: KVCacheLayout
    num_kv_blocks: int  # blocks the scheduler may hand out: ids 0 .. num_kv_blocks - 1
    device: torch.device
    dtype: torch.dtype  # of the model; the KV cache's is layout.dtype (1-byte for an FP8 / INT8 cache)
    decode_graphs: DecodeGraphs | None = None  # captured generation steps (GPU only)
    kv_offload: KVOffload | None = None  # the host tier of the KV cache and its copies
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    # A draft model for speculative decoding: its KV cache mirrors this one's blocks.
    draft: Engine | None = None

    @property
    def model_config(self) -> ModelConfig:
        return self.manifest.model

    @property
    def max_seq_len(self) -> int:
        return self.manifest.max_seq_len

    @property
    def max_batch_size(self) -> int:
        return self.manifest.build_config.max_batch_size

    @property
    def max_num_tokens(self) -> int:
        return self.manifest.build_config.max_num_tokens

    @property
    def tokens_per_block(self) -> int:
        return self.manifest.build_config.tokens_per_block

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


def load_engine(engine_dir: Path, runtime: RuntimeConfig | None = None) -> Engine:
    from executor_svc.model.registry import build_model  # the registry imports model code; keep it lazy
    from executor_svc.quantization.quantizer import prepare_quantized_engine

    runtime = runtime or RuntimeConfig()
    draft = None
    if runtime.speculative.mode is SpeculativeMode.DRAFT_MODEL:
        # The draft's weights go first, so that the target's KV budget (what is free
        # afterwards) leaves room for them; its cache is sized with the target's below.
        draft = _load_draft(runtime)
    manifest = read_manifest(engine_dir)
    device = torch.device("cuda:0" if manifest.device.type == "cuda" else "cpu") if runtime.device == "auto" else torch.device(runtime.device)
    check_device(manifest, device, engine_dir)
    dtype = DTYPES[manifest.dtype]
    model_config = manifest.model
    apply_tactics(manifest.plugins)
    model = build_model(model_config, manifest.max_seq_len, {k: c.name for k, c in manifest.plugins.items()}, device, dtype)
    if manifest.load_format == "dummy":
        init_dummy_weights(model)
        prepare_quantized_engine(model, manifest, device, dtype, random_weights=True)
    else:
        prepare_quantized_engine(model, manifest, device, dtype, random_weights=False)  # empty quantized modules
        missing, unexpected = load_model(model, str(engine_dir / WEIGHTS_NAME), strict=True, device=str(device))
        if missing or unexpected:
            raise RuntimeError(f"{engine_dir}: weights do not match the model (missing {missing}, unexpected {unexpected})")
    for module in model.modules():
        if isinstance(module, Int4AWQLinear):
            module.store_scales_by_group()

    build = manifest.build_config
    apply_kv_cache_scales(model, _kv_cache_record(manifest, engine_dir))
    layout = KVCacheLayout(
        num_layers=model_config.num_layers, num_kv_heads=model_config.num_kv_heads, head_dim=model_config.head_dim,
        tokens_per_block=build.tokens_per_block, dtype=kv_cache_dtype(build.quant_config.kv_cache_quant_algo, dtype),
    )
    budget = runtime.kv_cache_bytes or _default_kv_budget(device, runtime.kv_cache_fraction)
    # A draft model's cache has as many blocks as the target's: the budget pays for both.
    per_block = layout.bytes_per_block + (draft.layout.bytes_per_block if draft is not None else 0)
    num_blocks = kv_pool_blocks(budget, per_block)
    if runtime.num_kv_blocks:
        num_blocks = runtime.num_kv_blocks
    min_blocks = -(-manifest.max_seq_len // build.tokens_per_block)
    if num_blocks < min_blocks:
        raise ValueError(
            f"KV cache budget of {budget / 2**20:.0f} MiB holds {num_blocks} blocks of {build.tokens_per_block} tokens, "
            f"fewer than one max_seq_len={manifest.max_seq_len} sequence needs ({min_blocks}); "
            "raise the KV cache size or build with a smaller max_seq_len"
        )
    kv_cache = layout.allocate(num_blocks + 1, device)  # + the scratch block
    log.info(
        "engine ready: %s on %s (%s), %d KV blocks x %d tokens (%.0f MiB, %s)", model_config.name, device,
        manifest.dtype, num_blocks, build.tokens_per_block, num_blocks * layout.bytes_per_block / 2**20,
        str(layout.dtype).removeprefix("torch."),
    )
    engine = Engine(engine_dir, manifest, model, kv_cache, layout, num_blocks, device, dtype)
    engine.speculative = runtime.speculative
    engine.kv_offload = KVOffload(kv_cache, num_blocks, KVOffload.blocks_for_budget(layout, runtime.host_cache_bytes))
    if device.type == "cuda" and runtime.cuda_graphs:
        engine.decode_graphs = capture_graphs(engine, tree_masks=runtime.speculative.draft_tree is not None)
    if device.type == "cuda" and runtime.warm_up:
        warm_up_prompt_step(engine)
    if draft is not None:
        if draft.tokens_per_block != engine.tokens_per_block:
            raise ValueError(
                f"draft engine {draft.engine_dir} uses {draft.tokens_per_block} tokens per KV block, the target "
                f"{engine.tokens_per_block}: build it with the same --tokens-per-block"
            )
        draft.kv_cache = None  # the placeholder cache goes before the real one is allocated
        draft.kv_cache = draft.layout.allocate(num_blocks + 1, device)
        draft.num_kv_blocks = num_blocks
        if engine.decode_graphs is not None:
            draft.decode_graphs = capture_graphs(draft)
        engine.draft = draft
    return engine


def kv_pool_blocks(budget_bytes: int, bytes_per_block: int) -> int:
    """Blocks the scheduler gets from a KV budget: one block of the budget is the scratch block."""
    return budget_bytes // bytes_per_block - 1


def _kv_cache_record(manifest: EngineManifest, engine_dir: Path) -> KVCacheQuant | None:
    """The KV-cache scales an FP8 / INT8 engine was built with; None for a 16-bit cache."""
    algo = manifest.build_config.quant_config.kv_cache_quant_algo
    record = manifest.quantization.kv_cache if manifest.quantization is not None else None
    if algo == "none":
        return None
    if record is None or record.algo != algo:
        raise ValueError(
            f"{engine_dir} is built for a {algo} KV cache but records no {algo} KV-cache scales; rebuild it: "
            f"inflight build --model {manifest.source or 'MODEL'} --kv-cache-quant-algo {algo} --output {engine_dir}"
        )
    return record


def capture_graphs(engine: Engine, tree_masks: bool = False) -> DecodeGraphs:
    """CUDA graphs of ``engine``'s generation steps; ``tree_masks``: attention reads per-row tree masks."""
    # Rows past the batch size too: a short prompt runs as rows through a graph (packed_forward's
    # short_chunks_as_rows) instead of eagerly, whose launches alone cost a small model 20 ms.
    rows = max(engine.max_batch_size, min(MAX_ROWS_PER_CHUNK, engine.manifest.build_config.max_num_tokens))
    graphs = DecodeGraphs(
        engine.model, engine.kv_cache, scratch_block=engine.num_kv_blocks, max_batch_size=rows,
        max_seq_len=engine.max_seq_len, tokens_per_block=engine.tokens_per_block, tree_masks=tree_masks,
    )
    graphs.capture()
    return graphs


def _load_draft(runtime: RuntimeConfig) -> Engine:
    """The draft model's engine with a placeholder KV cache (one sequence's worth) and no graphs yet."""
    if runtime.speculative.draft_engine_dir is None:
        raise ValueError("speculative mode draft_model needs a draft engine folder (--draft-model)")
    draft_dir = Path(runtime.speculative.draft_engine_dir)
    manifest = read_manifest(draft_dir)
    min_blocks = -(-manifest.max_seq_len // manifest.build_config.tokens_per_block)
    placeholder = RuntimeConfig(device=runtime.device, num_kv_blocks=min_blocks, cuda_graphs=False, warm_up=False)
    return load_engine(draft_dir, placeholder)


def _default_kv_budget(device: torch.device, fraction: float) -> int:
    if device.type != "cuda":
        return 2 << 30
    free, total = torch.cuda.mem_get_info(device)
    # Leave (1 - fraction) of the whole card for activations and the allocator.
    return max(0, int(free - (1.0 - fraction) * total))
