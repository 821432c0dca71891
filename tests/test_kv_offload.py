"""The host tier of the KV cache: the scheduler's slot bookkeeping and the
executor's copies, alone and together (a randomized workload checks that every
reused block holds exactly the content its hash names)."""

from __future__ import annotations

import random

import torch

from executor_svc.kv_offload import KVOffload
from kvcache import BlockHashes, KVCacheManager, NotReusedTokens
from protos.plan import BlockCopy


def hashes_of(tokens: list[int], block: int) -> BlockHashes:
    h = BlockHashes(block)
    h.extend(tokens)
    return h


def compute(kv: KVCacheManager, rid: str, tokens: list[int]) -> int:
    """Admit a request with its cached prefix, as if its prompt were computed in one step; returns hit blocks."""
    hashes = hashes_of(tokens, kv.tokens_per_block)
    hit = kv.find_cached_prefix(hashes, len(tokens))
    kv.admit(rid, hit, len(tokens))
    kv.explain_prompt(hashes, tokens, hit.num_blocks)
    kv.cache_computed_blocks(rid, hashes, len(tokens), tokens)
    return hit.num_blocks


def test_evicted_blocks_move_to_the_host_and_come_back():
    kv = KVCacheManager(num_blocks=4, tokens_per_block=2, num_host_blocks=4)
    a = [1, 2, 3, 4, 5]  # 2 full blocks + 1
    compute(kv, "a", a)
    kv.take_copies()
    a_blocks = kv.block_table("a")[:2]
    kv.free("a")
    compute(kv, "b", [9, 8, 7, 6, 5, 4, 3])  # 4 blocks: evicts a's two cached blocks
    copies = kv.take_copies()
    assert sorted(d for d, _ in copies.swap_out) == sorted(a_blocks)
    assert kv.host.num_cached == 2
    kv.free("b")
    assert compute(kv, "a2", a) == 2  # both found in the host tier
    copies = kv.take_copies()
    assert len(copies.swap_in) == 2
    slots_in = {s for s, _ in copies.swap_in}
    assert kv.host.num_cached < 4 and not kv.check_consistency()
    assert kv.stats().num_swapped_in_blocks == 2
    kv.free("a2")
    assert kv.host.num_free_slots + kv.host.num_cached == 4  # the slots read by the swap-in are free again
    assert slots_in.isdisjoint(kv.host.cached.values())


def test_host_tier_evicts_lru_and_remembers_why():
    kv = KVCacheManager(num_blocks=2, tokens_per_block=2, num_host_blocks=1)
    compute(kv, "a", [1, 2, 3])  # one full block
    kv.free("a")
    compute(kv, "b", [5, 6, 7])  # evicts a's block to the host
    kv.free("b")
    compute(kv, "c", [8, 9, 10, 11])  # evicts b's block to the host, which evicts a's for good
    kv.free("c")
    kv.take_copies()
    hashes = hashes_of([1, 2, 3], 2)
    assert kv.find_cached_prefix(hashes, 3).num_blocks == 0
    assert kv.explain_prompt(hashes, [1, 2, 3], 0) == NotReusedTokens(evicted=2, partial_last_block=1)
    assert kv.find_cached_prefix(hashes_of([5, 6, 7], 2), 3).num_blocks == 1


def test_swap_in_target_evicted_in_the_same_step_cancels_the_copy():
    kv = KVCacheManager(num_blocks=2, tokens_per_block=2, num_host_blocks=2)
    compute(kv, "a", [1, 2, 3])
    kv.free("a")
    compute(kv, "b", [5, 6, 7, 8])  # both device blocks: a's block goes to the host
    kv.free("b")
    kv.take_copies()
    hit = kv.find_cached_prefix(hashes_of([1, 2, 3], 2), 3)
    kv.admit("a2", hit, 2)  # swap-in into a fresh device block
    kv.free("a2")  # preempted in the same step, before its copy ran
    compute(kv, "d", [20, 21, 22, 23])  # needs both blocks: evicts the swap-in target too
    copies = kv.take_copies()
    assert copies.swap_in == []  # the copy is cancelled...
    assert kv.find_cached_prefix(hashes_of([1, 2, 3], 2), 3).num_blocks == 1  # ...and the host still has it
    assert not kv.check_consistency()


