"""A TCP port that is already taken, reported as exactly that.

`specserve up`, the gateway and the draft and target services check their fixed port before they
start working (`check_port_free`, so that a second `specserve up` says so at once instead of after
loading models), and turn the real bind's EADDRINUSE into the same error
(`port_in_use_as_error`). The `specserve` CLI prints it as one line, exit status 1.
"""

from __future__ import annotations

import contextlib
import errno
import socket
from collections.abc import Iterator

# The default ports, declared here once: the gateway's HTTP API and the draft and target services' RPC.
GATEWAY_PORT, DRAFT_PORT, TARGET_PORT = 8000, 8101, 8102
GATEWAY_URL = f"http://127.0.0.1:{GATEWAY_PORT}"


class PortInUse(Exception):
    def __init__(self, port: int):
        super().__init__(f"port {port} is already in use (another specserve?)")
        self.port = port


@contextlib.contextmanager
def port_in_use_as_error(port: int) -> Iterator[None]:
    """Around a bind: EADDRINUSE becomes PortInUse(port)."""
    try:
        yield
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise PortInUse(port) from None
        raise


def check_port_free(host: str, port: int) -> None:
    """Raise PortInUse if (host, port) is taken now. Port 0 is always free. Binds the way an asyncio
    server does (SO_REUSEADDR), so a port whose old connections linger in TIME_WAIT is free. Any
    other failure (an unknown host, a privileged port) is left for the real bind to report."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUse(port) from None
