"""Start and stop real inflight processes on loopback for tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import TEST_DEVICE

ENGINE_FLAGS = ["--device", TEST_DEVICE, "--dtype", "float32", "--tokens-per-block", "16", "--kv-cache-gb", "0.25"]
BATCH_FLAGS = ["--max-seq-len", "2048", "--max-batch-size", "32"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "inflight", *args], env={**os.environ, "PYTHONUNBUFFERED": "1"})


def spawn_executor(model_dir, port: int) -> subprocess.Popen:
    return spawn("executor", "--model", str(model_dir), "--port", str(port), *ENGINE_FLAGS, *BATCH_FLAGS)


def spawn_scheduler(model_dir, port: int, executor_port: int, *extra: str) -> subprocess.Popen:
    return spawn(
        "scheduler", "--model", str(model_dir), "--port", str(port), "--executor", f"127.0.0.1:{executor_port}",
        "--max-queue-size", "64", *BATCH_FLAGS, *extra,
    )


def health_status(address: str) -> int | None:
    with grpc.insecure_channel(address) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0).status
        except grpc.RpcError:
            return None


def wait_serving(address: str, procs, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in procs:
            assert proc.poll() is None, f"server process exited with {proc.returncode}"
        if health_status(address) == health_pb2.HealthCheckResponse.SERVING:
            return
        time.sleep(0.3)
    raise TimeoutError(f"{address} did not become healthy")


def stop(*procs: subprocess.Popen) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_idle(client, timeout: float = 30.0):
    """Stats once no request is running or waiting."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = client.stats()
        if stats.num_running_requests == 0 and stats.num_waiting_requests == 0:
            return stats
        time.sleep(0.1)
    raise TimeoutError(f"requests still in flight: {client.stats()}")
