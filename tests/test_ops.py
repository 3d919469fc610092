"""Operations: metrics and health over real HTTP, no password in any output, compose wiring."""

from __future__ import annotations

import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
import yaml
from click import Context

from reactor.cli.main import cli
from tests.support.cli import run_cli
from tests.support.doorbell import armed_by
from tests.support.env import Env
from tests.support.metrics import metric
from tests.support.paths import ROOT
from tests.support.processes import Process, start_reactor
from tests.support.rows import insert_rows, states
from tests.support.servers import RedisServer, free_port
from tests.support.sockets import listening_addresses
from tests.support.waiting import wait_for


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_metrics_and_health_over_http(env: Env, spawn: Callable[..., Process]) -> None:
    port = free_port()
    start_reactor(spawn, "--metrics-port", str(port), "--metrics-host", "127.0.0.1")
    base = f"http://127.0.0.1:{port}"
    assert get(base + "/healthz") == (200, "ok\n")
    conn = env.connect()
    wait_for(lambda: armed_by(conn), what="an idle reactor arming its doorbell")
    _, before = get(base + "/metrics")
    assert metric(before, "reactor_doorbell_armed") == 1
    insert_rows(conn, 7)
    wait_for(lambda: states(conn) == {"active": 7}, what="dispatch")

    def moved() -> str | None:
        _, text = get(base + "/metrics")
        # The type's series appears with its first dispatch.
        done = metric(text, 'reactor_dispatched_total{type="photo.process"}', 0) == 7
        return text if done else None

    text = wait_for(moved, what="dispatched counter")
    assert text is not None
    assert (
        metric(text, "reactor_notifications_total")
        >= 1
        > metric(before, "reactor_notifications_total")
    )
    assert metric(text, "reactor_claim_seconds_count") >= 1
    assert metric(text, "reactor_enqueue_seconds_count") >= 1
    assert metric(text, "reactor_listener_connected") == 1
    # A series the reactor does not expose is an error, not a 0 (a renamed metric would
    # otherwise pass every `== 0` and `<` assert).
    for absent in ('reactor_dispatched_total{type="photo.thumb"}', "reactor_no_such_total"):
        with pytest.raises(AssertionError, match="no series"):
            metric(text, absent)
    assert metric(text, 'reactor_dispatched_total{type="photo.thumb"}', 0) == 0

    # Take the listener away and keep it away (no new connections to this database).
    admin = psycopg.connect(env.pg_server_url, autocommit=True)
    env.cleanups.append(admin.close)
    admin.execute(f'ALTER DATABASE "{env.database_name}" ALLOW_CONNECTIONS false')
    try:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = %s AND application_name = 'photo-reactor listener'",
            [env.database_name],
        )

        def unhealthy() -> tuple[int, str] | None:
            status, text = get(base + "/healthz")
            return (status, text) if status == 503 else None

        found = wait_for(unhealthy, what="503 while disconnected")
        assert found is not None
        _, body = found
        assert "listener disconnected" in body
        assert metric(get(base + "/metrics")[1], "reactor_listener_connected") == 0
    finally:
        admin.execute(f'ALTER DATABASE "{env.database_name}" ALLOW_CONNECTIONS true')
    wait_for(lambda: get(base + "/healthz")[0] == 200, timeout=20, what="200 after reconnect")


@pytest.mark.slow
def test_healthz_is_503_from_the_third_failed_drain_and_200_once_redis_answers(
    env: Env, spawn: Callable[..., Process], private_redis: RedisServer
) -> None:
    """A hung Redis (SIGSTOP) makes every drain fail after --redis-timeout (3 s): the gap
    between two failures in which /healthz is read. Two failed retries are still healthy,
    the third is not, and the first drain that Redis takes makes it healthy again."""
    port = free_port()
    reactor = start_reactor(
        spawn, "--metrics-port", str(port), "--redis-timeout", "3", REDIS_URL=private_redis.url
    )
    base = f"http://127.0.0.1:{port}"
    conn = env.connect()
    assert get(base + "/healthz") == (200, "ok\n")
    private_redis.freeze()
    try:
        insert_rows(conn, 20)  # more than a notification names: a drain of the type
        reactor.wait_for_line("drain_retry attempt=2", timeout=60)
        # The third try is waiting out its 3 s on the hung Redis.
        assert get(base + "/healthz") == (200, "ok\n"), reactor.output()
        reactor.wait_for_line("drain_retry attempt=3", timeout=60)
        status, body = get(base + "/healthz")
        assert status == 503, body
        assert body.startswith("unhealthy: 3 failed drains or sweeps in a row: drain: "), body
    finally:
        private_redis.thaw()
    wait_for(lambda: states(conn) == {"active": 20}, timeout=30, what="the rows dispatched")
    wait_for(lambda: get(base + "/healthz") == (200, "ok\n"), timeout=30, what="200 again")


