"""Verifying a chain of draft tokens against the target model, losslessly.

Every proposer in this package drafts deterministically (prompt lookup copies
tokens, a draft model or draft heads take their argmax), so the draft
distribution q is a point mass on the drafted token. Speculative sampling
(Leviathan et al. 2023; Chen et al. 2023) then reduces to:

* accept draft d at position i with probability min(1, p_i(d) / q_i(d)) = p_i(d);
* at the first rejection, draw from the residual max(p_i - q_i, 0), which is
  p_i with d's mass removed, renormalised;
* when all k drafts are accepted, draw one more token from p_k.

The emitted token at position i is therefore d with probability p_i(d), and
any other x with probability (1 - p_i(d)) * p_i(x) / (1 - p_i(d)) = p_i(x):
exactly the target's distribution, whatever the drafts were. Greedy requests
are the limit of that rule: a draft is accepted when it equals the target's
argmax, and the target's argmax is emitted at the first mismatch.

The whole batch is verified with a few tensor operations on the device; the
host only walks each chain to its first rejection once the step's results
arrive (``accepted_prefix``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from executor_svc.packed_forward import to_device
from executor_svc.sampler import RequestSamplingState, config_probs
from plugins.argmax_torch import row_argmax

NO_DRAFT = -1  # marks the last row of a chain: it only provides the bonus token


def verify_drafts(
    logits: torch.Tensor,  # [rows, vocab]: for each request, its 1 + k rows in order
    draft_ids: torch.Tensor,  # [rows] int64: the draft each row judges; NO_DRAFT on each chain's last row
    states: Sequence[RequestSamplingState],  # per row (one request's state repeated over its rows)
    argmax: Callable[[torch.Tensor], torch.Tensor] = row_argmax,  # the engine's choice (plugins/argmax_torch.py)
) -> tuple[torch.Tensor, torch.Tensor]:  # tokens [rows] int64, accepted [rows] bool
    """Judge every draft of a batch at once.

    ``tokens[r]`` is what the chain emits at row ``r`` if it gets that far: the
    draft itself when ``accepted[r]``, otherwise the target's own token (drawn
    from the residual, or the bonus on a chain's last row, where ``accepted``
    is always False). Nothing here waits for the device.
    """
    if logits.shape[0] != draft_ids.shape[0] or logits.shape[0] != len(states):
        raise ValueError(f"logits {tuple(logits.shape)}, drafts {tuple(draft_ids.shape)} and {len(states)} states disagree")
    has_draft = draft_ids != NO_DRAFT
    safe_drafts = draft_ids.clamp_min(0)
    greedy = [i for i, s in enumerate(states) if s.config.is_greedy]
    if len(greedy) == len(states):
        tokens = argmax(logits)
        return tokens, has_draft & (tokens == safe_drafts)
    device = logits.device
    tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=device)
    accepted = torch.zeros(logits.shape[0], dtype=torch.bool, device=device)
    if greedy:
        rows = to_device(greedy, torch.int64, device)
        best = argmax(logits[rows])
        tokens[rows] = best
        accepted[rows] = has_draft[rows] & (best == safe_drafts[rows])
    sampled = [i for i, s in enumerate(states) if not s.config.is_greedy]
    rows = to_device(sampled, torch.int64, device)
    probs = config_probs(logits[rows], [states[i].config for i in sampled])  # [sampled rows, vocab]
    drafts, judged = safe_drafts[rows], has_draft[rows]
    p_draft = probs.gather(1, drafts[:, None]).squeeze(1)  # p_i(d_i)
    # Each row draws from its own request's generator: one uniform (accept?) and
    # one exponential race over the vocab (the residual, or the bonus token).
    uniform = torch.empty(len(sampled), dtype=torch.float32, device=device)
    noise = torch.empty_like(probs)
    for j, i in enumerate(sampled):
        states[i]._catch_up(probs.shape[1], device)
        uniform[j : j + 1].uniform_(generator=states[i].generator)
        noise[j].exponential_(generator=states[i].generator)
    row_accepts = judged & (uniform < p_draft)
    # The residual: p without the draft's mass (on the bonus row nothing is removed).
    residual = probs.scatter(1, drafts[:, None], torch.where(judged, 0.0, p_draft)[:, None])
    # A zero draw would turn a removed token (prob 0) into 0/0 = NaN, which argmax picks.
    own = argmax(residual / noise.clamp_min_(torch.finfo(torch.float32).tiny))
    tokens[rows] = torch.where(row_accepts, drafts, own)
    accepted[rows] = row_accepts
    return tokens, accepted


def accepted_prefix(tokens: Sequence[int], accepted: Sequence[bool | int]) -> list[int]:
    """What one chain emits: its drafts up to the first rejection, then the target's token there.

    ``tokens`` and ``accepted`` are one request's rows from ``verify_drafts``;
    the result has between 1 and ``len(tokens)`` ids.
    """
    for i, ok in enumerate(accepted):
        if not ok:
            return list(tokens[: i + 1])
    return list(tokens)  # unreachable for well-formed chains: the last row is never accepted
