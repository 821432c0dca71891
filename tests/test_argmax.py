"""Greedy token choice (plugins/argmax_torch.py): every implementation is torch.argmax, ties and NaN included."""

from __future__ import annotations

import pytest
import torch

from executor_svc.sampler import RequestSamplingState, Sampler
from plugins.argmax_torch import MAX_CHUNKS, MIN_CHUNK, argmax_chunks, row_argmax, row_argmax_two_stage
from plugins.registry import list_kernels
from protos.plan import SamplingConfig

VOCABS = [49152, 128256, 32000, 151936, 50257]  # SmolLM2, Llama 3, Llama 2, Qwen 2, GPT-2 (odd: no chunks)


def test_chunks_divide_the_row_and_stay_within_the_budget():
    assert argmax_chunks(1, 128256) == 64 and argmax_chunks(1, 49152) == 64 and argmax_chunks(4, 128256) == 16
    assert argmax_chunks(1, 50257) == 1  # odd: no equal chunks
    assert argmax_chunks(32, 128256) == 1  # enough rows to keep the GPU busy alone
    assert argmax_chunks(1, 1024) == 1  # two chunks of 512 are not worth a second stage
    for rows in (1, 2, 3, 8, 16, 31):
        for vocab in VOCABS:
            chunks = argmax_chunks(rows, vocab)
            assert vocab % chunks == 0
            assert chunks == 1 or (vocab // chunks >= MIN_CHUNK and rows * chunks <= MAX_CHUNKS)


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("rows", [1, 3, 16, 40])
def test_two_stage_is_torch_argmax(rows, vocab):
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows + vocab))
    assert torch.equal(row_argmax_two_stage(logits), torch.argmax(logits, dim=-1))


def test_ties_go_to_the_lowest_index_across_chunks_and_within_one():
    logits = torch.zeros(4, 128256)
    logits[0, [5000, 70000, 128255]] = 3.0  # in three chunks: the first chunk's wins
    logits[1, [2005, 2006]] = 1.0  # twice in one chunk (16 chunks of 8,016 columns at 4 rows): the first
    logits[2] = 7.0  # every column equal: column 0
    logits[3, -1] = float("inf")
    logits[3, 9] = float("inf")
    expected = torch.tensor([5000, 2005, 0, 9])
    assert torch.equal(row_argmax_two_stage(logits), expected)
    assert torch.equal(torch.argmax(logits, dim=-1), expected)


def test_nan_wins_as_it_wins_torch_argmax():
    logits = torch.randn(2, 49152, generator=torch.Generator().manual_seed(0))
    logits[0, 40000] = float("nan")
    logits[1] = float("-inf")
    logits[1, 30000] = float("nan")
    assert torch.equal(row_argmax_two_stage(logits), torch.argmax(logits, dim=-1))
    assert row_argmax_two_stage(logits).tolist() == [40000, 30000]


def test_non_contiguous_rows_and_bad_shapes():
    wide = torch.randn(3, 2 * 49152, generator=torch.Generator().manual_seed(1))
    view = wide[:, ::2]  # a strided view: reshaped by copy, same answer
    assert torch.equal(row_argmax_two_stage(view), torch.argmax(view, dim=-1))
    with pytest.raises(ValueError, match="rows, vocab"):
        row_argmax_two_stage(torch.randn(49152))


def test_both_are_registered_and_the_sampler_uses_the_one_it_is_given():
    assert {spec.name for spec in list_kernels() if spec.kind == "argmax"} >= {"torch", "two_stage"}
    calls = []

    def counting(logits: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(logits.shape))
        return row_argmax_two_stage(logits)

    logits = torch.randn(2, 49152, generator=torch.Generator().manual_seed(2))
    states = [RequestSamplingState(SamplingConfig(temperature=0.0), [1, 2], torch.device("cpu")) for _ in range(2)]
    assert Sampler(counting).sample(logits, states) == row_argmax(logits).tolist()
    assert calls == [(2, 49152)]


def test_greedy_verification_takes_the_same_tokens_with_either():
    from executor_svc.speculative.verify import NO_DRAFT, verify_drafts

    logits = torch.randn(4, 49152, generator=torch.Generator().manual_seed(3))
    target = torch.argmax(logits, dim=-1)
    drafts = torch.tensor([int(target[0]), int(target[1]), 7, NO_DRAFT])  # two accepted, then a miss
    states = [RequestSamplingState(SamplingConfig(temperature=0.0), [1, 2], torch.device("cpu"))] * 4
    tokens, accepted = verify_drafts(logits, drafts, states, row_argmax_two_stage)
    assert torch.equal(tokens, target) and accepted.tolist() == [True, True, bool(target[2] == 7), False]
    reference = verify_drafts(logits, drafts, states)
    assert torch.equal(tokens, reference[0]) and torch.equal(accepted, reference[1])
