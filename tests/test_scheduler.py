"""Inflight batching rules, driven with a fake executor result."""

from protos.plan import RequestOutput, SamplingConfig, StepResult
from scheduler_svc.request import FinishReason, Request, StoppingParams
from scheduler_svc.scheduler import Scheduler, SchedulerConfig


def make_request(rid: str, prompt_len: int, max_tokens: int = 8, first_token: int = 1) -> Request:
    return Request(
        request_id=rid, prompt_token_ids=list(range(first_token, first_token + prompt_len)), sampling=SamplingConfig(temperature=0.0),
        stopping=StoppingParams(max_tokens=max_tokens), eos_token_ids=frozenset({0}), arrival_time=0.0,
    )


def make_scheduler(**overrides) -> Scheduler:
    cfg = dict(max_batch_size=8, max_num_tokens=64, tokens_per_block=16, num_kv_blocks=64, max_seq_len=512)
    cfg.update(overrides)
    return Scheduler(SchedulerConfig(**cfg))


def answer(plan, token: int = 5) -> StepResult:
    """A result sampling `token` for every request that reached its last token."""
    outputs = []
    for r in plan.new_requests:
        done = r.num_computed_tokens + r.num_scheduled_tokens == len(r.token_ids)
        outputs.append(RequestOutput(r.request_id, [token] if done else []))
    for c in plan.cached_requests:
        outputs.append(RequestOutput(c.request_id, [token]))  # only decodes here
    return StepResult(plan.step_id, outputs)


def test_long_prompt_is_chunked_in_whole_blocks_except_the_last():
    s = make_scheduler(max_num_tokens=40)
    s.add_request(make_request("a", 100))
    chunks = []
    while True:
        plan = s.schedule()
        entries = plan.new_requests + plan.cached_requests
        chunks.append(entries[0].num_scheduled_tokens)
        updates = s.update(answer(plan) if sum(chunks) >= 100 else StepResult(plan.step_id, []))
        if updates:
            break
    assert chunks == [32, 32, 36]  # the last chunk finishes the prompt and may be any size
    assert all(c % 16 == 0 for c in chunks[:-1])


def test_generation_first_then_context_and_token_budget_respected():
    s = make_scheduler(max_num_tokens=48)
    s.add_request(make_request("a", 10))
    s.update(answer(s.schedule()))  # a is now generating
    s.add_request(make_request("b", 100))
    plan = s.schedule()
    assert [c.request_id for c in plan.cached_requests] == ["a"]
    assert plan.cached_requests[0].num_scheduled_tokens == 1
    assert plan.new_requests[0].request_id == "b"
    assert plan.new_requests[0].num_scheduled_tokens == 32  # 47 left -> 2 whole blocks
    assert plan.num_scheduled_tokens <= 48


def test_guaranteed_no_evict_waits_for_blocks_and_frees_on_finish():
    s = make_scheduler(num_kv_blocks=4, max_num_tokens=512)
    s.add_request(make_request("a", 40, max_tokens=8))  # 48 tokens -> 3 blocks
    s.add_request(make_request("b", 20, max_tokens=8, first_token=1000))  # 28 tokens -> 2 blocks: must wait
    plan = s.schedule()
    assert [r.request_id for r in plan.new_requests] == ["a"]
    assert [r.request_id for r in s.waiting] == ["b"]
    for _ in range(8):
        updates = s.update(answer(plan))
        plan = s.schedule()
    assert updates[0].finish_reason is FinishReason.LENGTH
    assert plan.finished_request_ids == ["a"]
    assert [r.request_id for r in plan.new_requests] == ["b"]


def test_plans_are_diffs_new_blocks_only_once():
    s = make_scheduler(tokens_per_block=4, max_num_tokens=64)
    s.add_request(make_request("a", 6, max_tokens=8))
    plan = s.schedule()
    assert plan.new_requests[0].block_ids and len(plan.new_requests[0].block_ids) == 2
    seen = set(plan.new_requests[0].block_ids)
    for _ in range(6):
        s.update(answer(plan))
        plan = s.schedule()
        for c in plan.cached_requests:
            assert not seen & set(c.new_block_ids)
            seen |= set(c.new_block_ids)
    assert len(seen) == 3  # 6 prompt + 6 outputs computed -> 12 tokens -> 3 blocks


