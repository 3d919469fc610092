"""The threaded HTTP server under `reactor run`'s `/metrics` and `/healthz` and under `reactor
dashboard`: a thread per connection, at most `MAX_CLIENTS` connections at once.

- A connection counts as *sending* from its arrival until its handler calls `request_read`
  (its request line and headers are in, and the body it takes, read with `read_body`). Given
  `request_seconds`, a connection still sending that long after it arrived is closed, however
  it trickles (a header line every few seconds); checked at every turn of the accept loop
  (`service_actions`). A body (`read_body`, for a request its headers allow to send one) has
  that time plus a second per `BODY_BYTES_PER_SECOND` bytes it declares, and no silence longer
  than the handler's socket timeout; `read_body` keeps that deadline itself and answers 408
  (one line) when it runs out.
- A new connection beyond the limit closes the oldest one still sending (idle and slow clients
  are those), so a crowd of them can take neither every thread nor every file descriptor, and
  a fresh request (a health probe, a person reloading the page) is still served. Only when all
  are being answered is the new one closed at once. A body read to its end on a connection
  closed meanwhile is never handed over: no one could be told what came of it.
- A request answered without its body being read (refused on its headers) is closed with
  `linger`: closing a socket that holds unread bytes makes Linux reset the connection, which
  can destroy the answer before the client reads it. It still counts as sending meanwhile.
- Each server's handler sets its socket timeout, which bounds how long a silent client holds
  its place.
- A client that resets or closes its connection while its request is read or answered is its
  own business: one debug line (`http_client_gone`), never socketserver's traceback on stderr
  (which bypasses logging: a JSON log would get 20 lines of text). Any other error escaping a
  handler is logged (`http_request_failed`, with its traceback), a few times a second at most.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
import threading
import time
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from io import BufferedIOBase
from typing import Any

from reactor.throttle import LogThrottle

__all__ = [
    "BODY_BYTES_PER_SECOND",
    "LINGER_SECONDS",
    "MAX_BODY_BYTES",
    "MAX_CLIENTS",
    "BoundedHTTPServer",
    "body_length",
]

logger = logging.getLogger(__name__)

#: Connections held at once; a new one beyond this closes the oldest still sending its request.
MAX_CLIENTS = 32
#: The largest body a handler reads, and the most unread bytes `linger` drops before closing.
MAX_BODY_BYTES = 4 * 1024 * 1024
#: The slowest upload `read_body` waits for: a second more per this many bytes of the body.
BODY_BYTES_PER_SECOND = 64 * 1024
#: The least time `linger` gives a client to stop sending after its answer.
LINGER_SECONDS = 1.0
#: Handler errors logged: a few a second at most (any client can cause them).
_failed_log = LogThrottle(burst=5, interval_seconds=10.0)
_LATE = b"408 request timeout: the body did not arrive in time\n"
_LATE_REPLY = (
    b"HTTP/1.0 408 Request Timeout\r\nContent-Type: text/plain; charset=utf-8\r\n"
    b"Content-Length: %d\r\nX-Content-Type-Options: nosniff\r\nConnection: close\r\n\r\n%s"
) % (len(_LATE), _LATE)


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
        # Of those, the ones whose body `read_body` reads: it keeps their deadline itself.
        self._reading: set[socket.socket] = set()
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

    def request_read(self, request: socket.socket) -> bool:
        """`request` has sent its request line and headers (and body): it is being answered.
        False when it was closed already (late, or to make room): there is no one to answer."""
        with self._lock:
            return self._sending.pop(request, None) is not None

    def read_body(self, request: socket.socket, rfile: BufferedIOBase, length: int) -> bytes | None:
        """`length` bytes of `request`'s body, for a request its headers allow to send one:
        they must come by its deadline plus a second per `BODY_BYTES_PER_SECOND`, with no
        silence longer than its socket timeout; the request is read then (`request_read`).
        None when they do not, or when the connection was closed meanwhile to make room: the
        client has been answered 408 if it still could be, and the connection ends."""
        with self._lock:
            deadline = self._sending.get(request)
            if deadline is not None:
                deadline += length / BODY_BYTES_PER_SECOND
                self._sending[request] = deadline
                self._reading.add(request)
        parts: list[bytes] = []
        got = 0
        silence = request.gettimeout()
        try:
            while deadline is not None and got < length:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                # The whole body by the deadline: a byte every few seconds does not reset it.
                request.settimeout(_shorter(left, silence))
                part = rfile.read1(min(length - got, 65536))
                if not part:
                    break
                parts.append(part)
                got += len(part)
        except OSError:  # timed out, or closed by a new connection
            pass
        finally:
            with contextlib.suppress(OSError):
                request.settimeout(silence)
            with self._lock:
                self._reading.discard(request)
                late = got < length and request in self._sending
                if late:  # a moment to be told so, not closed by the accept loop meanwhile
                    self._sending[request] = time.monotonic() + LINGER_SECONDS
        if late:
            with contextlib.suppress(OSError):
                request.sendall(_LATE_REPLY)
            self.linger(request)
        if got < length or not self.request_read(request):
            return None
        return b"".join(parts)

    def linger(self, request: socket.socket) -> None:
        """`request` has been answered with its body unread: stop writing, then read and drop
        what the client still sends (at most `MAX_BODY_BYTES`) until its deadline, and at least
        `LINGER_SECONDS`, so that the answer is not destroyed by a reset. Until it ends, it
        counts as sending (a new connection may close it to make room)."""
        with self._lock:
            deadline = self._sending.get(request)
            if deadline is None:
                return
            until = max(deadline, time.monotonic() + LINGER_SECONDS)
            self._sending[request] = until
        silence = request.gettimeout()
        dropped = 0
        with contextlib.suppress(OSError):  # timed out, reset, or closed to make room
            request.shutdown(socket.SHUT_WR)
            while dropped < MAX_BODY_BYTES and (left := until - time.monotonic()) > 0:
                request.settimeout(_shorter(left, silence))
                part = request.recv(65536)
                if not part:
                    break
                dropped += len(part)

    def service_actions(self) -> None:
        now = time.monotonic()
        with self._lock:
            late = [
                sock
                for sock, deadline in self._sending.items()
                if deadline <= now and sock not in self._reading
            ]
            for sock in late:
                del self._sending[sock]
                _cut(sock)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Called by socketserver inside the `except` of the handler's exception.
        exc = sys.exc_info()[1]
        client = client_address[0] if isinstance(client_address, tuple) else client_address
        if isinstance(exc, ConnectionError | TimeoutError):  # the client went away, or stalled
            logger.debug("http_client_gone client=%s error=%s", client, type(exc).__name__)
        elif _failed_log.allow():
            logger.error(
                "http_request_failed client=%s error=%s suppressed=%d",
                client,
                type(exc).__name__,
                _failed_log.suppressed(),
                exc_info=exc,
            )

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._closed(request)

    def _closed(self, request: socket.socket) -> None:
        with self._lock:
            self._open -= 1
            self._sending.pop(request, None)


def body_length(headers: Message) -> int | None:
    """The length of a request's body (None: no Content-Length, or more than `MAX_BODY_BYTES`)."""
    try:
        length = int(headers.get("Content-Length", ""))
    except ValueError:
        return None
    return length if 0 <= length <= MAX_BODY_BYTES else None


def _shorter(left: float, silence: float | None) -> float | None:
    """A socket timeout: `left` seconds (inf: none), at most `silence` (None: none)."""
    if left == float("inf"):
        return silence
    return left if silence is None else min(left, silence)


def _cut(sock: socket.socket) -> None:
    """End a connection's reads at once: its thread's read returns and the thread ends."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
