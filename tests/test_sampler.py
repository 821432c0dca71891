"""Tests for executor_svc.sampler: greedy/HF parity, seeding, distributions, penalties."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from executor_svc.sampler import RequestSamplingState, Sampler, filtered_probs
from protos.plan import SamplingConfig

CPU = torch.device("cpu")
LOGITS = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.8, 0.5, 0.3, 0.0, -0.5, -1.0, -1.5, -3.0])
N_DRAWS = 20_000


def assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    # torch.testing.assert_close costs ~1 s of lazy imports on first use; this is enough.
    assert torch.allclose(a, b, atol=1e-6), f"{a} != {b}"


def state(prompt=(), output=(), **kw) -> RequestSamplingState:
    return RequestSamplingState(SamplingConfig(**kw), list(prompt), CPU, list(output))


# ----- reference distributions, computed independently in numpy (sorted, renormalised) -----

def ref_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    x = logits.double().numpy() / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    keep = np.ones_like(p, dtype=bool)
    order = np.argsort(-p, kind="stable")
    if top_k:
        keep[order[top_k:]] = False
    if top_p < 1.0:
        q = np.where(keep, p, 0.0) / np.where(keep, p, 0.0).sum()
        cum = np.cumsum(q[order])
        n = int(np.searchsorted(cum, top_p) + 1)  # smallest prefix with mass >= top_p
        keep[order[n:]] = False
    if min_p:
        keep &= p >= min_p * p.max()
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def draw_many(n: int, rounds: int = 10, **kw) -> np.ndarray:
    """n draws of LOGITS: n // rounds rows in one batch, each with its own seed, sampled
    `rounds` times (so successive draws of one generator are covered too); token counts."""
    states = [state(seed=s, **kw) for s in range(n // rounds)]
    ids = []
    for _ in range(rounds):
        ids += Sampler().sample(LOGITS.expand(len(states), -1), states)
    return np.bincount(ids, minlength=LOGITS.numel())


CASES = {
    "temperature": dict(temperature=0.7),
    "temperature_hot": dict(temperature=1.8),
    "top_k": dict(temperature=1.0, top_k=4),
    "top_p": dict(temperature=1.0, top_p=0.75),
    "min_p": dict(temperature=1.0, min_p=0.2),
    "combined": dict(temperature=0.9, top_k=8, top_p=0.85, min_p=0.3),
}


@pytest.mark.parametrize("name", list(CASES))
def test_distribution_matches_config(name):
    kw = CASES[name]
    expected = ref_probs(LOGITS, **kw)
    # The pure filter gives exactly the configured distribution...
    row = lambda v, dt: torch.tensor([v], dtype=dt)
    got = filtered_probs(
        LOGITS[None], row(kw.get("temperature", 1.0), torch.float32),
        row(kw.get("top_k", 0), torch.long), row(kw.get("top_p", 1.0), torch.float32),
        row(kw.get("min_p", 0.0), torch.float32))
    np.testing.assert_allclose(got[0].double().numpy(), expected, atol=1e-6)
    # ...and the draws follow it: chi-square over the kept tokens, zero outside them.
    counts = draw_many(N_DRAWS, **kw)
    kept = expected > 0
    assert counts[~kept].sum() == 0, f"filtered-out tokens drawn: {counts}"
    if kept.sum() > 1:
        f_exp = expected[kept] * counts[kept].sum()
        assert chisquare(counts[kept], f_exp).pvalue > 1e-3


def test_filters_keep_at_least_one_and_ties():
    # top_p tiny keeps only the argmax; top_k ties at the boundary survive.
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0]])
    one = torch.ones(1)
    p = filtered_probs(logits, one, top_p=torch.tensor([1e-6]))
    assert p[0].tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]
    p = filtered_probs(logits, one, top_k=torch.tensor([2]))
    assert (p[0] > 0).tolist() == [False, True, True, True, False]
    # Mixed rows: per-row parameters, "off" values leave a row untouched.
    both = logits.expand(2, -1)
    p = filtered_probs(both, torch.ones(2), top_k=torch.tensor([1, 0]),
                       top_p=torch.tensor([1.0, 1.0]), min_p=torch.tensor([0.0, 0.0]))
    assert (p[0] > 0).sum() == 1
    assert_close(p[1], logits[0].softmax(-1))


def test_greedy_is_argmax_lowest_index_on_ties():
    logits = torch.tensor([[0.1, 5.0, 5.0, -1.0], [3.0, 1.0, 2.0, 3.0], [0.0, 0.0, 0.0, 0.0]])
    states = [state(temperature=0.0) for _ in range(3)]
    assert Sampler().sample(logits, states) == [1, 0, 0]
    assert Sampler().sample(logits.to(torch.bfloat16), states) == [1, 0, 0]


def test_greedy_with_repetition_penalty_matches_hf():
    logits = torch.tensor([[2.0, 1.9, -0.5, 1.05, -0.4, 0.1]])
    st = state(prompt=[0, 2], output=[0, 4], temperature=0.0, repetition_penalty=2.0)
    # HF: gather over prompt+output ids, positive / penalty, negative * penalty.
    expected = [1.0, 1.9, -1.0, 1.05, -0.8, 0.1]
    assert_close(Sampler().process_logits(logits, [st])[0], torch.tensor(expected))
    assert Sampler().sample(logits, [st]) == [1]  # 1.9 beats the penalised 2.0 -> 1.0
    assert logits[0, 0] == 2.0  # caller's logits untouched
    st.append_output([1])
    assert Sampler().sample(logits, [st]) == [3]  # now 1 is penalised too: 0.95 < 1.05


def test_presence_and_frequency_penalties():
    logits = torch.zeros(1, 6)
    st = state(output=[1, 1, 1, 4], presence_penalty=0.5, frequency_penalty=0.25)
    assert st.output_counts == {1: 3, 4: 1} and st.num_output_tokens == 4
    out = Sampler().process_logits(logits, [st])[0]
    assert_close(out, torch.tensor([0.0, -0.5 - 0.75, 0.0, 0.0, -0.5 - 0.25, 0.0]))
    st.append_output([4, 5])
    out = Sampler().process_logits(logits, [st])[0]
    assert_close(out, torch.tensor([0.0, -1.25, 0.0, 0.0, -1.0, -0.75]))
    # Prompt tokens do not count for presence/frequency.
    st2 = state(prompt=[2, 3], presence_penalty=1.0, frequency_penalty=1.0)
    assert torch.equal(Sampler().process_logits(logits, [st2]), logits)


def test_min_tokens_blocks_eos_until_reached():
    eos = 3
    logits = torch.tensor([[0.0, 1.0, 0.5, 9.0]])
    st = state(temperature=0.0, min_tokens=2, min_tokens_blocked_ids=[eos])
    sampler = Sampler()
    for _ in range(2):
        tok = sampler.sample(logits, [st])[0]
        assert tok != eos
        st.append_output([tok])
    assert sampler.sample(logits, [st]) == [eos]
    # Sampled rows too: eos is never drawn while blocked, even when it holds ~all the mass.
    rows = [state(seed=s, min_tokens=1, min_tokens_blocked_ids=[eos]) for s in range(200)]
    assert eos not in sampler.sample(logits.expand(200, -1), rows)


def _run(st: RequestSamplingState, steps: list[torch.Tensor], others=None) -> list[int]:
    """Sample st through steps, optionally batched next to other states (st at row 1)."""
    toks = []
    for logits in steps:
        batch = [st] if others is None else [others[0], st, *others[1:]]
        rows = logits[None] if others is None else logits.expand(len(batch), -1).clone()
        if others is not None:
            rows[0] += 3.0 * torch.arange(rows.shape[1]) % 5  # neighbours see other logits
        tok = Sampler().sample(rows, batch)[1 if others is not None else 0]
        st.append_output([tok])
        toks.append(tok)
    return toks


def test_seed_reproducible_and_batch_independent():
    g = torch.Generator().manual_seed(123)
    steps = [torch.randn(50, generator=g) for _ in range(12)]
    kw = dict(temperature=1.3, top_k=30, top_p=0.95, seed=42)
    alone = _run(state(**kw), steps)
    assert alone == _run(state(**kw), steps)
    others = [state(seed=7, temperature=0.5), state(temperature=0.0),
              state(seed=9, top_p=0.5, repetition_penalty=1.3, prompt=[1, 2])]
    assert alone == _run(state(**kw), steps, others)
    assert alone != _run(state(**{**kw, "seed": 43}), steps)


def test_resumed_state_continues_the_same_sequence():
    g = torch.Generator().manual_seed(5)
    steps = [torch.randn(40, generator=g) for _ in range(10)]
    kw = dict(temperature=1.0, seed=11, frequency_penalty=0.3)
    full = _run(state(prompt=[1, 2, 3], **kw), steps)
    resumed = state(prompt=[1, 2, 3], output=full[:6], **kw)
    assert resumed.num_output_tokens == 6
    assert _run(resumed, steps[6:]) == full[6:]
    again = RequestSamplingState.from_token_ids(SamplingConfig(**kw), [1, 2, 3, *full[:6]], 3, CPU)
    assert _run(again, steps[6:]) == full[6:]


def test_no_penalty_state_when_disabled():
    st = state(prompt=list(range(1000)), output=[1, 2])
    assert st._seen is None and st._counts is None and st.output_counts == {}
