"""Throwaway Postgres and Redis servers for the test suite, started from binaries on PATH.

Used when no server URL is given and no Docker engine answers, and by the tests that need a
server of their own. Every server listens on 127.0.0.1 only, on a free port, with its data in a
temporary directory that is removed when it stops. `RedisServer` can be stopped and started
again on the same port, which the fault tests use to take Redis away from a running reactor,
and frozen (SIGSTOP) and thawed, to hang it.
For the failover tests: a `PostgresServer` can be a streaming standby of another
(`pg_basebackup -R`), promoted, and stopped in immediate mode; a `RedisServer` can be a
replica; `SentinelServer` is a `redis-server --sentinel`; `PgBouncer` is a pooler in
transaction mode in front of a Postgres server.
"""

from __future__ import annotations

import glob
import os
import pwd
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg

__all__ = [
    "PgBouncer",
    "PostgresServer",
    "RedisServer",
    "SentinelServer",
    "find_binary",
    "free_port",
    "wait_port",
]


#: Ports handed out start here, below the kernel's ephemeral range (`_ephemeral_low`).
_FIRST_PORT = 20000


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port nothing listens on now, below the ephemeral range: a port of that range may be
    taken meanwhile as the source port of any outgoing connection, and `wait_port`'s own
    connect to it can then connect to itself (a standby on such a port never became ready)."""
    low = _ephemeral_low()
    for _ in range(500):
        port = random.randrange(_FIRST_PORT, low) if low > _FIRST_PORT + 1000 else 0
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(sock.getsockname()[1])
    raise RuntimeError("no free port below the ephemeral range")


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

    def __init__(
        self,
        password: str | None = None,
        settings: dict[str, str] | None = None,
        standby_of: PostgresServer | None = None,
        port: int | None = None,
    ) -> None:
        initdb, postgres = find_binary("initdb"), find_binary("postgres")
        if not initdb or not postgres:
            raise RuntimeError(
                "no initdb/postgres binaries found on PATH or in /usr/lib/postgresql"
            )
        self._dir = tempfile.mkdtemp(prefix="reactor-pg-")
        self.port = port or free_port()
        data = self._data = Path(self._dir) / "data"
        # postgres refuses to run as root: drop to the system's postgres user if we are root.
        prefix: list[str] = []
        if os.geteuid() == 0:
            try:
                account = pwd.getpwnam("postgres")
            except KeyError:
                raise RuntimeError(
                    "running as root and no 'postgres' user to run postgres as"
                ) from None
            if shutil.which("runuser") is None:
                raise RuntimeError(
                    "running as root: postgres must run as the 'postgres' user, through "
                    "runuser (util-linux), which is not installed"
                )
            os.chown(self._dir, account.pw_uid, account.pw_gid)
            prefix = ["runuser", "-u", "postgres", "--"]
        self._prefix = prefix
        if standby_of is not None:
            # A streaming standby: a base backup of the primary, with its primary_conninfo
            # and standby.signal written by -R.
            basebackup = find_binary("pg_basebackup")
            if not basebackup:
                raise RuntimeError("no pg_basebackup binary found")
            subprocess.run(
                [
                    *prefix,
                    basebackup,
                    "-h",
                    "127.0.0.1",
                    "-p",
                    str(standby_of.port),
                    "-U",
                    "postgres",
                    "-D",
                    str(data),
                    "-R",
                    "-X",
                    "stream",
                    "--no-sync",
                ],
                check=True,
                capture_output=True,
            )
        else:
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

    def promote(self) -> None:
        """Promote this standby to a primary (waits until it takes writes)."""
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute("SELECT pg_promote(true, 60)")

    def stop_immediate(self) -> None:
        """Stop the server the way a crash would (`pg_ctl stop -m immediate`); keep its data."""
        pg_ctl = find_binary("pg_ctl")
        if pg_ctl and self._proc.poll() is None:
            subprocess.run(
                [*self._prefix, pg_ctl, "stop", "-D", str(self._data), "-m", "immediate"],
                check=False,
                capture_output=True,
            )
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait(timeout=30)

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.stop_immediate()
        shutil.rmtree(self._dir, ignore_errors=True)


class RedisServer:
    """A private redis-server with no persistence; stop() and start() keep its port."""

    def __init__(
        self, port: int | None = None, password: str | None = None, replica_of: int | None = None
    ) -> None:
        binary = find_binary("redis-server")
        if not binary:
            raise RuntimeError("no redis-server binary found on PATH")
        self._binary = binary
        self._dir = tempfile.mkdtemp(prefix="reactor-redis-")
        self.port = port or free_port()
        self.password = password
        self.replica_of = replica_of
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
            args += ["--requirepass", self.password, "--masterauth", self.password]
        if self.replica_of is not None:
            args += ["--replicaof", "127.0.0.1", str(self.replica_of)]
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

    def freeze(self) -> None:
        """SIGSTOP the server: a hung Redis (connections stay open, nothing answers)."""
        assert self._proc is not None
        self._proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT a frozen server: it answers what waited meanwhile."""
        assert self._proc is not None
        self._proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)


