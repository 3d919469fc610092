"""The bounded HTTP server (`reactor.http_server`) on its own, in this process: a body read to
its end on a connection closed meanwhile is never handed to the handler, so no action runs
with no one to answer."""

from __future__ import annotations

import io
import select
import socket
import struct
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest

from reactor import http_server
from reactor.http_server import BoundedHTTPServer
from tests.support.waiting import wait_for

BODY = b'{"type": "photo.process", "photo_ids": ["p1"]}'


def shut_for_reading(sock: socket.socket) -> bool:
    """Whether the server has ended `sock`'s reads (`shutdown`): a read finds EOF at once."""
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""


def reset_arrived(sock: socket.socket) -> bool:
    """Whether the peer has reset `sock` (or closed it): a read fails, or finds EOF, at once."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except ConnectionError:
        return True


class LastByteCut(io.BufferedIOBase):
    """The handler's rfile, but a new connection arrives (taking the only place, which closes
    this one) just after the body's last byte is read, before the server hears of it."""

    def __init__(self, rfile: Any, request: socket.socket, port: int, length: int) -> None:
        self._rfile, self._request, self._port, self._left = rfile, request, port, length
        self.newcomer: socket.socket | None = None

    def read1(self, size: int = -1) -> bytes:
        part: bytes = self._rfile.read1(size)
        self._left -= len(part)
        if self._left == 0:
            self.newcomer = socket.create_connection(("127.0.0.1", self._port))
            wait_for(lambda: shut_for_reading(self._request), what="the connection closed")
        return part


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[BoundedHTTPServer, list[Any]]]:
    """A server holding one connection at once, whose POST handler reads its body through
    `LastByteCut` and answers 200 only if it got the body; what `read_body` returned."""
    monkeypatch.setattr(http_server, "MAX_CLIENTS", 1)
    got: list[Any] = []
    newcomers: list[socket.socket] = []

    class Handler(BaseHTTPRequestHandler):
        timeout = 30

        def do_POST(self) -> None:
            length = int(self.headers["Content-Length"])
            rfile = LastByteCut(self.rfile, self.request, bound.server_address[1], length)
            body = bound.read_body(self.request, rfile, length)
            got.append(body)
            if rfile.newcomer is not None:
                newcomers.append(rfile.newcomer)
            if body is not None:  # an action would run here
                self.send_response(200)
                self.end_headers()

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

    bound = BoundedHTTPServer(("127.0.0.1", 0), Handler, 30.0)
    thread = threading.Thread(target=bound.serve_forever, daemon=True)
    thread.start()
    yield bound, got
    bound.shutdown()
    bound.server_close()
    thread.join(timeout=10)
    for sock in newcomers:
        sock.close()


def test_a_body_whose_connection_is_closed_after_its_last_byte_is_not_handed_over(
    server: tuple[BoundedHTTPServer, list[Any]],
) -> None:
    bound, got = server
    head = (
        f"POST /api/cancel HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(BODY)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", bound.server_address[1])) as client:
        client.sendall(head + BODY)
        client.settimeout(30)
        assert client.recv(1024) == b""  # closed, unanswered
    wait_for(lambda: got, what="the handler done")
    assert got == [None]


def test_a_client_that_resets_its_connection_is_not_reported_on_stderr(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """A client gone while its request is read or answered (a reset: SO_LINGER 0) is its own
    business: no traceback on stderr, where socketserver prints one by default."""
    answered = threading.Event()
    ended: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        timeout = 30

        def finish(self) -> None:  # called however the request ended
            ended.append("")
            super().finish()

        def do_GET(self) -> None:
            wait_for(lambda: reset_arrived(self.request), what="the client's reset")
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"x" * 1_000_000)
            answered.set()

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

    bound = BoundedHTTPServer(("127.0.0.1", 0), Handler, 30.0)
    thread = threading.Thread(target=bound.serve_forever, daemon=True)
    thread.start()
    try:
        for _ in range(5):
            sock = socket.create_connection(("127.0.0.1", bound.server_address[1]))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
            sock.close()
        # `_open` drops once a connection's error, if any, has been dealt with.
        wait_for(lambda: len(ended) == 5 and bound._open == 0, what="every connection ended")
    finally:
        bound.shutdown()
        bound.server_close()
        thread.join(timeout=10)
    assert not answered.is_set()  # each answer failed on the reset
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Error" not in err, err
