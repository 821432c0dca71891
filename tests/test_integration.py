"""The real architecture on loopback: an executor process and a scheduler
process connected by gRPC, driven through the public API by the Python client.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import pytest

from inflight.client import AsyncClient, Client
from tests.conftest import MAX_NEW_TOKENS, PROMPTS
from tests.servers import free_port, spawn_executor, spawn_scheduler, stop, wait_idle, wait_serving


@pytest.fixture(scope="module")
def served(model_dir):
    """`inflight executor` and `inflight scheduler` as two processes: (client address, metrics port)."""
    executor_port, port, metrics_port = free_port(), free_port(), free_port()
    executor = spawn_executor(model_dir, executor_port)
    scheduler = spawn_scheduler(model_dir, port, executor_port, "--metrics-port", str(metrics_port))
    address = f"127.0.0.1:{port}"
    try:
        wait_serving(address, [executor, scheduler])
        yield address, metrics_port
    finally:
        stop(scheduler, executor)


@pytest.fixture(scope="module")
def server(served):
    return served[0]


def scrape(port: int) -> dict[str, float]:
    """GET /metrics: every sample as {'name{labels}': value}, each line checked against the text format."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.fullmatch(r"# (HELP|TYPE) inflight_\w+ .+", line), line
            continue
        match = re.fullmatch(r'(inflight_\w+(?:\{\w+="(?:[^"\\]|\\.)*"\})?) (\S+)', line)
        assert match, line
        samples[match.group(1)] = float(match.group(2))
    return samples


def test_sixteen_concurrent_streams_match_hf(server, hf_reference):
    prompts = PROMPTS * 2  # 16 concurrent requests

    async def run():
        async with AsyncClient(server) as client:
            async def one(prompt):
                chunks = [c async for c in client.generate_stream(prompt, max_tokens=MAX_NEW_TOKENS, temperature=0.0)]
                return chunks

            return await asyncio.gather(*(one(p) for p in prompts))

    results = asyncio.run(run())
    for prompt, chunks, expected in zip(prompts, results, hf_reference * 2):
        ids = [t for c in chunks for t in c.token_ids]
        assert ids == expected, prompt[:40]
        assert len(chunks) >= 2, "tokens should stream in several messages"
        last = chunks[-1]
        assert last.finish_reason in ("length", "eos")
        assert last.usage.completion_tokens == len(ids)
    with Client(server) as client:
        stats = wait_idle(client)
        assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_final_only_answers_in_one_response(server, hf_reference):
    with Client(server) as client:
        responses = list(client.generate_stream(PROMPTS[0], max_tokens=MAX_NEW_TOKENS, temperature=0.0, final_only=True))
        streamed = client.generate_stream(PROMPTS[0], max_tokens=MAX_NEW_TOKENS, temperature=0.0)
        text = "".join(c.text for c in streamed)
    assert len(responses) == 1 and responses[0].token_ids == hf_reference[0]
    assert responses[0].text == text and responses[0].finish_reason in ("length", "eos")


def test_tokenize_and_model_info(server, tokenizer):
    with Client(server) as client:
        assert client.tokenize("Hello world") == tokenizer.encode("Hello world")
        chat = client.tokenize(messages=[{"role": "user", "content": "Hi"}])
        assert chat[0] == 1  # <|im_start|> opens the template
        info = client.model_info()
        assert info.vocab_size == 49152 and info.max_seq_len == 2048 and info.tokens_per_block == 16
        assert info.has_chat_template and 2 in info.eos_token_ids


def test_reflection_lists_the_services(server):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(server) as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"inflight.v1.Generation", "grpc.health.v1.Health"} <= services


def test_chat_stop_strings_and_stop_tokens(server):
    with Client(server) as client:
        chat = client.generate(messages=[{"role": "user", "content": "Name three fruits."}], max_tokens=48, temperature=0.0)
        assert chat.text.strip() and chat.finish_reason in ("eos", "length")
        full = client.generate("The capital of France is", max_tokens=24, temperature=0.0)
        word = full.text.split()[1]  # a word that appears mid-completion
        stopped = client.generate("The capital of France is", max_tokens=24, temperature=0.0, stop=[word])
        assert stopped.finish_reason == "stop"
        assert word not in stopped.text and full.text.startswith(stopped.text)
        token = full.token_ids[3]
        by_token = client.generate("The capital of France is", max_tokens=24, temperature=0.0, stop_token_ids=[token])
        assert by_token.finish_reason == "stop" and by_token.token_ids == full.token_ids[: full.token_ids.index(token) + 1]


BAD_REQUESTS = [
    (dict(prompt=""), "text"),
    (dict(prompt="hi", max_tokens=5000), "max_tokens"),
    (dict(prompt="hi", temperature=-0.5), "temperature"),
    (dict(prompt="hi", top_p=0.0), "top_p"),
    (dict(prompt="hi", top_p=1.5), "top_p"),
    (dict(prompt="hi", top_k=-1), "top_k"),
    (dict(prompt="hi", max_tokens=0), "max_tokens"),
    (dict(token_ids=[1, 2, 10**6]), "token_ids"),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), "role"),
    (dict(messages=[{"role": "user", "content": ""}]), "content"),
    (dict(messages=[]), "chat"),
    (dict(), "input"),
]


def test_bad_requests_are_rejected_without_disturbing_others(server, hf_reference):
    async def run():
        async with AsyncClient(server) as client:
            good = asyncio.create_task(client.generate(PROMPTS[0], max_tokens=MAX_NEW_TOKENS, temperature=0.0))
            errors = []
            for kwargs, field in BAD_REQUESTS:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await client.generate(**{"max_tokens": 4, **kwargs} if "max_tokens" not in kwargs else kwargs)
                errors.append((info.value, field))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.generate("hi", top_k=0, max_tokens=4, min_p=2.0)
            errors.append((info.value, "min_p"))
            return await good, errors

    completion, errors = asyncio.run(run())
    for error, field in errors:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in error.details(), error.details()
    assert completion.token_ids == hf_reference[0]