def test_abort_frees_blocks_and_tells_executor():
    s = make_scheduler()
    s.add_request(make_request("a", 30))
    s.schedule()
    s.finish_request("a", FinishReason.CANCELLED)
    assert s.kv.num_free_blocks == 64
    assert s.schedule().finished_request_ids == ["a"]


def test_max_batch_size_caps_running_requests():
    s = make_scheduler(max_batch_size=2)
    for i in range(4):
        s.add_request(make_request(str(i), 5))
    plan = s.schedule()
    assert len(plan.new_requests) == 2 and len(s.waiting) == 2


# -- priorities, prefix hits and preemption ---------------------------------------------

from scheduler_svc.request import RequestStatus  # noqa: E402
from scheduler_svc.scheduler import CapacityPolicy  # noqa: E402

MAX_UTIL = CapacityPolicy.MAX_UTILIZATION


def with_priority(request: Request, priority: int) -> Request:
    request.priority = priority
    return request


def answer_all(plan, token: int = 5) -> StepResult:
    """Like ``answer``, for plans whose NewRequests may be resumed ones (prompt + output)."""
    outputs = [
        RequestOutput(r.request_id, [token] if r.num_computed_tokens + r.num_scheduled_tokens == len(r.token_ids) else [])
        for r in plan.new_requests
    ]
    outputs += [RequestOutput(c.request_id, [token]) for c in plan.cached_requests]
    return StepResult(plan.step_id, outputs)


def run_to_end(s: Scheduler, max_steps: int = 500) -> list:
    plans = []
    for _ in range(max_steps):
        if not s.has_work:
            return plans
        plan = s.schedule()
        plans.append(plan)
        s.update(answer_all(plan))
    raise AssertionError("requests did not finish")


def test_waiting_queue_orders_by_priority_then_arrival():
    s = make_scheduler(max_batch_size=1)
    for rid, priority in [("low", 0), ("high", 5), ("mid", 1), ("high2", 5)]:
        s.add_request(with_priority(make_request(rid, 5, first_token=100 * len(rid) + priority), priority))
    assert [r.request_id for r in s.waiting] == ["high", "high2", "mid", "low"]
    assert [r.request_id for r in s.schedule().new_requests] == ["high"]


def test_prefix_hit_starts_a_request_at_its_cached_prefix():
    s = make_scheduler(tokens_per_block=4)
    s.add_request(make_request("a", 10))
    s.update(answer_all(s.schedule()))  # a's prompt is computed: its 2 full blocks are cached
    s.add_request(make_request("b", 10))
    new = s.schedule().new_requests[0]
    assert new.request_id == "b" and new.num_computed_tokens == 8 and new.num_scheduled_tokens == 2
    assert new.block_ids[:2] == s.kv.block_table("a")[:2]
    assert s.requests["b"].num_cached_tokens == 8


def test_max_utilization_preempts_lowest_priority_then_least_work_and_resumes():
    # 6 blocks of 4 tokens; three requests of 6 + 10 tokens (4 blocks each) cannot all fit.
    s = make_scheduler(tokens_per_block=4, num_kv_blocks=6, capacity_policy=MAX_UTIL)
    s.add_request(with_priority(make_request("a", 6, max_tokens=10, first_token=100), 1))
    s.add_request(make_request("b", 6, max_tokens=10, first_token=200))
    s.add_request(make_request("c", 7, max_tokens=10, first_token=300))  # more work computed than b
    plans = run_to_end(s)
    first_victim = next(rid for p in plans for rid in p.finished_request_ids)
    assert first_victim == "b"  # lowest priority, least computed
    assert s.num_preemptions >= 1
    # b came back as a NewRequest carrying its output so far (from whatever prefix is still cached).
    resumed = [r for p in plans for r in p.new_requests if r.request_id == "b" and r.num_prompt_tokens < len(r.token_ids)]
    assert resumed and resumed[0].token_ids[:6] == list(range(200, 206)) and resumed[0].num_computed_tokens % 4 == 0
    assert s.kv.num_free_blocks == 6 and not s.kv.check_consistency()


def test_guaranteed_no_evict_never_preempts():
    s = make_scheduler(tokens_per_block=4, num_kv_blocks=6)
    for rid, first in (("a", 100), ("b", 200), ("c", 300)):
        s.add_request(make_request(rid, 6, max_tokens=10, first_token=first))
    plans = run_to_end(s)
    assert s.num_preemptions == 0
    assert sorted(r.request_id for p in plans for r in p.new_requests) == ["a", "b", "c"]  # each sent once
    assert s.kv.num_free_blocks == 6


