"""The server's process life: the listening socket bound before the model loads (a busy port is
reported at once), and a uvicorn server whose SIGTERM / Ctrl-C first drains the engine, so that
every open stream ends with its last chunk (finish_reason "abort") and `[DONE]` and the process
exits within a few seconds. Never touches requests or the model itself.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable
from types import FrameType

import uvicorn


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port), for `serve` to hand to uvicorn.

    Raises:
        OSError: with a message naming the address (in use, not permitted, unknown host).
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise OSError(f"cannot listen on {host}:{port}: unknown host ({err.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as err:
        sock.close()
        reason = "the port is in use" if err.errno == errno.EADDRINUSE else err.strerror or str(err)
        raise OSError(f"cannot listen on {host}:{port}: {reason}") from None
    sock.set_inheritable(True)
    return sock


class DrainingServer(uvicorn.Server):
    """A uvicorn server that calls `on_exit` (the engine's `drain`) on the first SIGTERM or
    SIGINT, before uvicorn stops accepting connections and waits for the open ones: drained
    streams finish within a step, so that wait is short."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit
        self._drained = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self._drained:
            self._drained = True
            self._on_exit()
        super().handle_exit(sig, frame)