def test_cancel_mid_stream_frees_blocks(served):
    server, metrics_port = served
    cancelled = 'inflight_requests_finished_total{reason="cancelled"}'
    before = scrape(metrics_port)[cancelled]
    with Client(server) as client:
        total = client.stats().num_kv_blocks
        stream = client.generate_stream("Write a long story about a dragon.", max_tokens=1000, temperature=0.0, ignore_eos=True)
        received = [next(stream) for _ in range(3)]
        assert all(c.finish_reason is None for c in received)
        assert client.stats().num_running_requests == 1
        stream.close()  # the client cancels the RPC
        stats = wait_idle(client)
        assert stats.num_free_kv_blocks == total
    assert scrape(metrics_port)[cancelled] == before + 1  # and the metrics count it as cancelled


def test_deadline_exceeded_frees_blocks(server):
    with Client(server) as client:
        total = client.stats().num_kv_blocks
        with pytest.raises(grpc.RpcError) as info:
            client.generate("Count to one thousand:", max_tokens=1000, ignore_eos=True, timeout=1.0)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert wait_idle(client).num_free_kv_blocks == total


def test_generate_cli_streams_only_the_completion_to_stdout(server):
    with Client(server) as client:
        expected = client.generate("The capital of France is", max_tokens=12, temperature=0.0).text
    out = subprocess.run(
        [sys.executable, "-m", "inflight", "generate", "--server", server, "--prompt", "The capital of France is",
         "--max-tokens", "12", "--temperature", "0"],
        capture_output=True, text=True, timeout=60, check=True,
    )
    assert out.stdout == expected + "\n"
    bad = subprocess.run(
        [sys.executable, "-m", "inflight", "generate", "--server", server, "--prompt", "hi", "--top-p", "2"],
        capture_output=True, text=True, timeout=60,
    )
    assert bad.returncode != 0 and bad.stdout == "" and "top_p" in bad.stderr
    salted = subprocess.run(  # priority and salt change scheduling and reuse, never the greedy tokens
        [sys.executable, "-m", "inflight", "generate", "--server", server, "--prompt", "The capital of France is",
         "--max-tokens", "12", "--temperature", "0", "--priority", "7", "--cache-salt", "tenant-a"],
        capture_output=True, text=True, timeout=60, check=True,
    )
    assert salted.stdout == expected + "\n"
    too_high = subprocess.run(
        [sys.executable, "-m", "inflight", "generate", "--server", server, "--prompt", "hi", "--priority", "1000"],
        capture_output=True, text=True, timeout=60,
    )
    assert too_high.returncode != 0 and "priority" in too_high.stderr


def test_serve_with_prompt_lookup_defaults_matches_hf(model_dir, hf_reference):
    """`inflight serve --speculative ngram` with no draft flags: the executor child takes prompt lookup's own
    defaults, speculates, and the greedy tokens are still exactly transformers'."""
    from tests.servers import ENGINE_FLAGS, spawn

    port, executor_port = free_port(), free_port()
    serve = spawn("serve", "--model", str(model_dir), "--port", str(port), "--executor-port", str(executor_port),
                  "--speculative", "ngram", "--max-seq-len", "2048", "--max-batch-size", "16", *ENGINE_FLAGS)
    address = f"127.0.0.1:{port}"
    try:
        wait_serving(address, [serve])
        with Client(address) as client:
            drafted = 0
            for prompt, expected in zip(PROMPTS, hf_reference):
                chunks = list(client.generate_stream(prompt, max_tokens=MAX_NEW_TOKENS, temperature=0.0))
                assert [t for c in chunks for t in c.token_ids] == expected, prompt[:40]
                drafted += chunks[-1].usage.num_draft_tokens
            assert drafted > 0  # speculation ran
            stats = wait_idle(client)
            assert stats.num_free_kv_blocks == stats.num_kv_blocks
    finally:
        stop(serve)


def test_metrics_count_a_request_and_show_the_cache(served):
    """GET /metrics on --metrics-port: a finished request moves the counters and histograms by exactly its
    own figures; the gauges show an idle server with every KV block free; other paths are 404."""
    address, metrics_port = served
    prompt = "Name three colours."
    before = scrape(metrics_port)
    with Client(address) as client:
        out = client.generate(prompt, max_tokens=5, temperature=0.0, ignore_eos=True)
        wait_idle(client)
    after = scrape(metrics_port)

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert out.usage.completion_tokens == 5
    assert grew('inflight_requests_finished_total{reason="length"}') == 1
    assert grew("inflight_generation_tokens_total") == 5
    assert grew("inflight_prompt_tokens_total") == out.usage.prompt_tokens
    for histogram in ("inflight_time_to_first_token_seconds", "inflight_request_latency_seconds"):
        assert grew(f"{histogram}_count") == 1 and grew(histogram + '_bucket{le="+Inf"}') == 1
        assert 0 < grew(f"{histogram}_sum") < 60
    assert after["inflight_steps_total"] > before["inflight_steps_total"]
    assert grew("inflight_step_seconds_count") == after["inflight_steps_total"] - before["inflight_steps_total"]
    assert after["inflight_executor_ready"] == 1 and after["inflight_requests_running"] == 0
    assert after["inflight_kv_blocks_free"] == after["inflight_kv_blocks"] > 0
    assert any(name.startswith("inflight_model_info{model=") for name in after)
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/other", timeout=10)
    assert info.value.code == 404