def test_offload_copies_round_trip_on_cpu():
    torch.manual_seed(0)
    cache = torch.randn(3, 2, 5, 4, 2, 8)  # [layers, 2, blocks, tokens_per_block, kv_heads, D]
    original = cache.clone()
    offload = KVOffload(cache, num_device_blocks=5, num_host_blocks=3, max_blocks_per_copy=2)
    offload.copy_blocks([BlockCopy(3, 0), BlockCopy(1, 2), BlockCopy(4, 1)], [])
    cache[:, :, [1, 3, 4]] = 0
    offload.copy_blocks([], [BlockCopy(0, 2), BlockCopy(2, 0), BlockCopy(1, 1)])  # slot 2 -> block 0, ...
    assert torch.equal(cache[:, :, 0], original[:, :, 1])
    assert torch.equal(cache[:, :, 2], original[:, :, 3])
    assert torch.equal(cache[:, :, 1], original[:, :, 4])


def test_offload_rejects_ids_out_of_range():
    offload = KVOffload(torch.zeros(1, 2, 4, 2, 1, 1), num_device_blocks=3, num_host_blocks=2)
    for bad in (BlockCopy(3, 0), BlockCopy(0, 2)):  # block 3 is the scratch block, not the scheduler's
        try:
            offload.copy_blocks([bad], [])
        except ValueError as exc:
            assert "outside" in str(exc)
        else:
            raise AssertionError(f"{bad} accepted")


