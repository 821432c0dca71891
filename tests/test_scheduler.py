"""Inflight batching rules, driven with a fake executor result."""

from protos.plan import RequestOutput, SamplingConfig, StepResult
from scheduler_svc.request import FinishReason, Request, StoppingParams
from scheduler_svc.scheduler import Scheduler, SchedulerConfig


def make_request(rid: str, prompt_len: int, max_tokens: int = 8) -> Request:
    return Request(
        request_id=rid, prompt_token_ids=list(range(1, prompt_len + 1)), sampling=SamplingConfig(temperature=0.0),
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
    s.add_request(make_request("b", 20, max_tokens=8))  # 28 tokens -> 2 blocks: must wait
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