class SentinelServer:
    """A `redis-server --sentinel` watching the master at 127.0.0.1:`master_port` as
    `master_name` (its config file is generated; Sentinel rewrites it as it learns)."""

    def __init__(
        self,
        master_port: int,
        master_name: str = "mymaster",
        *,
        quorum: int = 2,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 5000,
    ) -> None:
        binary = find_binary("redis-server")
        if not binary:
            raise RuntimeError("no redis-server binary found on PATH")
        self._dir = tempfile.mkdtemp(prefix="reactor-sentinel-")
        self.port = free_port()
        config = Path(self._dir) / "sentinel.conf"
        config.write_text(
            f"port {self.port}\n"
            "bind 127.0.0.1\n"
            f"dir {self._dir}\n"
            f"sentinel monitor {master_name} 127.0.0.1 {master_port} {quorum}\n"
            f"sentinel down-after-milliseconds {master_name} {down_after_ms}\n"
            f"sentinel failover-timeout {master_name} {failover_timeout_ms}\n"
            f"sentinel parallel-syncs {master_name} 1\n"
        )
        self._proc = subprocess.Popen(
            [binary, str(config), "--sentinel"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_port(self.port)

    def close(self) -> None:
        self._proc.kill()
        self._proc.wait(timeout=30)
        shutil.rmtree(self._dir, ignore_errors=True)


class PgBouncer:
    """PgBouncer in transaction mode in front of the Postgres at `host:port`, on a free port
    of 127.0.0.1, with `pool_size` server connections per database and user. Clients connect
    as `user` without a password (PgBouncer's `auth_type = any`; it logs in as `user`)."""

    def __init__(self, binary: str, host: str, port: int, user: str, pool_size: int = 3) -> None:
        self._dir = tempfile.mkdtemp(prefix="reactor-pgbouncer-")
        self.port = free_port()
        config = Path(self._dir) / "pgbouncer.ini"
        config.write_text(
            "[databases]\n"
            f"* = host={host} port={port} user={user}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = any\n"
            "pool_mode = transaction\n"
            f"default_pool_size = {pool_size}\n"
            "max_client_conn = 500\n"
            "server_reset_query =\n"
            "ignore_startup_parameters = extra_float_digits\n"
            f"logfile = {self._dir}/pgbouncer.log\n"
        )
        # PgBouncer refuses to run as root: run it as the postgres user then.
        prefix: list[str] = []
        if os.geteuid() == 0:
            account = pwd.getpwnam("postgres")
            os.chown(self._dir, account.pw_uid, account.pw_gid)
            os.chown(config, account.pw_uid, account.pw_gid)
            prefix = ["runuser", "-u", "postgres", "--"]
        self._proc = subprocess.Popen(
            [*prefix, binary, str(config)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_port(self.port)

    def log(self) -> str:
        path = Path(self._dir) / "pgbouncer.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def close(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)