def test_reused_blocks_always_hold_their_content_under_random_traffic():
    """Scheduler bookkeeping + executor copies: a tiny device pool and host tier under churn."""
    rng = random.Random(7)
    block, num_blocks, num_host = 2, 8, 5
    kv = KVCacheManager(num_blocks=num_blocks, tokens_per_block=block, num_host_blocks=num_host)
    cache = torch.zeros(1, 2, num_blocks, block, 1, 1)  # one number per block stands for its KV
    offload = KVOffload(cache, num_blocks, num_host)

    def content(block_hash: bytes) -> float:
        return float(int.from_bytes(block_hash[:3], "little"))

    families = [[rng.randrange(1000) for _ in range(6)] for _ in range(4)]
    running: list[str] = []
    checked = 0
    for step in range(300):
        admitted = []
        for n in range(rng.randint(0, 3)):
            if admitted and rng.random() < 0.3:  # preempted within the step it was admitted in
                kv.free(admitted.pop(rng.randrange(len(admitted)))[0])
            tokens = rng.choice(families)[: rng.choice([2, 4, 6])] + [rng.randrange(1000) for _ in range(rng.randint(1, 3))]
            hashes = hashes_of(tokens, block)
            hit = kv.find_cached_prefix(hashes, len(tokens))
            if not kv.can_admit(hit, len(tokens)):
                continue
            rid = f"r{step}.{n}"
            kv.admit(rid, hit, len(tokens))
            admitted.append((rid, tokens, hashes, hit.num_blocks))
        if running and rng.random() < 0.5:  # a request preempted (or cancelled) within the step
            victim = running.pop(rng.randrange(len(running)))
            kv.free(victim)
        copies = kv.take_copies()
        offload.copy_blocks([BlockCopy(d, h) for d, h in copies.swap_out], [BlockCopy(d, h) for h, d in copies.swap_in])
        for rid, tokens, hashes, num_hit in admitted:  # the forward: read the prefix, write the rest
            table = kv.block_table(rid)
            for i in range(num_hit):
                assert cache[0, 0, table[i]].flatten()[0].item() == content(hashes.hashes[i]), f"step {step}: stale block"
                checked += 1
            for i in range(num_hit, len(tokens) // block):
                cache[:, :, table[i]] = content(hashes.hashes[i])
            kv.cache_computed_blocks(rid, hashes, len(tokens), tokens)
            running.append(rid)
        while len(running) > 2:
            kv.free(running.pop(0))
        assert not kv.check_consistency()
    for rid in running:
        kv.free(rid)
    kv.take_copies()
    stats = kv.stats()
    assert checked > 100 and stats.num_swapped_in_blocks > 10 and stats.num_host_evicted_blocks > 0
    assert kv.num_free_blocks == num_blocks and kv.host.num_free_slots + kv.host.num_cached == num_host


# -- on the real model ------------------------------------------------------------------

import pytest  # noqa: E402

from tests.conftest import PROMPTS, TEST_DEVICE, run_async  # noqa: E402
from tests.test_prefix_cache import QUESTIONS, SHARED, assert_no_leaks, complete  # noqa: E402

DEVICE_POOL = 16  # blocks of 16 tokens the scheduler may use: one long prompt fills most of it
# Long prompts with nothing in common with SHARED, to push its blocks off the device.
OTHERS = [" ".join(reversed(SHARED.split())), PROMPTS[6] * 3]


@pytest.fixture(scope="module")
def engine_with_host_tier(engine_dir):
    from executor_svc.engine import RuntimeConfig, load_engine

    return load_engine(engine_dir, RuntimeConfig(device=TEST_DEVICE, kv_cache_bytes=100 << 20, host_cache_bytes=24 << 20))


def test_greedy_tokens_identical_with_blocks_restored_from_the_host_tier(engine_with_host_tier, tokenizer):
    from inflight.inprocess import InProcessExecutor
    from scheduler_svc.engine_loop import AsyncEngine, EngineLimits

    async def run():
        engine = AsyncEngine(InProcessExecutor(engine_with_host_tier), tokenizer, EngineLimits(num_kv_blocks=DEVICE_POOL))
        await engine.start()
        try:
            assert engine.scheduler.config.num_host_blocks == engine_with_host_tier.kv_offload.num_host_blocks > 0
            first = await complete(engine, SHARED + QUESTIONS[0])
            for other in OTHERS:
                await complete(engine, other)
            evicted = engine.stats().kv
            again = await complete(engine, SHARED + QUESTIONS[0])
            assert_no_leaks(engine)
            kv = engine.scheduler.kv
            assert kv.host.num_releasing == 0 and kv.host.num_free_slots + kv.host.num_cached == kv.host.num_slots
            return first, again, evicted, engine.stats().kv
        finally:
            await engine.stop()

    (first_ids, first), (again_ids, again), evicted, stats = run_async(run())
    assert evicted.num_swapped_out_blocks > 0 and evicted.num_cached_host_blocks > 0
    assert stats.num_swapped_in_blocks > 0
    assert again.cached_tokens == (first.prompt_tokens - 1) // 16 * 16  # every full block, device or host
    assert again_ids == first_ids


def test_served_over_grpc_with_host_tier_priorities_and_salts(model_dir):
    """The real processes: executor with a host tier, scheduler under MAX_UTILIZATION with a tiny pool."""
    from inflight.client import Client
    from tests.servers import BATCH_FLAGS, ENGINE_FLAGS, free_port, spawn, stop, wait_idle, wait_serving

    executor_port, port = free_port(), free_port()
    executor = spawn("executor", "--model", str(model_dir), "--port", str(executor_port), *ENGINE_FLAGS, *BATCH_FLAGS,
                     "--host-cache-gb", "0.02")
    scheduler = spawn(
        "scheduler", "--model", str(model_dir), "--port", str(port), "--executor", f"127.0.0.1:{executor_port}",
        "--capacity-policy", "max_utilization", "--num-kv-blocks", str(DEVICE_POOL), "--max-seq-len", "256",
    )
    address = f"127.0.0.1:{port}"
    try:
        wait_serving(address, [executor, scheduler])
        with Client(address) as client:
            info = client.model_info()
            assert info.capacity_policy == "MAX_UTILIZATION" and info.prefix_caching and info.num_host_blocks > 0
            assert info.num_kv_blocks == DEVICE_POOL
            opts = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
            first = client.generate(SHARED + QUESTIONS[0], retain_prefix_tokens=64, retention_priority=80, **opts)
            for other in OTHERS:
                client.generate(other, priority=3, **opts)
            again = client.generate(SHARED + QUESTIONS[0], **opts)
            salted = client.generate(SHARED + QUESTIONS[0], cache_salt="tenant-b", **opts)
            stats = wait_idle(client)
        assert again.token_ids == first.token_ids == salted.token_ids
        assert again.usage.cached_tokens > 0 and salted.usage.cached_tokens == 0
        assert salted.usage.not_reused["salt_differs"] > 0
        assert first.usage.not_reused["not_cached"] + first.usage.not_reused["partial_last_block"] == first.usage.prompt_tokens
        assert stats.num_swapped_out_blocks > 0 and stats.num_swapped_in_blocks > 0
        assert stats.prefix_cache_hit_tokens >= again.usage.cached_tokens
        assert stats.num_free_kv_blocks == stats.num_kv_blocks == DEVICE_POOL
        assert stats.not_reused.salt_differs == salted.usage.not_reused["salt_differs"]
    finally:
        stop(scheduler, executor)
