"""The offline Python API, in the shape of TensorRT-LLM's ``LLM``.

    from inflight import LLM, BuildConfig, SamplingParams
    llm = LLM(model="smollm2-135m-instruct", build_config=BuildConfig(max_batch_size=8, max_seq_len=4096))
    llm.save_engine("smol.engine")
    llm = LLM(engine_dir="smol.engine")
    for out in llm.generate(["What is attention?", "Write a poem about autumn"], SamplingParams(max_tokens=64)):
        print(out.text)

It runs the same scheduler and executor code as the server, in one process
and without gRPC: the scheduler's step loop runs on a private event loop in a
background thread, with the executor's model runner plugged in through
``InProcessExecutor``. All prompts given to ``generate`` are batched inflight.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from executor_svc.build_config import BuildConfig
from executor_svc.engine import RuntimeConfig, load_engine
from executor_svc.speculative.proposer import SpeculativeConfig
from inflight.engines import prepare_engine
from inflight.gc_tuning import release_garbage_collector, settle_garbage_collector
from inflight.inprocess import InProcessExecutor
from kvcache.eviction_queue import KvCacheRetention
from kvcache.reuse_stats import NotReusedTokens
from scheduler_svc.api_types import EngineStats, GenerationChunk, GenerationRequest
from scheduler_svc.engine_loop import AsyncEngine, EngineLimits
from scheduler_svc.scheduler import CapacityPolicy
from scheduler_svc.tokenizer import Tokenizer


@dataclass(slots=True)
class SamplingParams:
    """How to sample and when to stop (the same fields as the gRPC API)."""

    max_tokens: int | None = None  # None = up to max_seq_len
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0
    ignore_eos: bool = False


@dataclass(slots=True)
class RequestOutput:
    """One finished completion."""

    prompt: str | list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    error: str = ""
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    not_reused: NotReusedTokens | None = None  # why the other prompt tokens were computed
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # speculative decoding: drafts verified, and accepted
    num_accepted_draft_tokens: int = 0


Prompt = str | list[int]


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """How one request is scheduled and cached (beside how it samples)."""

    priority: int = 0  # higher first, in [-100, 100]
    cache_salt: str = ""  # prefix-cache blocks are shared only under the same salt
    kv_cache_retention: KvCacheRetention | None = None  # keep a prefix's blocks cached longer


def _request(
    prompt: Prompt, params: SamplingParams, options: RequestOptions = RequestOptions(), final_only: bool = False,
) -> GenerationRequest:
    return GenerationRequest(
        text=prompt if isinstance(prompt, str) else None,
        token_ids=None if isinstance(prompt, str) else list(prompt),
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
        repetition_penalty=params.repetition_penalty, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty, seed=params.seed, max_tokens=params.max_tokens,
        min_tokens=params.min_tokens, stop=list(params.stop), stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos, priority=options.priority, cache_salt=options.cache_salt,
        kv_cache_retention=options.kv_cache_retention, final_only=final_only,
    )


class LLM:
    """An engine and a scheduler in this process."""

    def __init__(
        self,
        model: str | None = None,
        *,
        engine_dir: str | Path | None = None,
        build_config: BuildConfig | None = None,
        device: str = "auto",
        load_format: str = "auto",
        kv_cache_gb: float = 0.0,
        max_queue_size: int = 1 << 20,
        capacity_policy: CapacityPolicy | str = CapacityPolicy.GUARANTEED_NO_EVICT,
        enable_prefix_caching: bool = True,
        host_cache_gb: float = 0.0,
        num_kv_blocks: int = 0,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        """``capacity_policy``: GUARANTEED_NO_EVICT or MAX_UTILIZATION; ``host_cache_gb``: host-memory
        tier of the prefix cache; ``num_kv_blocks``: use fewer KV blocks than the memory holds (0 = all);
        ``speculative``: speculative decoding (n-gram lookup, a draft model's engine, or trained draft heads)."""
        if (model is None) == (engine_dir is None):
            raise ValueError("give exactly one of model= or engine_dir=")
        name = str(engine_dir) if engine_dir is not None else str(model)
        self.engine_dir = prepare_engine(name, build_config or BuildConfig(), device, load_format)
        runtime = RuntimeConfig(
            device=device, kv_cache_bytes=int(kv_cache_gb * 2**30), host_cache_bytes=int(host_cache_gb * 2**30),
            speculative=speculative or SpeculativeConfig(),
        )
        self._engine = load_engine(self.engine_dir, runtime)
        self.tokenizer = Tokenizer(self.engine_dir)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="inflight-llm", daemon=True)
        self._thread.start()
        limits = EngineLimits(
            max_queue_size=max_queue_size, num_kv_blocks=num_kv_blocks, enable_prefix_caching=enable_prefix_caching,
            capacity_policy=CapacityPolicy(capacity_policy.upper()) if isinstance(capacity_policy, str) else capacity_policy,
        )
        self._async_engine = AsyncEngine(InProcessExecutor(self._engine), self.tokenizer, limits)
        self._call(self._async_engine.start())
        settle_garbage_collector()

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # -- offline batch -------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | None = None,
        *,
        priority: int | Sequence[int] = 0,
        cache_salt: str = "",
        kv_cache_retention: KvCacheRetention | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt (all batched inflight); outputs in prompt order.

        ``priority`` is one value for all prompts or one per prompt (higher first).
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params or SamplingParams()
        priorities = [priority] * len(prompts) if isinstance(priority, int) else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"{len(priorities)} priorities for {len(prompts)} prompts")
        options = [RequestOptions(p, cache_salt, kv_cache_retention) for p in priorities]

        async def run_all() -> list[RequestOutput]:
            return list(await asyncio.gather(*(self._collect(p, params, o) for p, o in zip(prompts, options))))

        return self._call(run_all())

    async def _collect(self, prompt: Prompt, params: SamplingParams, options: RequestOptions) -> RequestOutput:
        text, ids, last = "", [], None
        # One chunk per request, when it finishes: the batch is read only at the end.
        async for chunk in self._async_engine.generate(_request(prompt, params, options, final_only=True)):
            text += chunk.text
            ids += chunk.token_ids
            last = chunk
        assert last is not None and last.finish_reason is not None and last.usage is not None
        usage = last.usage
        return RequestOutput(
            prompt, text, ids, last.finish_reason.value, usage.prompt_tokens, last.error,
            usage.cached_tokens, usage.not_reused, usage.num_preemptions,
            usage.num_draft_tokens, usage.num_accepted_draft_tokens,
        )

    # -- streaming ---------------------------------------------------------------

    async def generate_async(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None, options: RequestOptions = RequestOptions()
    ) -> AsyncIterator[GenerationChunk]:
        """Stream one completion's chunks into the caller's event loop."""
        caller = asyncio.get_running_loop()
        queue: asyncio.Queue[GenerationChunk | BaseException | None] = asyncio.Queue()
        request = _request(prompt, sampling_params or SamplingParams(), options)

        async def pump() -> None:
            try:
                async for chunk in self._async_engine.generate(request):
                    caller.call_soon_threadsafe(queue.put_nowait, chunk)
                caller.call_soon_threadsafe(queue.put_nowait, None)
            except BaseException as exc:  # validation errors reach the caller
                caller.call_soon_threadsafe(queue.put_nowait, exc)

        future = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            future.cancel()  # the caller stopped early: cancel the request

    def stats(self) -> EngineStats:
        """Live load and cache figures: prefix-cache hits, preemptions, free blocks, host tier."""

        async def read() -> EngineStats:
            return self._async_engine.stats()

        return self._call(read())

    # -- engine ------------------------------------------------------------------

    def save_engine(self, path: str | Path) -> Path:
        """Copy the built engine folder to ``path`` (reload it with ``LLM(engine_dir=path)``)."""
        target = Path(path)
        if target.exists():
            raise FileExistsError(f"{target} exists")
        shutil.copytree(self.engine_dir, target)
        return target

    def shutdown(self) -> None:
        if self._loop.is_running():
            self._call(self._async_engine.stop())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            release_garbage_collector()  # what this engine froze may be collected again

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