@pytest.mark.slow
def test_healthz_is_503_while_the_loop_stalls_and_200_once_it_turns(
    env: Env, spawn: Callable[..., Process], private_redis: RedisServer
) -> None:
    """A stall: the loop has not turned for max(2 x sweep interval, sweep interval + 10 s)
    (11 s here) with no failure to report, as when a claim waits on a hung Redis whose
    --redis-timeout (120 s) is longer than that."""
    port = free_port()
    reactor = start_reactor(
        spawn,
        "--metrics-port",
        str(port),
        "--sweep-interval",
        "1",
        "--redis-timeout",
        "120",
        REDIS_URL=private_redis.url,
    )
    base = f"http://127.0.0.1:{port}"
    conn = env.connect()
    private_redis.freeze()
    try:
        insert_rows(conn, 20)

        def stalled() -> str:
            status, body = get(base + "/healthz")
            return body if status == 503 else ""

        body = wait_for(stalled, timeout=60, interval=0.2, what="/healthz 503")
        assert re.fullmatch(r"unhealthy: main loop stalled for \d+s\n", body), body
        assert "_retry" not in reactor.output(), "a stall, not failed drains"
    finally:
        private_redis.thaw()
    wait_for(lambda: states(conn) == {"active": 20}, timeout=30, what="the rows dispatched")
    wait_for(lambda: get(base + "/healthz") == (200, "ok\n"), timeout=30, what="200 again")


def test_metrics_bind_loopback_unless_told_otherwise(
    env: Env, spawn: Callable[..., Process]
) -> None:
    """What the kernel says the reactor listens on: 127.0.0.1 by default (a connection to
    127.0.0.1 would also reach a server bound to every address), the address given with
    --metrics-host otherwise (another loopback address here: the reader tells them apart)."""
    port, other_port = free_port(), free_port()
    default = start_reactor(spawn, "--metrics-port", str(port))
    assert wait_for(lambda: listening_addresses(default.proc.pid), what="the metrics socket") == {
        ("127.0.0.1", port)
    }
    told = start_reactor(
        spawn, "--metrics-port", str(other_port), "--metrics-host", "127.0.0.2", name="told"
    )
    assert wait_for(lambda: listening_addresses(told.proc.pid), what="the metrics socket") == {
        ("127.0.0.2", other_port)
    }


def test_no_password_in_any_output(env: Env, spawn: Callable[..., Process]) -> None:
    pg_secret, redis_secret = "pg-Secret-4417", "redis-Secret-9923"
    admin = env.connect()
    admin.execute(f"CREATE ROLE reactor_pw LOGIN SUPERUSER PASSWORD '{pg_secret}'")

    def drop_role() -> None:
        with psycopg.connect(env.pg_server_url, autocommit=True) as conn:
            conn.execute("DROP ROLE IF EXISTS reactor_pw")

    env.cleanups.append(drop_role)
    parts = urllib.parse.urlsplit(env.database_url)
    netloc = f"reactor_pw:{pg_secret}@{parts.hostname}:{parts.port or 5432}"
    database_url = urllib.parse.urlunsplit(parts._replace(netloc=netloc))
    secured = RedisServer(password=redis_secret)
    env.cleanups.append(secured.close)
    reactor = start_reactor(
        spawn,
        "--sweep-interval",
        "0.5",
        REACTOR_LOG_LEVEL="DEBUG",
        DATABASE_URL=database_url,
        REDIS_URL=secured.url,
    )
    insert_rows(admin, 3)
    wait_for(lambda: states(admin) == {"active": 3}, what="dispatch with passwords")
    # Failures of both connections, each of which logs its error.
    admin.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = 'reactor_pw'"
    )
    reactor.wait_for_line("connection_lost")
    secured.stop()
    insert_rows(admin, 2, prefix="q")
    reactor.wait_for_line("drain_retry")
    secured.start()
    wait_for(lambda: states(admin).get("pending", 0) == 0, timeout=30, what="recovery")
    reactor.stop()
    bad = run_cli(
        env,
        "run",
        extra_env={
            "DATABASE_URL": database_url.replace(f":{parts.port or 5432}/", ":1/"),
            "REDIS_URL": secured.url,
        },
    )
    assert bad.returncode == 2
    everything = reactor.output() + bad.stdout + bad.stderr
    assert "connection_lost" in everything and "drain_retry" in everything
    assert pg_secret not in everything
    assert redis_secret not in everything


