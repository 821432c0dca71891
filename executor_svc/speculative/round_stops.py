"""Ending a step of chained verification rounds once every request in it has finished.

The host queues a step's R rounds at once and reads their tokens back with one
copy (``rounds.py``). A request that emits its end-of-sequence token in round 2
of 8 would still run rounds 3 to 8, and its caller would wait for them: its
last tokens arrive that much later, and the device computes rounds nobody reads.
At batch 1 every request ends that way once.

So after each round one small kernel counts what every request emitted and
marks it finished when it emitted one of its stop ids
(``NewRequest.stop_token_ids``) or reached its length limit; the flags go to
pinned host memory behind an event. The host looks one round behind: once it
has queued round r it waits for round r - 1's flags, while the device still
runs round r, so the device never idles for the host's decision, and it
queues nothing more once every request had finished. At most one round past
the last finish runs for nothing, instead of up to R - 1. The scheduler takes
a result of fewer rounds as it is (every request in it finishes).

Stop strings are matched on text by the scheduler and cannot end rounds here;
such a request simply runs its step's rounds.

The scheduler may also ask the executor to end a step's rounds early
(``ModelRunner.end_rounds``): a request arrived, and it should not wait for
every planned round. The host checks that request at the same point as the
flags, so the step ends after the round in flight, and the requests, which
have not finished, get the next step's drafts as after a last round. For that
a step whose requests cannot finish early is paced the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from executor_svc.packed_forward import to_device

NO_LIMIT = 1 << 62  # a request without a length limit never reaches this budget
LOOKBEHIND = 1  # rounds the host lets the device run ahead of its decision to stop


def round_finished_reference(
    tokens: torch.Tensor, accepted: torch.Tensor, stops: torch.Tensor, budget: torch.Tensor,
    emitted: torch.Tensor, finished: torch.Tensor,
) -> None:
    """Count a round's emitted tokens (``tokens`` [B, 1 + k] of which the first ``accepted`` + 1 count) into
    ``emitted`` [B] and set ``finished`` [B] (int32, sticky) where one of them is among the request's ``stops``
    [B, S] (padded with -1) or ``emitted`` reached ``budget`` [B]. In place; the kernel's torch reference."""
    n = accepted + 1
    counted = torch.arange(tokens.shape[1], device=tokens.device)[None, :] < n[:, None]
    hit = ((tokens[:, :, None] == stops[:, None, :]) & (stops[:, None, :] >= 0) & counted[:, :, None]).any(dim=2).any(dim=1)
    emitted.add_(n)
    finished.copy_((finished != 0) | hit | (emitted >= budget))


class RoundStops:
    """The stop state of one step's requests, and the decision to queue another round."""

    def __init__(
        self, stops: torch.Tensor, budget: torch.Tensor, num_rounds: int,
        end_requested: Callable[[], bool] | None = None,
    ) -> None:
        device = budget.device
        self.stops, self.budget = stops, budget
        self.emitted = torch.zeros_like(budget)
        self.finished = torch.zeros(budget.shape, dtype=torch.int32, device=device)
        self.on_gpu = device.type == "cuda"
        # Every round's flags, copied to the host behind an event (on a GPU).
        self.flags = torch.zeros((num_rounds, len(budget)), dtype=torch.int32, pin_memory=self.on_gpu)
        self.events: list[torch.cuda.Event] = []
        self.rounds_run: int | None = None  # set when the rounds end before the planned count
        self.end_requested = end_requested  # says whether the scheduler asked to end the step's rounds
        self.ended_on_request = False  # the rounds ended because it asked, not because every request finished

    @classmethod
    def of(
        cls, requests: Sequence, num_rounds: int, device: torch.device, at_finish: bool = True,
        end_requested: Callable[[], bool] | None = None,
    ) -> RoundStops | None:
        """The stop state of ``requests`` (``RoundsRequest``s) for ``num_rounds`` rounds, or None when nothing
        could end them early: one round, or neither a request with a stop id or a length limit (``at_finish``)
        nor ``end_requested``, which the host asks after each round whether to end the rounds there."""
        if num_rounds <= 1:
            return None
        if at_finish and any(r.stop_token_ids or r.max_num_tokens for r in requests):
            width = max(1, max(len(r.stop_token_ids) for r in requests))
            stops = [list(r.stop_token_ids) + [-1] * (width - len(r.stop_token_ids)) for r in requests]
            # Tokens each may still emit: at its limit it finishes (the scheduler's LENGTH).
            budget = [r.max_num_tokens - len(r.token_ids) if r.max_num_tokens else NO_LIMIT for r in requests]
        elif end_requested is not None:  # nothing finishes a request early: paced for end_requested alone
            stops, budget = [[-1]] * len(requests), [NO_LIMIT] * len(requests)
        else:
            return None
        return cls(to_device(stops, torch.int64, device), to_device(budget, torch.int64, device), num_rounds,
                   end_requested)

    def asked_to_end(self, last: int) -> bool:
        """Whether the scheduler asked to end the rounds, which then end with round ``last`` (the host calls it
        after ``after_round``, when that said go on). False past the planned rounds or when nobody can ask."""
        if self.end_requested is None or last + 1 >= len(self.flags) or not self.end_requested():
            return False
        self.rounds_run, self.ended_on_request = last + 1, True
        return True

    def after_round(self, rnd: int, tokens: torch.Tensor, accepted: torch.Tensor) -> bool:
        """Count round ``rnd``'s output (``tokens`` [R, B, 1 + k] and ``accepted`` [R, B], every round's) and say
        whether to queue no more rounds: every request had finished by round ``rnd - LOOKBEHIND`` (on a GPU)
        or by round ``rnd`` (on the CPU, which runs each round before the host goes on). After the last planned
        round there is nothing to decide."""
        if rnd + 1 >= len(self.flags):
            return False
        if self.on_gpu:
            from executor_svc.speculative.rounds_triton import round_finished

            round_finished(tokens, accepted, rnd, self.stops, self.budget, self.emitted, self.finished)
            self.flags[rnd].copy_(self.finished, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self.events.append(event)
            seen = rnd - LOOKBEHIND
            if seen < 0:
                return False
            self.events[seen].synchronize()  # round rnd is still queued behind it: the device keeps busy
        else:
            round_finished_reference(tokens[rnd], accepted[rnd], self.stops, self.budget, self.emitted, self.finished)
            self.flags[rnd].copy_(self.finished)
            seen = rnd
        if bool(self.flags[seen].all()):
            self.rounds_run = rnd + 1
            return True
        return False
