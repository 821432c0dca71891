"""The scheduler <-> executor contract as plain dataclasses.

These mirror ``executor.proto`` one to one. The scheduler builds them, the
executor consumes them, and either side converts them to and from protobuf in
its own ``wire.py``; the in-process runner used by the offline LLM API passes
them across without any conversion at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingConfig:
    """How the executor samples one request's tokens (validated by the scheduler)."""

    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0  # 1.0 = disabled
    min_p: float = 0.0  # 0 = disabled
    repetition_penalty: float = 1.0  # 1.0 = disabled
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0
    # Ids that may not be sampled while fewer than min_tokens outputs exist.
    min_tokens_blocked_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(slots=True)
class NewRequest:
    """A request the executor has not seen: everything it needs, once."""

    request_id: str
    token_ids: list[int]  # prompt (+ output already produced, when resumed)
    num_prompt_tokens: int
    num_computed_tokens: int  # tokens of token_ids already in the KV cache
    num_scheduled_tokens: int  # tokens to compute this step
    block_ids: list[int]
    sampling: SamplingConfig
    num_drafts_to_propose: int = 0  # for the next step, once this one samples its token
    # Ids that finish the request once emitted (EOS unless ignored, its stop token ids; empty while
    # min_tokens defers them), and the length at which it finishes (0 = not given). The scheduler
    # decides finishes; with these an executor ends chained rounds once every request has finished.
    stop_token_ids: list[int] = field(default_factory=list)
    max_num_tokens: int = 0


@dataclass(slots=True)
class CachedRequest:
    """A request the executor holds: only what changed since the last step."""

    request_id: str
    num_computed_tokens: int
    num_scheduled_tokens: int
    new_block_ids: list[int] = field(default_factory=list)
    # Drafts to verify this step, after the request's last token (num_scheduled_tokens = 1 + len).
    draft_token_ids: list[int] = field(default_factory=list)
    num_drafts_to_propose: int = 0  # for the next step
    # Verification rounds: with R > 1 the executor drafts rounds 2..R itself, on the device, and
    # num_scheduled_tokens = R * (1 + k), k the step's draft length (draft_token_ids padded to it);
    # with tree drafts R * draft_tree_rows[k - 1], of which (R - 1) * (1 + k) + one round need KV slots.
    num_rounds: int = 1


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """One KV block copied between the device cache and the host tier."""

    device_block: int
    host_slot: int


@dataclass(slots=True)
class StepPlan:
    """One step of work. Context (new) requests come before generation ones."""

    step_id: int
    new_requests: list[NewRequest] = field(default_factory=list)
    cached_requests: list[CachedRequest] = field(default_factory=list)
    # Drop executor state of these (finished, cancelled, failed or preempted) before running the step.
    finished_request_ids: list[str] = field(default_factory=list)
    # Host-tier copies, before anything of this step writes the KV cache, in this
    # order: every swap_out (device -> host, in list order), then every swap_in.
    swap_out: list[BlockCopy] = field(default_factory=list)
    swap_in: list[BlockCopy] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(r.num_scheduled_tokens for r in self.new_requests) + sum(
            r.num_scheduled_tokens for r in self.cached_requests
        )

    @property
    def is_empty(self) -> bool:
        """Nothing for the executor to do: no request to run and no block to copy."""
        return not self.new_requests and not self.cached_requests and not self.swap_out and not self.swap_in


@dataclass(slots=True)
class RequestOutput:
    """Tokens one request produced in one step (variable length)."""

    request_id: str
    token_ids: list[int]
    next_draft_token_ids: list[int] = field(default_factory=list)  # proposed for the next step
    num_accepted_drafts: int = 0  # of this step's drafts; token_ids = those + one of the target's
    round_accepted: list[int] = field(default_factory=list)  # per verification round, when several ran
    round_drafted: list[int] = field(default_factory=list)  # real drafts (not padding) per round, likewise


@dataclass(slots=True)
class StepResult:
    """The executor's answer to one StepPlan."""

    step_id: int
    outputs: list[RequestOutput] = field(default_factory=list)
    forward_us: int = 0
    sample_us: int = 0
    step_us: int = 0
    draft_us: int = 0  # proposing drafts for the next step (part of step_us)
    # request_id -> reason, for requests that failed in this step alone.
    request_errors: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class ExecutorInfo:
    """Capacity an executor reports once; the scheduler sizes its pool from it."""

    model: str
    vocab_size: int
    num_kv_blocks: int
    tokens_per_block: int
    max_batch_size: int
    max_num_tokens: int
    max_seq_len: int
    device: str
    dtype: str
    num_host_blocks: int = 0  # slots of the host tier of the KV cache; 0 = none
    speculative_mode: str = ""  # "", "ngram", "draft_model" or "draft_heads"
    max_draft_tokens: int = 0  # most drafts proposed per request per step
    drafts_need_lookahead_slots: bool = False  # proposing k drafts writes KV k - 1 positions ahead
    max_speculative_rounds: int = 1  # verification rounds one step may chain on the device
    draft_tree_rows: tuple[int, ...] = ()  # tree drafts: tokens per request of a chained round of k drafts (k - 1)
