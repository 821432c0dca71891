"""Protobuf <-> dataclass conversion for the scheduler: the only module here
that touches generated protobuf classes."""

from __future__ import annotations

from protos import executor_pb2 as ex
from protos import generation_pb2 as pb
from protos.columns import split, write_lists
from kvcache.eviction_queue import KvCacheRetention
from kvcache.reuse_stats import NotReusedTokens
from protos.plan import ExecutorInfo, RequestOutput, SamplingConfig, StepPlan, StepResult
from scheduler_svc.api_types import ChatMessage, EngineStats, GenerationChunk, GenerationRequest, ModelDescription
from scheduler_svc.request import FinishReason

_FINISH_TO_PB = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}

# -- public API ---------------------------------------------------------------


def _chat_from_pb(chat: pb.ChatInput) -> tuple[list[ChatMessage], bool]:
    messages = [ChatMessage(role=m.role, content=m.content) for m in chat.messages]
    add_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    return messages, add_prompt


def generation_request_from_pb(msg: pb.GenerateRequest) -> GenerationRequest:
    req = GenerationRequest(request_id=msg.request_id)
    form = msg.WhichOneof("input")
    if form == "text":
        req.text = msg.text
    elif form == "token_ids":
        req.token_ids = list(msg.token_ids.ids)
    elif form == "chat":
        req.chat, req.add_generation_prompt = _chat_from_pb(msg.chat)
    s = msg.sampling
    req.temperature = s.temperature if s.HasField("temperature") else None
    req.top_k = s.top_k
    req.top_p = s.top_p if s.HasField("top_p") else None
    req.min_p = s.min_p
    req.repetition_penalty = s.repetition_penalty if s.HasField("repetition_penalty") else None
    req.presence_penalty = s.presence_penalty
    req.frequency_penalty = s.frequency_penalty
    req.seed = s.seed if s.HasField("seed") else None
    t = msg.stopping
    req.max_tokens = t.max_tokens if t.HasField("max_tokens") else None
    req.min_tokens = t.min_tokens
    req.stop = list(t.stop)
    req.stop_token_ids = list(t.stop_token_ids)
    req.ignore_eos = t.ignore_eos
    req.priority = msg.priority
    req.cache_salt = msg.cache_salt
    req.final_only = msg.final_only
    if msg.HasField("kv_cache_retention"):
        r = msg.kv_cache_retention
        req.kv_cache_retention = KvCacheRetention(num_prefix_tokens=r.num_prefix_tokens, priority=r.priority)
    return req


def tokenize_input_from_pb(msg: pb.TokenizeRequest) -> GenerationRequest:
    form = msg.WhichOneof("input")
    if form == "text":
        return GenerationRequest(text=msg.text)
    if form == "chat":
        messages, add_prompt = _chat_from_pb(msg.chat)
        return GenerationRequest(chat=messages, add_generation_prompt=add_prompt)
    return GenerationRequest()


def chunk_to_pb(chunk: GenerationChunk) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(
        request_id=chunk.request_id, token_ids=chunk.token_ids, text=chunk.text,
        finish_reason=_FINISH_TO_PB[chunk.finish_reason], error=chunk.error,
    )
    if chunk.usage is not None:
        msg.usage.prompt_tokens = chunk.usage.prompt_tokens
        msg.usage.completion_tokens = chunk.usage.completion_tokens
        msg.usage.cached_tokens = chunk.usage.cached_tokens
        msg.usage.num_preemptions = chunk.usage.num_preemptions
        msg.usage.num_draft_tokens = chunk.usage.num_draft_tokens
        msg.usage.num_accepted_draft_tokens = chunk.usage.num_accepted_draft_tokens
        if chunk.usage.not_reused is not None:
            msg.usage.not_reused.CopyFrom(_not_reused_to_pb(chunk.usage.not_reused))
    return msg


def _not_reused_to_pb(n: NotReusedTokens) -> pb.NotReusedTokens:
    return pb.NotReusedTokens(
        prefix_shorter_than_block=n.prefix_shorter_than_block, evicted=n.evicted, salt_differs=n.salt_differs,
        partial_last_block=n.partial_last_block, not_cached=n.not_cached, caching_disabled=n.caching_disabled,
    )


def stats_to_pb(stats: EngineStats) -> pb.StatsResponse:
    msg = pb.StatsResponse(
        num_running_requests=stats.num_running_requests, num_waiting_requests=stats.num_waiting_requests,
        num_steps=stats.num_steps, executor_ready=stats.executor_ready, num_preemptions=stats.num_preemptions,
    )
    if stats.drafts is not None:
        d = stats.drafts
        msg.num_draft_tokens, msg.num_accepted_draft_tokens = d.num_draft_tokens, d.num_accepted
        msg.draft_tokens_by_position.extend(d.by_position)
        msg.accepted_draft_tokens_by_position.extend(d.accepted_by_position)
    kv = stats.kv
    if kv is not None:
        msg.num_free_kv_blocks, msg.num_kv_blocks, msg.num_cached_kv_blocks = kv.num_free_blocks, kv.num_blocks, kv.num_cached_free_blocks
        msg.prefix_cache_query_tokens, msg.prefix_cache_hit_tokens = kv.query_tokens, kv.hit_tokens
        msg.not_reused.CopyFrom(_not_reused_to_pb(kv.not_reused))
        msg.num_host_blocks, msg.num_cached_host_blocks = kv.num_host_blocks, kv.num_cached_host_blocks
        msg.num_evicted_blocks = kv.num_evicted_blocks
        msg.num_swapped_out_blocks, msg.num_swapped_in_blocks = kv.num_swapped_out_blocks, kv.num_swapped_in_blocks
    return msg


