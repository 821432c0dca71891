"""The executor protocol's protobuf conversions: plans and results survive the wire unchanged,
cached requests and outputs travel as columns, and malformed columns are refused."""

from __future__ import annotations

import pytest

from executor_svc.wire import plan_from_pb, result_to_pb
from protos import executor_pb2 as ex
from protos.columns import flatten, split
from protos.plan import BlockCopy, CachedRequest, NewRequest, RequestOutput, SamplingConfig, StepPlan, StepResult
from scheduler_svc.wire import plan_to_pb, result_from_pb


def _over_the_wire_plan(plan: StepPlan) -> StepPlan:
    return plan_from_pb(ex.StepPlan.FromString(plan_to_pb(plan).SerializeToString()))


def _over_the_wire_result(result: StepResult) -> StepResult:
    return result_from_pb(ex.StepResult.FromString(result_to_pb(result).SerializeToString()))


def test_a_plan_survives_the_wire():
    plan = StepPlan(
        step_id=41,
        new_requests=[
            NewRequest("n", [5, 6, 7], 3, 0, 3, [9], SamplingConfig(temperature=0.5, seed=3), 2,
                       stop_token_ids=[2, 7], max_num_tokens=259),
        ],
        cached_requests=[
            CachedRequest("a", 300, 1),  # the common generation step: nothing new
            CachedRequest("b", 31, 1, new_block_ids=[12]),
            CachedRequest("c", 77, 4, draft_token_ids=[1, 2, 3], num_drafts_to_propose=4),
            CachedRequest("d", 8, 3, new_block_ids=[13, 14]),  # a context chunk over two new blocks
        ],
        finished_request_ids=["x", "y"],
        swap_out=[BlockCopy(3, 0)], swap_in=[BlockCopy(4, 1)],
    )
    assert _over_the_wire_plan(plan) == plan
    assert _over_the_wire_plan(StepPlan(step_id=1)) == StepPlan(step_id=1)
    chained = StepPlan(step_id=42, cached_requests=[
        CachedRequest("a", 30, 12, draft_token_ids=[1, 2], num_rounds=3), CachedRequest("b", 9, 12, num_rounds=3),
    ])
    assert _over_the_wire_plan(chained) == chained
    assert not plan_to_pb(plan).cached_requests.num_rounds  # one round each: the column stays empty


def test_a_result_survives_the_wire():
    result = StepResult(
        step_id=41,
        outputs=[
            RequestOutput("a", [100]),
            RequestOutput("c", [1, 2, 9], next_draft_token_ids=[4, 5], num_accepted_drafts=2),
            RequestOutput("d", []),  # a context chunk that samples nothing yet
        ],
        forward_us=5, sample_us=6, step_us=20, draft_us=3, request_errors={"z": "cannot compute tokens"},
    )
    assert _over_the_wire_result(result) == result
    assert _over_the_wire_result(StepResult(step_id=2)) == StepResult(step_id=2)
    chained = StepResult(step_id=43, outputs=[
        RequestOutput("a", [1, 2, 3, 4, 5], num_accepted_drafts=3, round_accepted=[2, 1, 0], round_drafted=[2, 2, 1]),
        RequestOutput("b", [6, 7, 8], num_accepted_drafts=0, round_accepted=[0, 0, 0], round_drafted=[0, 2, 0]),
    ])
    assert _over_the_wire_result(chained) == chained


def test_cached_requests_travel_as_columns():
    plan = StepPlan(step_id=3, cached_requests=[CachedRequest(f"r{i}", 10 + i, 1) for i in range(3)])
    columns = plan_to_pb(plan).cached_requests
    assert list(columns.request_ids) == ["r0", "r1", "r2"] and list(columns.num_computed_tokens) == [10, 11, 12]
    assert list(columns.new_block_counts) == [0, 0, 0] and not columns.new_block_ids


def test_malformed_columns_are_refused():
    msg = plan_to_pb(StepPlan(step_id=5, cached_requests=[CachedRequest("a", 1, 1), CachedRequest("b", 2, 1)]))
    del msg.cached_requests.num_scheduled_tokens[1]
    with pytest.raises(ValueError, match="plan 5: cached-request columns"):
        plan_from_pb(msg)
    msg = plan_to_pb(StepPlan(step_id=6, cached_requests=[CachedRequest("a", 1, 1, new_block_ids=[7])]))
    msg.cached_requests.new_block_ids.append(8)  # one block nobody counted
    with pytest.raises(ValueError, match="counts add up to 1 values, but the column holds 2"):
        plan_from_pb(msg)
    reply = result_to_pb(StepResult(step_id=7, outputs=[RequestOutput("a", [1]), RequestOutput("b", [2])]))
    reply.outputs.token_counts[0] = 2  # "a" would take "b"'s token
    with pytest.raises(ValueError, match="counts add up to 3 values"):
        result_from_pb(reply)
    msg = plan_to_pb(StepPlan(step_id=8, cached_requests=[CachedRequest("a", 1, 4, num_rounds=2), CachedRequest("b", 2, 4, num_rounds=2)]))
    del msg.cached_requests.num_rounds[1]
    with pytest.raises(ValueError, match="round counts"):
        plan_from_pb(msg)


def test_flatten_and_split_are_inverse():
    lists = [[], [1, 2], [], [3], [4, 5, 6]]
    counts, flat = flatten(lists)
    assert counts == [0, 2, 0, 1, 3] and flat == [1, 2, 3, 4, 5, 6]
    assert split(flat, counts) == lists
    assert split([], [0, 0]) == [[], []] and split([], []) == []
    with pytest.raises(ValueError):
        split([], [1])
