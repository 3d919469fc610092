"""Throwaway Postgres and Redis servers for the test suite, started from binaries on PATH.

Used when no server URL is given and no Docker engine answers. Every server listens on
127.0.0.1 only, on a free port, with its data in a temporary directory that is removed when it
stops. `RedisServer` can be stopped and started again on the same port, which the fault tests
use to take Redis away from a running reactor.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

__all__ = ["PostgresServer", "RedisServer", "find_binary", "free_port", "wait_port"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.02)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


def find_binary(name: str) -> str | None:
    """`name` on PATH, else in the usual Debian location of PostgreSQL's binaries."""
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)
    return candidates[0] if candidates else None


class PostgresServer:
    """A private PostgreSQL cluster (initdb + postgres), loopback only; trust auth, or
    password auth (scram-sha-256) for the superuser `postgres` when `password` is given.
    `fsync` is off unless `settings` (extra `-c name=value` server settings) turn it on."""

    def __init__(self, password: str | None = None, settings: dict[str, str] | None = None) -> None:
        initdb, postgres = find_binary("initdb"), find_binary("postgres")
        if not initdb or not postgres:
            raise RuntimeError(
                "no initdb/postgres binaries found on PATH or in /usr/lib/postgresql"
            )
        self._dir = tempfile.mkdtemp(prefix="reactor-pg-")
        self.port = free_port()
        data = Path(self._dir) / "data"
        # postgres refuses to run as root: drop to the system's postgres user if we are root.
        prefix: list[str] = []
        if os.geteuid() == 0:
            try:
                account = pwd.getpwnam("postgres")
            except KeyError:
                raise RuntimeError(
                    "running as root and no 'postgres' user to run postgres as"
                ) from None
            os.chown(self._dir, account.pw_uid, account.pw_gid)
            prefix = ["runuser", "-u", "postgres", "--"]
        auth = ["-A", "trust"]
        if password:
            pwfile = Path(self._dir) / "pwfile"
            pwfile.write_text(password + "\n")
            if prefix:
                os.chown(pwfile, account.pw_uid, account.pw_gid)
            auth = ["-A", "scram-sha-256", f"--pwfile={pwfile}"]
        subprocess.run(
            [*prefix, initdb, "-D", str(data), *auth, "-U", "postgres", "--no-sync"],
            check=True,
            capture_output=True,
        )
        self._proc = subprocess.Popen(
            [
                *prefix,
                postgres,
                "-D",
                str(data),
                "-p",
                str(self.port),
                "-k",
                self._dir,
                "-c",
                "listen_addresses=127.0.0.1",
                *(
                    arg
                    for name, value in {"fsync": "off", **(settings or {})}.items()
                    for arg in ("-c", f"{name}={value}")
                ),
                "-c",
                "max_connections=200",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_port(self.port)
        self._wait_ready()
        userinfo = f"postgres:{password}" if password else "postgres"
        self.url = f"postgresql://{userinfo}@127.0.0.1:{self.port}/postgres"

    def _wait_ready(self, timeout: float = 60.0) -> None:
        """Until the server accepts connections (the port opens before recovery ends)."""
        isready = find_binary("pg_isready")
        if isready is None:
            return
        deadline = time.monotonic() + timeout
        command = [isready, "-q", "-h", "127.0.0.1", "-p", str(self.port)]
        while subprocess.run(command, check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"postgres on port {self.port} not ready after {timeout}s")
            time.sleep(0.05)

    def stop(self) -> None:
        self._proc.terminate()
        self._proc.wait(timeout=30)
        shutil.rmtree(self._dir, ignore_errors=True)


class RedisServer:
    """A private redis-server with no persistence; stop() and start() keep its port."""

    def __init__(self, port: int | None = None, password: str | None = None) -> None:
        binary = find_binary("redis-server")
        if not binary:
            raise RuntimeError("no redis-server binary found on PATH")
        self._binary = binary
        self._dir = tempfile.mkdtemp(prefix="reactor-redis-")
        self.port = port or free_port()
        self.password = password
        self._proc: subprocess.Popen[bytes] | None = None
        auth = f":{password}@" if password else ""
        self.url = f"redis://{auth}127.0.0.1:{self.port}/0"
        self.start()

    def start(self) -> None:
        args = [
            self._binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self._dir,
        ]
        if self.password:
            args += ["--requirepass", self.password]
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port)

    def stop(self) -> None:
        """Kill the server (SIGKILL: no persistence, so its data is gone)."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(timeout=30)
            self._proc = None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) != 0:
                    return
            time.sleep(0.02)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)
