"""GPU busy/idle accounting per step (the numbers are filled in by hand: no GPU needed)."""

from __future__ import annotations

import pytest
import torch

from executor_svc.step_timeline import StepTimeline, StepTiming


def _timeline(*steps: tuple[int, int, float, float]) -> StepTimeline:
    timeline = StepTimeline(torch.device("cpu"))
    timeline.steps.extend(StepTiming(*step) for step in steps)
    return timeline


def test_idle_time_is_split_between_plain_decode_steps_and_the_others():
    # a prompt step, two full decode steps, a step verifying drafts, a tail decode step
    timeline = _timeline((64, 8192, 100_000, 0), (1024, 1024, 20_000, 200), (1024, 1024, 20_000, 0),
                         (4, 20, 2_000, 1_000), (3, 3, 1_000, 3_000))
    kinds = timeline.by_kind()
    assert kinds["one_token_per_request"]["steps"] == 3 and kinds["more_tokens"]["steps"] == 2
    assert kinds["one_token_per_request"]["idle_ms"] == pytest.approx(3.2)
    assert kinds["more_tokens"]["busy_ms"] == pytest.approx(102.0)
    assert timeline.summary(min_requests=1024)["idle_fraction"] == pytest.approx(200 / 40_200)
    assert timeline.trace()[3] == [4, 20, 2000, 1000]


def test_no_steps_give_no_fractions():
    assert _timeline().summary() == {"steps": 0, "busy_ms": 0.0, "idle_ms": 0.0, "idle_fraction": None,
                                     "mean_step_ms": None}
