"""A datagram socket bound as systemd binds its notify socket: the messages a process sends
with `NOTIFY_SOCKET` set, each with the time it arrived."""

from __future__ import annotations

import socket
import threading
import time

from tests.support.waiting import wait_for


class NotifySocket:
    """A bound datagram socket, as systemd's; every message with the time it arrived."""

    def __init__(self, address: str | bytes) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.messages: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(4096)
            except OSError:
                return
            self.messages.append((time.monotonic(), data.decode()))

    def times(self, message: str, since: float = float("-inf")) -> list[float]:
        return [at for at, text in self.messages if text == message and at > since]

    def wait(self, message: str, since: float = float("-inf"), count: int = 1) -> float:
        """When the `count`-th `message` after `since` came."""
        got = wait_for(
            lambda: len(self.times(message, since)) >= count,
            timeout=30,
            what=f"{count} x {message!r} (heard: {self.messages[-5:]})",
        )
        assert got
        return self.times(message, since)[count - 1]

    def close(self) -> None:
        self.sock.close()
