"""The public API's messages as plain dataclasses (converted in ``wire.py``).

The gRPC service and the in-process LLM API both speak these, so both go
through the same validation and the same engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcache.eviction_queue import KvCacheRetention
from kvcache.reuse_stats import KVCacheStats, NotReusedTokens
from scheduler_svc.request import FinishReason
from scheduler_svc.speculation import DraftStats


@dataclass(slots=True)
class ChatMessage:
    role: str
    content: str


@dataclass(slots=True)
class GenerationRequest:
    """A client's request before validation. Exactly one input form is set."""

    request_id: str = ""
    text: str | None = None
    token_ids: list[int] | None = None
    chat: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    # Sampling (None = default).
    temperature: float | None = None
    top_k: int = 0
    top_p: float | None = None
    min_p: float = 0.0
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    # Stopping.
    max_tokens: int | None = None
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Scheduling and the prefix cache.
    priority: int = 0  # higher first; in [-100, 100]
    cache_salt: str = ""  # blocks are reused only between requests with the same salt
    kv_cache_retention: KvCacheRetention | None = None
    final_only: bool = False  # one chunk, when the request finishes, instead of one per step


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    not_reused: NotReusedTokens | None = None  # why the other prompt tokens were computed
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # speculative decoding: drafts verified for the request
    num_accepted_draft_tokens: int = 0  # and accepted


@dataclass(slots=True)
class GenerationChunk:
    """One streamed piece of a completion; the last one has finish_reason set."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: str = ""


@dataclass(slots=True)
class ModelDescription:
    model: str
    vocab_size: int
    max_seq_len: int
    max_batch_size: int
    max_num_tokens: int
    tokens_per_block: int
    num_kv_blocks: int
    eos_token_ids: list[int]
    has_chat_template: bool
    device: str
    capacity_policy: str = "GUARANTEED_NO_EVICT"
    prefix_caching: bool = True
    num_host_blocks: int = 0


@dataclass(slots=True)
class EngineStats:
    """Live load and cache figures (the Stats call)."""

    num_running_requests: int
    num_waiting_requests: int
    num_steps: int
    executor_ready: bool
    num_preemptions: int = 0
    kv: KVCacheStats | None = None  # None before an executor is attached
    drafts: DraftStats | None = None  # speculative decoding counts (None before an executor is attached)
