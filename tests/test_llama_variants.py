"""Other Llama-family checkpoints load from a Hugging Face folder and match transformers.

Tiny models with random weights, saved by transformers itself: Llama-3 style
(GQA, Llama-3 RoPE scaling, untied head) and Mistral style. Greedy tokens from
inflight must equal transformers' ``generate`` on the same folder.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from executor_svc.build_config import BuildConfig
from executor_svc.builder import build_engine
from executor_svc.engine import RuntimeConfig, load_engine
from inflight.inprocess import InProcessExecutor
from scheduler_svc.api_types import GenerationRequest
from scheduler_svc.engine_loop import AsyncEngine
from scheduler_svc.tokenizer import Tokenizer

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, vocab_size=49152)
VARIANTS = {
    "llama3-rope-scaling": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
    )),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(rope_theta=10000.0, sliding_window=None, tie_word_embeddings=False)),
    # Mistral 7B v0.1 style: every layer attends to a sliding window (short here, so the prompt exceeds it).
    "mistral-sliding-window": ("MistralConfig", "MistralForCausalLM", dict(rope_theta=10000.0, sliding_window=24, tie_word_embeddings=False)),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_matches_transformers(variant, model_dir, tmp_path):
    import transformers

    config_cls, model_cls, extra = VARIANTS[variant]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**SHAPE, **extra, bos_token_id=1, eos_token_id=2)
    hf = getattr(transformers, model_cls)(config).eval()
    folder = tmp_path / variant
    hf.save_pretrained(folder)
    tokenizer = Tokenizer(model_dir)  # SmolLM2's tokenizer stands in; the vocab sizes agree
    tokenizer.hf.save_pretrained(folder)
    prompts = ["The quick brown fox", "In 1492, Columbus sailed the ocean blue and " * 4]
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([tokenizer.encode(prompt)])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, eos_token_id=None)
            expected.append(out[0, ids.shape[1]:].tolist())

    build_engine(folder, tmp_path / "engine", BuildConfig(max_seq_len=256, tokens_per_block=16, max_num_tokens=32, dtype="float32"), device="cpu", progress=False)
    engine = load_engine(tmp_path / "engine", RuntimeConfig(device="cpu", kv_cache_bytes=16 << 20))

    async def run():
        async_engine = AsyncEngine(InProcessExecutor(engine), Tokenizer(folder))
        await async_engine.start()
        try:
            async def one(prompt):
                req = GenerationRequest(text=prompt, temperature=0.0, max_tokens=12, ignore_eos=True)
                return [t async for c in async_engine.generate(req) for t in c.token_ids]
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await async_engine.stop()

    assert asyncio.run(run()) == expected
