"""The threaded HTTP server under `reactor run`'s `/metrics` and `/healthz` and under `reactor
dashboard`: a thread per connection, at most `MAX_CLIENTS` connections at once.

A new connection beyond the limit closes the oldest one (idle clients are the oldest), so a
crowd of idle or slow clients can take neither every thread nor every file descriptor, and a
fresh request (a health probe, a person reloading the page) is still served. Each server's
handler sets its socket timeout, which bounds how long an idle client holds its place.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["MAX_CLIENTS", "BoundedHTTPServer"]

#: Connections held at once; a new one beyond this closes the oldest.
MAX_CLIENTS = 32


class BoundedHTTPServer(ThreadingHTTPServer):
    """A `ThreadingHTTPServer` holding at most `MAX_CLIENTS` connections (the oldest closed
    first)."""

    daemon_threads = True
    # Room for a burst of connections while the accept loop starts their threads.
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(address, handler)
        self._clients: dict[socket.socket, None] = {}  # in arrival order
        self._clients_lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._clients_lock:
            while len(self._clients) >= MAX_CLIENTS:
                oldest = next(iter(self._clients))
                del self._clients[oldest]
                with contextlib.suppress(OSError):
                    oldest.shutdown(socket.SHUT_RDWR)  # its thread's read returns, it exits
            self._clients[request] = None
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._clients_lock:
            self._clients.pop(request, None)
        super().shutdown_request(request)