def cli_env_vars() -> set[str]:
    names: set[str] = set()
    with Context(cli) as ctx:
        for command in cli.commands.values():
            for param in command.get_params(ctx):
                envvar = getattr(param, "envvar", None)
                if isinstance(envvar, str):
                    names.add(envvar)
        for param in cli.get_params(ctx):
            if isinstance(getattr(param, "envvar", None), str):
                names.add(param.envvar)  # type: ignore[arg-type]
    # Read outside click: routes (comma-separated) and the worker-side settings.
    return names | {
        "REACTOR_ROUTES",
        "REACTOR_RETRY_BASE_SECONDS",
        "REACTOR_RETRY_MAX_SECONDS",
        "REACTOR_HEARTBEAT_SECONDS",
        "REACTOR_HANDLER_PREFIXES",
    }


def test_compose_wiring() -> None:
    compose: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    # `docker compose up` starts these; the `monitoring` profile's: tests/test_deploy.py.
    services = {k: v for k, v in compose["services"].items() if "profiles" not in v}
    assert set(services) == {"postgres", "redis", "migrate", "reactor", "worker", "producer"}
    every = compose["services"]
    traced = {"jaeger", "reactor-traced", "worker-traced", "producer-traced"}
    # The tracing profile: its own type and queue (so the plain flow's processes, which also
    # run under that profile, never take its rows), every process under opentelemetry-instrument.
    assert all(every[name]["profiles"] == ["tracing"] for name in traced)
    assert every["reactor-traced"]["command"][-1].startswith("photo.traced=")
    assert every["reactor-traced"]["command"][-1].endswith("@photo-traced")
    assert every["worker-traced"]["command"] == ["worker", "photo-traced"]
    assert "--type photo.traced" in every["producer-traced"]["command"][0]
    assert "opentelemetry-instrument reactor submit" in every["producer-traced"]["command"][0]
    for name in ("reactor-traced", "worker-traced"):
        assert every[name]["entrypoint"] == ["opentelemetry-instrument", "reactor"]
        assert every[name]["build"]["args"]["EXTRAS"] == "[otel]"
        assert every[name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318"
    for name in ("postgres", "redis"):
        assert "image" in services[name] and "healthcheck" in services[name]
    for name in ("migrate", "reactor", "worker", "producer"):
        assert services[name]["build"] == "."
    assert services["migrate"]["command"] == ["migrate"]
    assert services["reactor"]["command"][0] == "run"
    # `reactor worker` (the image's entrypoint is `reactor`)
    assert "entrypoint" not in services["worker"] and services["worker"]["command"][0] == "worker"
    assert services["producer"]["command"][0] == "submit"
    assert set(cli.commands) >= {
        "migrate",
        "run",
        "worker",
        "submit",
        "status",
        "sweep",
        "requeue",
        "prune",
    }
    for name in ("migrate", "reactor"):
        assert services[name]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["reactor"]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert (
        services["reactor"]["depends_on"]["migrate"]["condition"]
        == "service_completed_successfully"
    )
    assert (
        services["worker"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    )
    known = cli_env_vars() | {"DATABASE_URL", "REDIS_URL", "REACTOR_TRACE_RELATIONSHIP"}
    for name, service in services.items():
        if "build" not in service:
            continue
        for var in service.get("environment", {}):
            # OTEL_*: read by opentelemetry-instrument.
            assert var in known or var.startswith("OTEL_"), (
                f"{name} sets {var}, which nothing reads"
            )
    # The worker's queue is the default route's queue.
    assert "photo-process" in services["worker"]["command"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["reactor"]' in dockerfile and "COPY sql ./sql" in dockerfile
