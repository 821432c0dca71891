"""The Prometheus page (scheduler_svc/metrics.py): the text format, histograms, and the HTTP side."""

from __future__ import annotations

import asyncio
import math
import re

from kvcache.reuse_stats import KVCacheStats, NotReusedTokens
from protos.plan import SamplingConfig
from scheduler_svc.api_types import EngineStats
from scheduler_svc.metrics import Histogram, RequestMetrics, render, start_metrics_server
from scheduler_svc.request import FinishReason, Request, StoppingParams
from scheduler_svc.speculation import DraftStats

SAMPLE = re.compile(r'(inflight_\w+)(\{\w+="(?:[^"\\]|\\.)*"\})? (\S+)')  # a label value may hold \"


def _request(arrival: float, prompt: int = 3, output: int = 2) -> Request:
    return Request("r", list(range(prompt)), SamplingConfig(), StoppingParams(max_tokens=8), frozenset(), arrival,
                   output_token_ids=list(range(output)))


def test_histogram_is_cumulative_with_sum_and_count():
    h = Histogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 3.0):
        h.observe(value)
    assert h.lines("x") == ['x_bucket{le="0.1"} 2', 'x_bucket{le="1.0"} 3', 'x_bucket{le="+Inf"} 4',
                            "x_sum 3.65", "x_count 4"]


def test_page_is_prometheus_text_with_every_figure():
    now = [100.0]
    requests = RequestMetrics(lambda: now[0])
    request = _request(arrival=99.0)
    now[0] = 99.25
    requests.first_token(request)
    now[0] = 101.0
    requests.request_finished(request, FinishReason.LENGTH)
    kv = KVCacheStats(num_blocks=10, num_free_blocks=7, num_cached_free_blocks=2, num_host_blocks=0,
                      num_cached_host_blocks=0, query_tokens=30, hit_tokens=16, not_reused=NotReusedTokens(),
                      num_evicted_blocks=1, num_swapped_out_blocks=0, num_swapped_in_blocks=0,
                      num_host_evicted_blocks=0)
    drafts = DraftStats(num_draft_tokens=9, num_accepted=4, by_position=[5, 4], accepted_by_position=[3, 1])
    stats = EngineStats(2, 1, 40, executor_ready=True, num_preemptions=0, kv=kv, drafts=drafts)
    page = render(stats, requests, 'a "model"')
    samples = {}
    for line in page.splitlines():
        if line.startswith("# TYPE"):
            assert line.split()[3] in ("gauge", "counter", "histogram"), line
        elif not line.startswith("# HELP"):
            match = SAMPLE.fullmatch(line)
            assert match, line
            samples[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    assert samples['inflight_model_info{model="a \\"model\\""}'] == 1
    assert samples["inflight_requests_running"] == 2 and samples["inflight_requests_waiting"] == 1
    assert samples["inflight_kv_blocks_free"] == 7 and samples["inflight_prefix_cache_hit_tokens_total"] == 16
    assert samples['inflight_spec_decode_accepted_tokens_by_position_total{position="1"}'] == 1
    assert samples["inflight_spec_decode_draft_tokens_total"] == 9
    assert samples['inflight_requests_finished_total{reason="length"}'] == 1
    assert samples['inflight_requests_finished_total{reason="cancelled"}'] == 0
    assert samples["inflight_prompt_tokens_total"] == 3 and samples["inflight_generation_tokens_total"] == 2
    assert math.isclose(samples["inflight_time_to_first_token_seconds_sum"], 0.25)
    assert samples['inflight_request_latency_seconds_bucket{le="1.0"}'] == 0
    assert samples['inflight_request_latency_seconds_bucket{le="2.5"}'] == 1


def test_page_before_an_executor_attaches_has_no_cache_figures():
    page = render(EngineStats(0, 0, 0, executor_ready=False), RequestMetrics(lambda: 0.0), "")
    assert "inflight_executor_ready 0" in page and "inflight_kv_blocks" not in page


def test_http_side_serves_metrics_only():
    async def exchange(port: int, raw: bytes) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(raw)
        writer.write_eof()  # all of the request: a server still waiting for headers sees the end at once
        await writer.drain()
        answer = await reader.read()
        writer.close()
        return answer

    async def main() -> list[bytes]:
        server = await start_metrics_server(lambda: "inflight_up 1\n", "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            return [
                await exchange(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"),
                await exchange(port, b"GET /metrics?x=1 HTTP/1.0\r\n\r\n"),
                await exchange(port, b"GET / HTTP/1.1\r\n\r\n"),
                await exchange(port, b"POST /metrics HTTP/1.1\r\n\r\n"),
                await exchange(port, b"HEAD /metrics HTTP/1.1\r\n\r\n"),
                await exchange(port, b"garbage"),  # headers that never end: the connection just closes
            ]
        finally:
            server.close()
            await server.wait_closed()

    ok, query, missing, post, head, garbage = asyncio.run(main())
    assert ok.startswith(b"HTTP/1.1 200 OK") and b"text/plain; version=0.0.4" in ok and ok.endswith(b"inflight_up 1\n")
    assert query.endswith(b"inflight_up 1\n")
    assert missing.startswith(b"HTTP/1.1 404") and post.startswith(b"HTTP/1.1 405")
    assert head.startswith(b"HTTP/1.1 200 OK") and head.endswith(b"\r\n\r\n")
    assert garbage == b""
