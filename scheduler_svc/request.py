"""A request as the scheduler sees it, and the parameters a client gave it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvcache.block_hash import BlockHashes
from kvcache.eviction_queue import KvCacheRetention
from kvcache.reuse_stats import NotReusedTokens
from protos.plan import SamplingConfig
from scheduler_svc.speculation import Acceptance


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    EOS = "eos"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(slots=True)
class StoppingParams:
    max_tokens: int
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False


@dataclass(slots=True)
class Request:
    """One generation request.

    The scheduler's single rule: a request holds ``num_tokens`` tokens (prompt
    plus output) of which ``num_computed_tokens`` are in the KV cache; each step
    it may be given up to ``num_tokens - num_computed_tokens`` new tokens to
    compute. Prefill, chunked context and decode are all that one rule.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingConfig
    stopping: StoppingParams
    eos_token_ids: frozenset[int]
    arrival_time: float
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str = ""
    sent_to_executor: bool = False  # False until its NewRequest has been planned (again, after a preemption)
    priority: int = 0  # higher is admitted first; lower is preempted first
    cache_salt: str = ""  # prefix-cache isolation: blocks are shared only under the same salt
    retention: KvCacheRetention | None = None  # keep the blocks of a prefix cached longer
    block_hashes: BlockHashes | None = None  # chained hashes of its full blocks (set by the scheduler)
    not_reused: NotReusedTokens | None = None  # why prompt tokens were computed (set at first admission)
    num_preemptions: int = 0
    # Tokens that steps already sent to the executor will sample for it. With overlapped
    # scheduling the next step is planned before the last result is back; the executor
    # feeds those tokens in itself, so they count as held tokens when planning.
    num_pending_outputs: int = 0
    # Speculative decoding: drafts the executor proposed for the next step, how many the step
    # in flight verifies, the request's acceptance rate, and its usage counts.
    draft_token_ids: list[int] = field(default_factory=list)
    num_scheduled_drafts: int = 0  # tokens the step in flight computes past the last one (drafts, or chained rounds)
    num_scheduled_rounds: int = 1  # verification rounds of the step in flight
    acceptance: Acceptance = field(default_factory=Acceptance)
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    has_first_token: bool = False  # its first output token has been delivered (time to first token measured)
    # Leading full blocks of its current block table already offered to the prefix cache (as the
    # KV cache last reported it): until more blocks are full and computed, there is nothing to offer.
    num_registered_blocks: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def max_total_tokens(self) -> int:
        """Tokens the request can ever hold: what admission reserves blocks for."""
        return self.num_prompt_tokens + self.stopping.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def can_speculate(self) -> bool:
        """Penalties and min_tokens depend on every token before the one sampled: no drafts for those."""
        s = self.sampling
        return (
            s.repetition_penalty == 1.0 and s.presence_penalty == 0.0 and s.frequency_penalty == 0.0
            and not (s.min_tokens > 0 and s.min_tokens_blocked_ids)
        )

    @property
    def finishing_token_ids(self) -> list[int]:
        """Ids that ``check_token_stop`` stops at for any token from the next on (none while min_tokens defers them)."""
        stopping = self.stopping
        if len(self.output_token_ids) + 1 < stopping.min_tokens:
            return []
        ids = set(stopping.stop_token_ids)
        if not stopping.ignore_eos:
            ids |= self.eos_token_ids
        return sorted(ids)

    def check_token_stop(self, token: int) -> FinishReason | None:
        """Stop conditions decided by token ids alone (stop strings need text)."""
        num_output = len(self.output_token_ids)
        stopping = self.stopping
        if num_output >= stopping.min_tokens:
            if token in stopping.stop_token_ids:
                return FinishReason.STOP
            if not stopping.ignore_eos and token in self.eos_token_ids:
                return FinishReason.EOS
        if num_output >= stopping.max_tokens:
            return FinishReason.LENGTH
        return None
