"""GPU busy/idle accounting per step (the numbers are filled in by hand, but for the last test, which needs a GPU)."""

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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events need a GPU")
def test_a_step_is_timed_once_the_host_has_its_results_although_its_end_mark_comes_later():
    """A step's end mark is recorded after the event the host waits on (a copy or two follow its results);
    timing it right after that wait must wait for the mark, not raise on an event still pending."""
    device = torch.device("cuda")
    timeline = StepTimeline(device)
    start = timeline.mark()
    done = torch.cuda.Event()
    done.record()
    x = torch.randn(4096, 4096, device=device)
    for _ in range(20):  # work queued between the results and the end mark
        x = x @ x / 64
    end = timeline.mark()
    done.synchronize()
    timing = timeline.collect(start, end, 1, 1)
    assert timing.busy_us > 0 and end.query()
