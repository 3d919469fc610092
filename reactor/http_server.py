"""The threaded HTTP server under `reactor run`'s `/metrics` and `/healthz` and under `reactor
dashboard`: a thread per connection, at most `MAX_CLIENTS` connections at once.

- A connection counts as *sending* from its arrival until its handler calls `request_read`
  (its request line and headers are in, and the body it takes, read with `read_body`). Given
  `request_seconds`, a connection still sending that long after it arrived is closed, however
  it trickles (a header line, or a byte of body, every few seconds); checked at every turn of
  the accept loop (`service_actions`), and by `read_body` itself.
- A new connection beyond the limit closes the oldest one still sending (idle and slow clients
  are those), so a crowd of them can take neither every thread nor every file descriptor, and
  a fresh request (a health probe, a person reloading the page) is still served. Only when all
  are being answered is the new one closed at once.
- Each server's handler sets its socket timeout, which bounds how long a silent client holds
  its place.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from io import BufferedIOBase
from typing import Any

__all__ = ["MAX_CLIENTS", "BoundedHTTPServer"]

#: Connections held at once; a new one beyond this closes the oldest still sending its request.
MAX_CLIENTS = 32


class BoundedHTTPServer(ThreadingHTTPServer):
    """A `ThreadingHTTPServer` holding at most `MAX_CLIENTS` connections (see the module)."""

    daemon_threads = True
    # Room for a burst of connections while the accept loop starts their threads.
    request_queue_size = 128

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        request_seconds: float | None = None,
    ) -> None:
        self._request_seconds = request_seconds
        self._lock = threading.Lock()
        self._open = 0
        # Connections still sending their request, in arrival order, with their deadline.
        self._sending: dict[socket.socket, float] = {}
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            if self._open >= MAX_CLIENTS:
                if not self._sending:
                    self.shutdown_request(request)
                    return
                oldest = next(iter(self._sending))
                del self._sending[oldest]
                _cut(oldest)
            self._open += 1
            seconds = self._request_seconds
            self._sending[request] = float("inf") if seconds is None else time.monotonic() + seconds
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._closed(request)
            raise

    def request_read(self, request: socket.socket) -> None:
        """`request` has sent its request line and headers: it is being answered."""
        with self._lock:
            self._sending.pop(request, None)

    def read_body(self, request: socket.socket, rfile: BufferedIOBase, length: int) -> bytes | None:
        """`length` bytes of `request`'s body, read by its deadline: the request is read then
        (`request_read`). None when they have not all come by then: the connection is closed,
        unanswered, as one whose headers are late. Until then it may be closed to make room."""
        with self._lock:
            deadline = self._sending.get(request)
        parts: list[bytes] = []
        got = 0
        previous = request.gettimeout()
        try:
            while deadline is not None and got < length:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                # The whole body by the deadline: a byte every few seconds does not reset it.
                request.settimeout(None if left == float("inf") else left)
                part = rfile.read1(min(length - got, 65536))
                if not part:
                    break
                parts.append(part)
                got += len(part)
        except OSError:  # timed out, or closed by `service_actions` or a new connection
            pass
        finally:
            with contextlib.suppress(OSError):
                request.settimeout(previous)
        if got < length:
            _cut(request)
            return None
        self.request_read(request)
        return b"".join(parts)

    def service_actions(self) -> None:
        now = time.monotonic()
        with self._lock:
            late = [sock for sock, deadline in self._sending.items() if deadline <= now]
            for sock in late:
                del self._sending[sock]
                _cut(sock)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._closed(request)

    def _closed(self, request: socket.socket) -> None:
        with self._lock:
            self._open -= 1
            self._sending.pop(request, None)


def _cut(sock: socket.socket) -> None:
    """End a connection's reads at once: its thread's read returns and the thread ends."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
