"""The gRPC settings every inflight server and the scheduler's executor channel share."""

from __future__ import annotations

from typing import Protocol

MAX_MESSAGE_BYTES = 64 << 20  # a NewRequest carries whole prompts; a StepResult a batch's tokens

MESSAGE_SIZE_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]

# gRPC servers share a port by default (SO_REUSEPORT): a second inflight server started on a port that one
# already serves would bind without an error and take a share of its new connections, each client landing on
# either. Without sharing, the second one fails to bind and says so.
SERVER_OPTIONS: list[tuple[str, int]] = [*MESSAGE_SIZE_OPTIONS, ("grpc.so_reuseport", 0)]


class _Listens(Protocol):
    def add_insecure_port(self, address: str) -> int: ...


def listen(server: _Listens, address: str, what: str) -> int:
    """``server.add_insecure_port(address)``, or OSError naming ``what`` and the address when it cannot bind."""
    try:
        port = server.add_insecure_port(address)
    except RuntimeError:  # grpcio raises where older releases returned 0
        port = 0
    if port == 0:
        raise OSError(f"the {what} cannot listen on {address}: the port is in use, or the host is not this machine's")
    return port