def test_higher_priority_arrival_preempts_only_under_max_utilization():
    for policy in (MAX_UTIL, CapacityPolicy.GUARANTEED_NO_EVICT):
        s = make_scheduler(tokens_per_block=4, num_kv_blocks=4, capacity_policy=policy)
        s.add_request(make_request("low", 8, max_tokens=8, first_token=100))  # 4 blocks over its life
        s.update(answer_all(s.schedule()))
        s.add_request(with_priority(make_request("urgent", 8, max_tokens=4, first_token=200), 10))
        plan = s.schedule()
        if policy is MAX_UTIL:
            assert [r.request_id for r in plan.new_requests] == ["urgent"] and plan.finished_request_ids == ["low"]
            assert s.requests["low"].status is RequestStatus.WAITING and s.waiting.peek().request_id == "low"
        else:
            assert not plan.new_requests and s.waiting.peek().request_id == "urgent"
        s.update(answer_all(plan))
        plans = run_to_end(s)
        if policy is MAX_UTIL:  # low resumes from the part of its prompt that is still cached
            (resumed,) = [r for p in plans for r in p.new_requests if r.request_id == "low"]
            assert resumed.num_computed_tokens == 4 and resumed.token_ids == list(range(100, 108)) + [5]
        assert s.kv.num_free_blocks == 4 and not s.kv.check_consistency()


def test_preempted_then_cancelled_request_leaves_nothing_behind():
    s = make_scheduler(tokens_per_block=4, num_kv_blocks=4, capacity_policy=MAX_UTIL)
    s.add_request(make_request("low", 8, max_tokens=8, first_token=100))
    s.update(answer_all(s.schedule()))
    s.add_request(with_priority(make_request("urgent", 8, max_tokens=4, first_token=200), 10))
    s.update(answer_all(s.schedule()))  # low preempted
    s.finish_request("low", FinishReason.CANCELLED)
    plans = run_to_end(s)
    assert all(r.request_id != "low" for p in plans for r in p.new_requests)
    assert s.kv.num_free_blocks == 4 and not s.kv.check_consistency() and not s.requests


def test_blocks_filled_by_generation_are_cached_once_full_and_again_after_preemption():
    s = make_scheduler(tokens_per_block=4, num_kv_blocks=8, capacity_policy=MAX_UTIL)
    s.add_request(make_request("a", 6, max_tokens=8, first_token=100))
    registered = []
    for _ in range(4):  # prompt, then 3 tokens: 9 tokens held, 8 computed after the 3rd
        s.update(answer_all(s.schedule()))
        registered.append(s.kv._tables["a"].num_registered)
    assert registered == [1, 1, 2, 2]  # the second block registers once its last token is computed
    assert s.requests["a"].num_registered_blocks == 2
    s.add_request(with_priority(make_request("b", 30, max_tokens=2, first_token=300), 5))
    s.update(answer_all(s.schedule()))  # a preempted: b needs all 8 blocks
    assert s.requests["a"].status is RequestStatus.WAITING
    run_to_end(s)
    assert s.kv.num_free_blocks == 8 and not s.kv.check_consistency()


def test_running_order_is_by_priority_then_generation_before_context():
    s = make_scheduler(tokens_per_block=4, max_num_tokens=8)

    def step() -> None:  # a token for each request whose step reaches its last token
        plan = s.schedule()
        outputs = []
        for e in plan.new_requests + plan.cached_requests:
            done = e.num_computed_tokens + e.num_scheduled_tokens == s.requests[e.request_id].num_tokens
            outputs.append(RequestOutput(e.request_id, [5] if done else []))
        s.update(StepResult(plan.step_id, outputs))

    s.add_request(make_request("ctx", 20, first_token=100))  # its context takes several steps of 8 tokens
    s.add_request(make_request("gen", 3, first_token=200))
    s.add_request(with_priority(make_request("vip", 3, first_token=300), 1))
    step()
    step()
    assert [r.request_id for r in s.running] == ["vip", "ctx", "gen"]
    assert [r.request_id for r in s._running_order()] == ["vip", "gen", "ctx"]
    while s.requests["ctx"].num_computed_tokens < s.requests["ctx"].num_tokens - 1:
        step()
    assert [r.request_id for r in s._running_order()] == ["vip", "ctx", "gen"]  # all in generation: as they run
