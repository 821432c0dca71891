"""The wire contracts of inflight.

``generation.proto`` is the public API (package ``inflight.v1``) and
``executor.proto`` the scheduler <-> executor protocol (``inflight.executor.v2``).
The Python stubs are generated next to them (``generation_pb2.py`` ...) by
``python -m protos`` (``make protos``); when they are missing or older than the
``.proto`` files and grpcio-tools is installed, importing this package generates
them, so a fresh checkout never runs stale stubs.

``plan.py`` holds the same contracts as plain dataclasses, which is what the rest
of the code uses: only one module per side (``scheduler_svc/wire.py``,
``executor_svc/wire.py``) touches generated protobuf classes.
"""

from __future__ import annotations

from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PROTO_FILES = ("generation.proto", "executor.proto")


def _stub_paths(proto: str) -> list[Path]:
    stem = proto.removesuffix(".proto")
    return [PROTO_DIR / f"{stem}_pb2.py", PROTO_DIR / f"{stem}_pb2_grpc.py"]


def stubs_are_fresh() -> bool:
    """True when every generated stub exists and is newer than its ``.proto``."""
    for proto in PROTO_FILES:
        source_mtime = (PROTO_DIR / proto).stat().st_mtime
        for stub in _stub_paths(proto):
            if not stub.exists() or stub.stat().st_mtime < source_mtime:
                return False
    return True


def compile_protos() -> None:
    """Generate the Python stubs with grpcio-tools' bundled protoc."""
    from grpc_tools import protoc  # build-time dependency only

    include = str(PROTO_DIR.parent)  # so generated code imports `protos.xxx_pb2`
    grpc_include = str(Path(protoc.__file__).resolve().parent / "_proto")
    for proto in PROTO_FILES:
        args = [
            "protoc",
            f"-I{include}",
            f"-I{grpc_include}",
            f"--python_out={include}",
            f"--pyi_out={include}",
            f"--grpc_python_out={include}",
            str(PROTO_DIR / proto),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto}")


def _ensure_stubs() -> None:
    if stubs_are_fresh():
        return
    try:
        compile_protos()
    except ImportError as exc:  # no grpcio-tools: only fail if stubs are missing
        if not all(p.exists() for proto in PROTO_FILES for p in _stub_paths(proto)):
            raise ImportError(
                "inflight's gRPC stubs are not generated and grpcio-tools is not "
                "installed; run `make protos` (or `pip install grpcio-tools` and "
                "`python -m protos`)"
            ) from exc


_ensure_stubs()
