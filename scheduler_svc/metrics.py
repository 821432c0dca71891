"""Prometheus metrics of the scheduler: the Stats call's figures and per-request latencies over HTTP.

``inflight serve|scheduler --metrics-port N`` answers ``GET /metrics`` on that port in Prometheus's text
format (version 0.0.4), so a Prometheus server or any scraper can watch load, the KV cache, speculative
decoding and request latencies without a gRPC client. The figures are those of the ``Stats`` call
(``EngineStats``) plus what the engine loop counts (``RequestMetrics``): finished requests by reason,
prompt and generated tokens, histograms of time to first token and of whole request latency (from the
moment a request was accepted), and of the wall time between steps.

The HTTP side is a few lines on the scheduler's own asyncio loop (no extra dependency): one response per
connection, ``/metrics`` only.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import math
from collections.abc import Callable, Sequence

from scheduler_svc.api_types import EngineStats
from scheduler_svc.request import FinishReason, Request

log = logging.getLogger("inflight.metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Upper bounds in seconds (+Inf is added): interactive first tokens to long generations.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
MAX_REQUEST_BYTES = 8192  # a scrape's request line and headers


class Histogram:
    """A cumulative Prometheus histogram: counts per upper bound, the sum and the count of observations."""

    __slots__ = ("bounds", "counts", "total", "count")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last is +Inf
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # the first bound >= value (+Inf past all)
        self.total += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, count in zip((*self.bounds, math.inf), self.counts):
            running += count
            out.append(f'{name}_bucket{{le="{"+Inf" if bound == math.inf else repr(float(bound))}"}} {running}')
        return out + [f"{name}_sum {self.total!r}", f"{name}_count {self.count}"]


class RequestMetrics:
    """What the engine loop counts as requests produce tokens and finish, and how long its steps take."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock  # the clock of Request.arrival_time
        self.finished = {reason: 0 for reason in FinishReason}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.time_to_first_token = Histogram(TTFT_BUCKETS)
        self.request_latency = Histogram(LATENCY_BUCKETS)
        self.step_period = Histogram(STEP_BUCKETS)

    def first_token(self, request: Request) -> None:
        """The request's first output token has just arrived."""
        self.time_to_first_token.observe(max(0.0, self.clock() - request.arrival_time))

    def request_finished(self, request: Request, reason: FinishReason) -> None:
        """The request has finished (any reason, a cancellation included)."""
        self.finished[reason] += 1
        self.prompt_tokens += request.num_prompt_tokens
        self.generation_tokens += len(request.output_token_ids)
        self.request_latency.observe(max(0.0, self.clock() - request.arrival_time))


