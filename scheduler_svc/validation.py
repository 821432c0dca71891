"""Check a client's request and turn it into a scheduler Request.

Every check names the field at fault, so the gRPC layer can answer
INVALID_ARGUMENT with a message a client can act on. Nothing here touches
scheduler state: a bad request is rejected before it can disturb others.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

from kvcache.eviction_queue import MAX_RETENTION_PRIORITY, MIN_RETENTION_PRIORITY
from protos.plan import SamplingConfig
from scheduler_svc.api_types import GenerationRequest
from scheduler_svc.request import Request, StoppingParams
from scheduler_svc.tokenizer import ChatTemplateError, Tokenizer

_ROLES = ("system", "user", "assistant", "tool")
_MAX_STOP_STRINGS = 16
_MAX_STOP_LEN = 256
_MAX_PRIORITY = 100
_MAX_SALT_LEN = 256


class InvalidRequest(ValueError):
    """A request field is out of range; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True, slots=True)
class Limits:
    vocab_size: int
    max_seq_len: int


def prompt_token_ids(req: GenerationRequest, tokenizer: Tokenizer, limits: Limits) -> list[int]:
    """The prompt as token ids, from whichever input form the request used."""
    forms = [f for f, v in (("text", req.text), ("token_ids", req.token_ids), ("chat", req.chat)) if v is not None]
    if len(forms) != 1:
        raise InvalidRequest("input", "set exactly one of text, token_ids or chat")
    if req.text is not None:
        if not req.text:
            raise InvalidRequest("text", "prompt is empty")
        ids = tokenizer.encode(req.text)
    elif req.token_ids is not None:
        ids = list(req.token_ids)
        bad = [t for t in ids if not 0 <= t < limits.vocab_size]
        if bad:
            raise InvalidRequest("token_ids", f"ids {bad[:5]} are outside the vocabulary [0, {limits.vocab_size})")
    else:
        assert req.chat is not None
        if not req.chat:
            raise InvalidRequest("chat.messages", "at least one message is required")
        for i, message in enumerate(req.chat):
            if message.role not in _ROLES:
                raise InvalidRequest(f"chat.messages[{i}].role", f"{message.role!r} is not one of {', '.join(_ROLES)}")
            if not message.content and message.role != "assistant":
                raise InvalidRequest(f"chat.messages[{i}].content", "content is empty")
        try:
            ids = tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in req.chat], req.add_generation_prompt
            )
        except ChatTemplateError as exc:
            raise InvalidRequest("chat", str(exc)) from exc
    if not ids:
        raise InvalidRequest(forms[0], "prompt is empty")
    return ids


def build_request(req: GenerationRequest, tokenizer: Tokenizer, limits: Limits) -> Request:
    """Validate every field and build the scheduler's Request."""
    ids = prompt_token_ids(req, tokenizer, limits)
    if len(ids) >= limits.max_seq_len:
        raise InvalidRequest("input", f"prompt has {len(ids)} tokens; max_seq_len is {limits.max_seq_len}")

    temperature = 1.0 if req.temperature is None else req.temperature
    _check(temperature >= 0, "sampling.temperature", f"must be >= 0, got {temperature}")
    top_p = 1.0 if req.top_p is None else req.top_p
    _check(0 < top_p <= 1, "sampling.top_p", f"must be in (0, 1], got {top_p}")
    _check(req.top_k >= 0, "sampling.top_k", f"must be >= 0, got {req.top_k}")
    _check(0 <= req.min_p <= 1, "sampling.min_p", f"must be in [0, 1], got {req.min_p}")
    repetition = 1.0 if req.repetition_penalty is None else req.repetition_penalty
    _check(repetition > 0, "sampling.repetition_penalty", f"must be > 0, got {repetition}")
    for name, value in (("presence_penalty", req.presence_penalty), ("frequency_penalty", req.frequency_penalty)):
        _check(-2 <= value <= 2, f"sampling.{name}", f"must be in [-2, 2], got {value}")

    room = limits.max_seq_len - len(ids)
    max_tokens = room if req.max_tokens is None else req.max_tokens
    _check(max_tokens >= 1, "stopping.max_tokens", f"must be >= 1, got {max_tokens}")
    _check(
        max_tokens <= room, "stopping.max_tokens",
        f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds max_seq_len ({limits.max_seq_len})",
    )
    _check(0 <= req.min_tokens <= max_tokens, "stopping.min_tokens", f"must be in [0, max_tokens], got {req.min_tokens}")
    _check(len(req.stop) <= _MAX_STOP_STRINGS, "stopping.stop", f"at most {_MAX_STOP_STRINGS} stop strings")
    for i, stop in enumerate(req.stop):
        _check(0 < len(stop) <= _MAX_STOP_LEN, f"stopping.stop[{i}]", f"must have 1..{_MAX_STOP_LEN} characters")
    bad = [t for t in req.stop_token_ids if not 0 <= t < limits.vocab_size]
    _check(not bad, "stopping.stop_token_ids", f"ids {bad[:5]} are outside the vocabulary [0, {limits.vocab_size})")

    _check(-_MAX_PRIORITY <= req.priority <= _MAX_PRIORITY, "priority", f"must be in [-{_MAX_PRIORITY}, {_MAX_PRIORITY}], got {req.priority}")
    _check(len(req.cache_salt) <= _MAX_SALT_LEN, "cache_salt", f"at most {_MAX_SALT_LEN} characters")
    retention = req.kv_cache_retention
    if retention is not None:
        _check(
            MIN_RETENTION_PRIORITY <= retention.priority <= MAX_RETENTION_PRIORITY, "kv_cache_retention.priority",
            f"must be in [{MIN_RETENTION_PRIORITY}, {MAX_RETENTION_PRIORITY}], got {retention.priority}",
        )
        _check(retention.num_prefix_tokens >= 0, "kv_cache_retention.num_prefix_tokens", f"must be >= 0, got {retention.num_prefix_tokens}")

    request_id = req.request_id or secrets.token_hex(8)
    _check(len(request_id) <= 128, "request_id", "at most 128 characters")
    seed = secrets.randbits(63) if req.seed is None else req.seed
    blocked = [] if req.min_tokens == 0 else sorted(set(req.stop_token_ids) | (set() if req.ignore_eos else tokenizer.eos_token_ids))
    return Request(
        request_id=request_id,
        prompt_token_ids=ids,
        sampling=SamplingConfig(
            temperature=temperature, top_k=req.top_k, top_p=top_p, min_p=req.min_p,
            repetition_penalty=repetition, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, seed=seed,
            min_tokens_blocked_ids=blocked, min_tokens=req.min_tokens,
        ),
        stopping=StoppingParams(
            max_tokens=max_tokens, min_tokens=req.min_tokens, stop=list(req.stop),
            stop_token_ids=list(req.stop_token_ids), ignore_eos=req.ignore_eos,
        ),
        eos_token_ids=tokenizer.eos_token_ids,
        arrival_time=time.monotonic(),
        priority=req.priority,
        cache_salt=req.cache_salt,
        retention=retention if retention is not None and retention.num_prefix_tokens > 0 else None,
    )


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise InvalidRequest(field, message)