def model_info_to_pb(info: ModelDescription) -> pb.ModelInfoResponse:
    return pb.ModelInfoResponse(
        model=info.model, vocab_size=info.vocab_size, max_seq_len=info.max_seq_len,
        max_batch_size=info.max_batch_size, max_num_tokens=info.max_num_tokens,
        tokens_per_block=info.tokens_per_block, num_kv_blocks=info.num_kv_blocks,
        eos_token_ids=info.eos_token_ids, has_chat_template=info.has_chat_template, device=info.device,
        capacity_policy=info.capacity_policy, prefix_caching=info.prefix_caching, num_host_blocks=info.num_host_blocks,
    )


# -- executor protocol --------------------------------------------------------


def _sampling_to_pb(s: SamplingConfig) -> ex.SamplingConfig:
    return ex.SamplingConfig(
        temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
        repetition_penalty=s.repetition_penalty, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty, seed=s.seed,
        min_tokens_blocked_ids=s.min_tokens_blocked_ids, min_tokens=s.min_tokens,
    )


def plan_to_pb(plan: StepPlan) -> ex.StepPlan:
    msg = ex.StepPlan(
        step_id=plan.step_id, finished_request_ids=plan.finished_request_ids,
        swap_out=[ex.BlockCopy(device_block=c.device_block, host_slot=c.host_slot) for c in plan.swap_out],
        swap_in=[ex.BlockCopy(device_block=c.device_block, host_slot=c.host_slot) for c in plan.swap_in],
    )
    for r in plan.new_requests:
        msg.new_requests.append(
            ex.NewRequest(
                request_id=r.request_id, token_ids=r.token_ids, num_prompt_tokens=r.num_prompt_tokens,
                num_computed_tokens=r.num_computed_tokens, num_scheduled_tokens=r.num_scheduled_tokens,
                block_ids=r.block_ids, sampling=_sampling_to_pb(r.sampling),
                num_drafts_to_propose=r.num_drafts_to_propose,
                stop_token_ids=r.stop_token_ids, max_num_tokens=r.max_num_tokens,
            )
        )
    cached = plan.cached_requests
    if cached:
        columns = msg.cached_requests
        columns.request_ids.extend([c.request_id for c in cached])
        columns.num_computed_tokens.extend([c.num_computed_tokens for c in cached])
        columns.num_scheduled_tokens.extend([c.num_scheduled_tokens for c in cached])
        write_lists(columns.new_block_counts, columns.new_block_ids, [c.new_block_ids for c in cached])
        write_lists(columns.draft_counts, columns.draft_token_ids, [c.draft_token_ids for c in cached])
        columns.num_drafts_to_propose.extend([c.num_drafts_to_propose for c in cached])
        if any(c.num_rounds != 1 for c in cached):  # else the column stays empty: one round each
            columns.num_rounds.extend([c.num_rounds for c in cached])
    return msg


def result_from_pb(msg: ex.StepResult) -> StepResult:
    """Raises ValueError when the output columns disagree in length (a malformed result)."""
    columns = msg.outputs
    ids = list(columns.request_ids)
    accepted = list(columns.num_accepted_drafts)
    token_counts, draft_counts = list(columns.token_counts), list(columns.next_draft_counts)
    if not len(token_counts) == len(draft_counts) == len(accepted) == len(ids):
        raise ValueError(
            f"result {msg.step_id}: output columns of {len(ids)} ids, {len(token_counts)} token counts, "
            f"{len(draft_counts)} draft counts and {len(accepted)} accepted counts"
        )
    round_counts = list(columns.round_counts)
    if round_counts and len(round_counts) != len(ids):
        raise ValueError(f"result {msg.step_id}: output columns of {len(ids)} ids and {len(round_counts)} round counts")
    tokens = split(columns.token_ids, token_counts)
    drafts = split(columns.next_draft_token_ids, draft_counts)
    rounds = split(columns.round_accepted, round_counts) if round_counts else [[] for _ in ids]
    drafted = split(columns.round_drafted, round_counts) if round_counts else [[] for _ in ids]
    return StepResult(
        step_id=msg.step_id,
        outputs=[RequestOutput(*output) for output in zip(ids, tokens, drafts, accepted, rounds, drafted)],
        forward_us=msg.forward_us, sample_us=msg.sample_us, step_us=msg.step_us, draft_us=msg.draft_us,
        request_errors=dict(msg.request_errors),
    )


def info_from_pb(msg: ex.InfoResponse) -> ExecutorInfo:
    return ExecutorInfo(
        model=msg.model, vocab_size=msg.vocab_size, num_kv_blocks=msg.num_kv_blocks,
        tokens_per_block=msg.tokens_per_block, max_batch_size=msg.max_batch_size,
        max_num_tokens=msg.max_num_tokens, max_seq_len=msg.max_seq_len, device=msg.device, dtype=msg.dtype,
        num_host_blocks=msg.num_host_blocks, speculative_mode=msg.speculative_mode,
        max_draft_tokens=msg.max_draft_tokens, drafts_need_lookahead_slots=msg.drafts_need_lookahead_slots,
        max_speculative_rounds=max(1, msg.max_speculative_rounds), draft_tree_rows=tuple(msg.draft_tree_rows),
    )
