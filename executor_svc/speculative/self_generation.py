"""The target writing its own text: greedy or sampled continuations of many prompts at once.

Draft heads learn from what the target says (``train_heads``), and the requests they learn to answer
may come from the target too (``chat_prompts.sampled_requests``). Both run here, straight on the
engine's model in a private KV cache, without the scheduler: nothing is served, and a batch of a few
hundred prompts decodes as one packed forward per step.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from tqdm import tqdm

from executor_svc.packed_forward import Segment, pack, run_packed
from executor_svc.sampler import filtered_probs
from kvcache.layout import KVCacheLayout

GENERATE_CACHE_BYTES = 1 << 30  # KV cache of one self-generation batch


@dataclass(slots=True)
class Sampling:
    """Draw each token from the target's distribution at ``temperature``, within its nucleus of ``top_p``."""

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    generator: torch.Generator | None = None  # made on the logits' device at the first draw

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"temperature must be positive (greedy is no Sampling), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    def draw(self, logits: torch.Tensor) -> torch.Tensor:
        """One token id per row of ``logits`` ([rows, vocab]), filtered as the serving sampler filters."""
        if self.generator is None:
            self.generator = torch.Generator(device=logits.device).manual_seed(self.seed)
        rows = logits.shape[0]
        top_p = torch.full((rows,), self.top_p, device=logits.device) if self.top_p < 1 else None
        probs = filtered_probs(logits, torch.full((rows,), self.temperature, device=logits.device), top_p=top_p)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)


@torch.inference_mode()
def self_generate(
    engine, prompts: list[list[int]], max_tokens: int, eos_ids: set[int], progress: bool = True,
    sampling: Sampling | None = None,
) -> list[list[int]]:
    """Each prompt and the target's continuation: ``max_tokens`` in all, or up to an end-of-sequence token.
    Greedy, or drawn from the target's distribution as ``sampling`` says.

    Prompts run in batches in a private KV cache (one block run per prompt):
    a context forward, then one single-token row per unfinished prompt per step.
    """
    check_vocabulary(engine, prompts)
    config, tokens_per_block = engine.model_config, engine.tokens_per_block
    layout = KVCacheLayout(
        config.num_layers, config.num_kv_heads, config.head_dim, tokens_per_block, engine.layout.dtype
    )
    blocks_per_seq = -(-max_tokens // tokens_per_block)
    group = max(1, min(len(prompts), GENERATE_CACHE_BYTES // (blocks_per_seq * layout.bytes_per_block)))
    kv_cache = layout.allocate(group * blocks_per_seq, engine.device)
    tables = [list(range(j * blocks_per_seq, (j + 1) * blocks_per_seq)) for j in range(group)]
    seqs_all = [list(p[: max_tokens - 1]) for p in prompts]  # room for at least one generated token
    to_generate = sum(max_tokens - len(s) for s in seqs_all)
    bar = tqdm(total=to_generate, desc="self-generating", unit="tok", disable=not progress)
    for first in range(0, len(seqs_all), group):
        seqs = seqs_all[first : first + group]  # the same lists: appending grows seqs_all
        # First step: each prompt as one context query; its last position gives the first token.
        segments = [Segment(tables[j], 0, len(s), as_rows=False) for j, s in enumerate(seqs)]
        tokens = [t for s in seqs for t in s]
        last_rows = [end - 1 for end in itertools.accumulate(len(s) for s in seqs)]
        active = list(range(len(seqs)))
        while active:
            logits, _ = run_packed(engine.model, kv_cache, None, pack(segments, tokens_per_block), tokens, last_rows)
            chosen = logits.argmax(-1) if sampling is None else sampling.draw(logits)
            for j, token in zip(active, chosen.tolist()):
                seqs[j].append(token)
            done = [j for j in active if seqs[j][-1] in eos_ids or len(seqs[j]) >= max_tokens]
            bar.update(len(active) + sum(max_tokens - len(seqs[j]) for j in done))
            active = [j for j in active if j not in done]
            # Later steps: one single-token row per unfinished text, feeding its newest token.
            segments = [Segment(tables[j], len(seqs[j]) - 1, 1, as_rows=True) for j in active]
            tokens = [seqs[j][-1] for j in active]
            last_rows = list(range(len(active)))
    bar.close()
    return seqs_all  # each grown in place by its batch


def check_vocabulary(engine, token_lists: list[list[int]]) -> None:
    """Raise ValueError where the tokenizer made ids the engine's embedding has no row for (a random-weight shape
    built with a smaller vocabulary than its tokenizer's)."""
    largest = max((max(ids) for ids in token_lists if ids), default=-1)
    vocab = engine.model_config.vocab_size
    if largest >= vocab:
        raise ValueError(f"the tokenizer makes ids up to {largest}, but the engine's vocabulary holds {vocab}: "
                         "train heads for a model whose vocabulary covers its tokenizer")


def tokenizer_eos_ids(tokenizer) -> set[int]:
    """End-of-sequence ids of a Hugging Face tokenizer (where a self-generated text stops)."""
    return {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
