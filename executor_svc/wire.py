"""Protobuf <-> dataclass conversion for the executor: the only module here
that touches generated protobuf classes."""

from __future__ import annotations

from protos import executor_pb2 as ex
from protos.columns import split, write_lists
from protos.plan import BlockCopy, CachedRequest, ExecutorInfo, NewRequest, SamplingConfig, StepPlan, StepResult


def _sampling_from_pb(s: ex.SamplingConfig) -> SamplingConfig:
    return SamplingConfig(
        temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
        repetition_penalty=s.repetition_penalty, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty, seed=s.seed,
        min_tokens_blocked_ids=list(s.min_tokens_blocked_ids), min_tokens=s.min_tokens,
    )


def plan_from_pb(msg: ex.StepPlan) -> StepPlan:
    """Raises ValueError when the cached-request columns disagree in length (a malformed plan)."""
    return StepPlan(
        step_id=msg.step_id,
        new_requests=[
            NewRequest(
                request_id=r.request_id, token_ids=list(r.token_ids), num_prompt_tokens=r.num_prompt_tokens,
                num_computed_tokens=r.num_computed_tokens, num_scheduled_tokens=r.num_scheduled_tokens,
                block_ids=list(r.block_ids), sampling=_sampling_from_pb(r.sampling),
                num_drafts_to_propose=r.num_drafts_to_propose,
                stop_token_ids=list(r.stop_token_ids), max_num_tokens=r.max_num_tokens,
            )
            for r in msg.new_requests
        ],
        cached_requests=_cached_from_pb(msg.step_id, msg.cached_requests),
        finished_request_ids=list(msg.finished_request_ids),
        swap_out=[BlockCopy(c.device_block, c.host_slot) for c in msg.swap_out],
        swap_in=[BlockCopy(c.device_block, c.host_slot) for c in msg.swap_in],
    )


def _cached_from_pb(step_id: int, columns: ex.CachedRequests) -> list[CachedRequest]:
    ids = list(columns.request_ids)
    computed, scheduled = list(columns.num_computed_tokens), list(columns.num_scheduled_tokens)
    block_counts, draft_counts = list(columns.new_block_counts), list(columns.draft_counts)
    propose = list(columns.num_drafts_to_propose)
    if not len(computed) == len(scheduled) == len(block_counts) == len(draft_counts) == len(propose) == len(ids):
        raise ValueError(
            f"plan {step_id}: cached-request columns of {len(ids)} ids, {len(computed)} computed, "
            f"{len(scheduled)} scheduled, {len(block_counts)} block counts, {len(draft_counts)} draft counts and "
            f"{len(propose)} proposal counts"
        )
    rounds = list(columns.num_rounds) or [1] * len(ids)
    if len(rounds) != len(ids):
        raise ValueError(f"plan {step_id}: cached-request columns of {len(ids)} ids and {len(rounds)} round counts")
    blocks = split(columns.new_block_ids, block_counts)
    drafts = split(columns.draft_token_ids, draft_counts)
    return [CachedRequest(*request) for request in zip(ids, computed, scheduled, blocks, drafts, propose, rounds)]


def result_to_pb(result: StepResult) -> ex.StepResult:
    msg = ex.StepResult(
        step_id=result.step_id, forward_us=result.forward_us, sample_us=result.sample_us, step_us=result.step_us,
        draft_us=result.draft_us,
    )
    outputs = result.outputs
    if outputs:
        columns = msg.outputs
        columns.request_ids.extend([o.request_id for o in outputs])
        write_lists(columns.token_counts, columns.token_ids, [o.token_ids for o in outputs])
        write_lists(columns.next_draft_counts, columns.next_draft_token_ids, [o.next_draft_token_ids for o in outputs])
        columns.num_accepted_drafts.extend([o.num_accepted_drafts for o in outputs])
        if any(o.round_accepted for o in outputs):  # else both columns stay empty: one round each
            write_lists(columns.round_counts, columns.round_accepted, [o.round_accepted for o in outputs])
            columns.round_drafted.extend([d for o in outputs for d in o.round_drafted])
    msg.request_errors.update(result.request_errors)
    return msg


def info_to_pb(info: ExecutorInfo) -> ex.InfoResponse:
    return ex.InfoResponse(
        model=info.model, vocab_size=info.vocab_size, num_kv_blocks=info.num_kv_blocks,
        tokens_per_block=info.tokens_per_block, max_batch_size=info.max_batch_size,
        max_num_tokens=info.max_num_tokens, max_seq_len=info.max_seq_len, device=info.device, dtype=info.dtype,
        num_host_blocks=info.num_host_blocks, speculative_mode=info.speculative_mode,
        max_draft_tokens=info.max_draft_tokens, drafts_need_lookahead_slots=info.drafts_need_lookahead_slots,
        max_speculative_rounds=info.max_speculative_rounds, draft_tree_rows=list(info.draft_tree_rows),
    )