def render(stats: EngineStats, requests: RequestMetrics, model: str) -> str:
    """The Prometheus text exposition of ``stats`` and ``requests``."""
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: Sequence[tuple[str, float | int]]) -> None:
        lines.append(f"# HELP inflight_{name} {help_text}")
        lines.append(f"# TYPE inflight_{name} {kind}")
        lines.extend(f"inflight_{name}{labels} {value}" for labels, value in samples)

    escaped = model.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    metric("model_info", "gauge", "The served model (label model); always 1.", [(f'{{model="{escaped}"}}', 1)])
    # (name, type, help, value): the Stats call's figures
    figures: list[tuple[str, str, str, float | int]] = [
        ("executor_ready", "gauge", "1 while an executor is attached and serving.", int(stats.executor_ready)),
        ("requests_running", "gauge", "Requests being generated.", stats.num_running_requests),
        ("requests_waiting", "gauge", "Requests queued for admission.", stats.num_waiting_requests),
        ("steps_total", "counter", "Steps the executor has run.", stats.num_steps),
        ("preemptions_total", "counter", "Running requests preempted to free KV blocks.", stats.num_preemptions),
    ]
    kv = stats.kv
    if kv is not None:
        figures += [
            ("kv_blocks", "gauge", "KV-cache blocks on the device.", kv.num_blocks),
            ("kv_blocks_free", "gauge", "Device KV blocks neither in use nor reserved.", kv.num_free_blocks),
            ("kv_blocks_cached", "gauge", "Free device KV blocks that still hold reusable prefixes.",
             kv.num_cached_free_blocks),
            ("host_kv_blocks", "gauge", "KV-cache blocks of the host tier.", kv.num_host_blocks),
            ("host_kv_blocks_cached", "gauge", "Host KV blocks holding reusable prefixes.",
             kv.num_cached_host_blocks),
            ("prefix_cache_query_tokens_total", "counter", "Prompt tokens looked up in the prefix cache.",
             kv.query_tokens),
            ("prefix_cache_hit_tokens_total", "counter", "Prompt tokens reused from the prefix cache.", kv.hit_tokens),
            ("kv_blocks_evicted_total", "counter", "Cached device blocks evicted for reuse.", kv.num_evicted_blocks),
            ("kv_blocks_swapped_out_total", "counter", "Blocks copied to the host tier.", kv.num_swapped_out_blocks),
            ("kv_blocks_swapped_in_total", "counter", "Blocks copied back from the host tier.",
             kv.num_swapped_in_blocks),
        ]
    drafts = stats.drafts
    if drafts is not None:
        figures += [
            ("spec_decode_draft_tokens_total", "counter", "Draft tokens verified.", drafts.num_draft_tokens),
            ("spec_decode_accepted_tokens_total", "counter", "Draft tokens accepted.", drafts.num_accepted),
        ]
    for name, kind, help_text, value in figures:
        metric(name, kind, help_text, [("", value)])
    if drafts is not None:
        metric("spec_decode_draft_tokens_by_position_total", "counter",
               "Draft tokens verified at each chain position (0: the first draft).",
               [(f'{{position="{i}"}}', n) for i, n in enumerate(drafts.by_position)])
        metric("spec_decode_accepted_tokens_by_position_total", "counter", "Draft tokens accepted at each position.",
               [(f'{{position="{i}"}}', n) for i, n in enumerate(drafts.accepted_by_position)])
    metric("requests_finished_total", "counter", "Requests finished, by reason.",
           [(f'{{reason="{reason.value}"}}', n) for reason, n in requests.finished.items()])
    metric("prompt_tokens_total", "counter", "Prompt tokens of finished requests.", [("", requests.prompt_tokens)])
    metric("generation_tokens_total", "counter", "Tokens generated for finished requests.",
           [("", requests.generation_tokens)])
    for name, histogram, help_text in (
        ("time_to_first_token_seconds", requests.time_to_first_token, "From acceptance to the first output token."),
        ("request_latency_seconds", requests.request_latency, "From acceptance to the end of the request."),
        ("step_seconds", requests.step_period, "Wall time from one step's result to the next's."),
    ):
        lines.append(f"# HELP inflight_{name} {help_text}")
        lines.append(f"# TYPE inflight_{name} histogram")
        lines.extend(histogram.lines(f"inflight_{name}"))
    return "\n".join(lines) + "\n"


async def start_metrics_server(page: Callable[[], str], host: str, port: int) -> asyncio.Server:
    """Serve ``page()`` at ``GET /metrics`` on ``host:port`` (HTTP/1.1, one response per connection)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10.0)
            request_line = head.split(b"\r\n", 1)[0].decode("latin-1").split()
            if len(request_line) < 2 or request_line[0] not in ("GET", "HEAD"):
                status, body = "405 Method Not Allowed", "only GET /metrics\n"
            elif request_line[1].split("?", 1)[0] != "/metrics":
                status, body = "404 Not Found", "only GET /metrics\n"
            else:
                status, body = "200 OK", page()
            payload = body.encode()
            content = CONTENT_TYPE if status == "200 OK" else "text/plain; charset=utf-8"
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {content}\r\nContent-Length: {len(payload)}\r\n"
                "Connection: close\r\n\r\n".encode()
            )
            if request_line and request_line[0] != "HEAD":
                writer.write(payload)
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError, ConnectionError):
            pass  # a client that went away or sent no proper request gets nothing
        except Exception:  # noqa: BLE001 - a scrape must never take the scheduler down
            log.exception("metrics request failed")
        finally:
            writer.close()

    server = await asyncio.start_server(handle, host, port, limit=MAX_REQUEST_BYTES)
    log.info("metrics on http://%s:%d/metrics", host, port)
    return server
