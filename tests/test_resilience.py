"""The service survives its parts going away: an executor killed mid-stream
fails only the requests it held, the scheduler reports NOT_SERVING and answers
UNAVAILABLE, and it serves again once an executor is back on the same address.
Also: `inflight serve` runs both processes and stops both, and a server given a bad
model or setting exits with the message that names it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from inflight.client import Client
from tests.servers import free_port, health_status, spawn, spawn_executor, spawn_scheduler, stop, wait_serving


def test_executor_restart(model_dir):
    executor_port, port = free_port(), free_port()
    address = f"127.0.0.1:{port}"
    executor = spawn_executor(model_dir, executor_port)
    scheduler = spawn_scheduler(model_dir, port, executor_port)
    try:
        wait_serving(address, [executor, scheduler])
        with Client(address) as client:
            stream = client.generate_stream("Tell me a long story.", max_tokens=1500, ignore_eos=True, temperature=0.0)
            next(stream)
            executor.kill()
            executor.wait()
            last = list(stream)[-1]
            assert last.finish_reason == "error" and "executor unavailable" in last.error

            deadline = time.monotonic() + 10
            while health_status(address) != health_pb2.HealthCheckResponse.NOT_SERVING:
                assert time.monotonic() < deadline, "scheduler never reported NOT_SERVING"
                time.sleep(0.2)
            with pytest.raises(grpc.RpcError) as info:
                client.generate("hi", max_tokens=4)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE

            executor = spawn_executor(model_dir, executor_port)
            wait_serving(address, [executor, scheduler])
            again = client.generate("The capital of France is", max_tokens=8, temperature=0.0)
            assert again.finish_reason == "length" and len(again.token_ids) == 8
            stats = client.stats()
            assert stats.num_free_kv_blocks == stats.num_kv_blocks
        assert scheduler.poll() is None
    finally:
        stop(scheduler, executor)


def test_serve_runs_both_processes(model_dir):
    port, executor_port = free_port(), free_port()
    serve = spawn(
        "serve", "--model", str(model_dir), "--port", str(port), "--executor-port", str(executor_port),
        "--device", "cpu", "--kv-cache-gb", "0.25", "--max-seq-len", "1024",
    )
    address = f"127.0.0.1:{port}"
    try:
        wait_serving(address, [serve])
        with Client(address) as client:
            out = client.generate(messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0.0)
            assert out.token_ids and out.finish_reason in ("length", "eos")
            assert client.model_info().max_seq_len == 1024
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=30) == 0
        # The executor child went with it: its port is free again.
        executor = spawn_executor(model_dir, executor_port)
        time.sleep(0.5)
        stop(executor)
    finally:
        stop(serve)


def test_servers_refuse_bad_models_and_settings_with_their_message_not_a_traceback(tmp_path):
    not_a_folder = tmp_path / "a-file"
    not_a_folder.write_text("")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    taken_port = str(taken.getsockname()[1])

    def ports(*flags: str) -> list[str]:  # ports nobody holds: only the case's own fault may stop the server
        return [arg for flag in flags for arg in (flag, str(free_port()))]

    serve = ["serve", *ports("--port", "--executor-port")]
    cases = {  # command line, environment -> what the message must say
        "serve": ([*serve, "--model", "no-such-model"], {}, "Unknown model 'no-such-model'"),
        "scheduler": (["scheduler", "--model", "no-such-model", *ports("--port")], {}, "Unknown model 'no-such-model'"),
        "executor": (["executor", "--max-seq-len", "-5", *ports("--port")], {}, "max_seq_len must be >= 0, got -5"),
        "cache budget": (["serve", *ports("--port", "--executor-port")], {"INFLIGHT_ENGINE_CACHE_GB": "lots"},
                         "INFLIGHT_ENGINE_CACHE_GB must be a finite number of GiB"),
        "unwritable cache": (["executor", *ports("--port")], {"INFLIGHT_CACHE": str(not_a_folder / "cache")},
                             "Not a directory"),
        # Refused before a model loads.
        "executor port": (["executor", "--port", taken_port], {}, f"cannot listen on 127.0.0.1:{taken_port} (--port)"),
        "serve port": (["serve", *ports("--port"), "--executor-port", taken_port], {},
                       f"cannot listen on 127.0.0.1:{taken_port} (--executor-port)"),
    }
    procs = {
        name: subprocess.Popen([sys.executable, "-m", "inflight", *argv], env={**os.environ, **env},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, (argv, env, _) in cases.items()
    }
    try:
        for name, proc in procs.items():
            _, err = proc.communicate(timeout=120)
            assert proc.returncode != 0, name
            assert cases[name][2] in err and "Traceback" not in err, (name, err)
            assert "building an engine" not in err and "engine ready" not in err, (name, err)
    finally:
        taken.close()


def test_a_second_server_on_a_port_in_use_fails_to_bind_instead_of_sharing_it():
    from concurrent import futures

    from protos.grpc_settings import SERVER_OPTIONS, listen

    first = grpc.server(futures.ThreadPoolExecutor(max_workers=1), options=SERVER_OPTIONS)
    port = listen(first, "127.0.0.1:0", "executor")
    first.start()
    try:
        second = grpc.server(futures.ThreadPoolExecutor(max_workers=1), options=SERVER_OPTIONS)
        with pytest.raises(OSError, match=f"the executor cannot listen on 127.0.0.1:{port}: the port is in use"):
            listen(second, f"127.0.0.1:{port}", "executor")
    finally:
        first.stop(grace=None)
