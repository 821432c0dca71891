"""Running an engine's largest prompt step once at load, before any request.

CUDA graphs cover generation steps, but a step full of prompt tokens runs
eagerly, and the first run of such a step pays one-off costs: Triton
compiling the context kernels for their shapes, cuBLAS choosing kernels for
that many rows, the caching allocator growing to hold the activations. On an
H200 the first 8,192-token step of Llama-3.1-8B FP8 took about a second
instead of 0.1 s. vLLM pays the same at start-up with a dummy run of max_num_tokens
tokens; here the warm-up packs the step the way a batch of prompts arrives.

The warm-up writes KV entries into the pool's first blocks, which no
request owns yet at load; a request writes every slot before it reads it,
so the garbage is never seen.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from executor_svc.packed_forward import Segment, pack, run_packed

if TYPE_CHECKING:
    from executor_svc.engine import Engine

log = logging.getLogger(__name__)

PROMPT_TOKENS = 128  # tokens per warm-up prompt: a common prompt length, and many chunks per step


def warm_up_prompt_step(engine: Engine, max_tokens: int | None = None) -> int:
    """Run one eager forward of up to ``max_tokens`` (default: the engine's max_num_tokens) prompt tokens,
    packed as prompts of ``PROMPT_TOKENS``, and the LM head of their last tokens. Returns the tokens run."""
    block = engine.tokens_per_block
    prompt = min(PROMPT_TOKENS, engine.max_seq_len)
    blocks_per_prompt = -(-prompt // block)
    if engine.num_kv_blocks < blocks_per_prompt:
        return 0
    budget = engine.max_num_tokens if max_tokens is None else max_tokens
    count = max(1, min(budget // prompt, engine.num_kv_blocks // blocks_per_prompt))
    segments = [
        Segment(list(range(i * blocks_per_prompt, (i + 1) * blocks_per_prompt)), 0, prompt, as_rows=False)
        for i in range(count)
    ]
    packed = pack(segments, block)
    vocab = engine.manifest.model.vocab_size
    tokens = [(7919 * i + 13) % vocab for i in range(packed.num_tokens)]
    started = time.perf_counter()
    try:
        run_packed(engine.model, engine.kv_cache, None, packed, tokens, [(i + 1) * prompt - 1 for i in range(count)])
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
    except torch.cuda.OutOfMemoryError as exc:  # what the first full prompt step would hit while serving
        raise RuntimeError(
            f"a step of {packed.num_tokens} prompt tokens (max_num_tokens {engine.max_num_tokens}) does not fit "
            "in the memory left beside the KV cache: give the KV cache less (--kv-cache-fraction, --kv-cache-gb) "
            "or build with a smaller max_num_tokens"
        ) from exc
    log.info("warmed the prompt path: %d prompts of %d tokens in %.2f s", count, prompt, time.perf_counter() - started)
    return packed.num_tokens
