"""Past one machine, without failovers (those are in test_failover.py): Redis Sentinel URLs,
libpq multi-host URLs, read-only servers, PgBouncer in transaction mode, and the one-line
exit-2 errors of each kind of bad set-up."""

from __future__ import annotations

import os
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest
import redis

from reactor.errors import ConfigError, DatabaseError
from reactor.pg import db
from reactor.redact import redact
from reactor.rq.redis_url import client_for, parse_sentinel_url
from tests.handlers import SCHEMA
from tests.support.cli import run_cli
from tests.support.env import Env
from tests.support.processes import Process, start_reactor, start_worker
from tests.support.rows import insert_rows, states
from tests.support.rq_state import queue_ids
from tests.support.servers import PgBouncer, RedisServer, SentinelServer, find_binary, free_port
from tests.support.waiting import wait_for

# -- Sentinel URLs (no I/O) ---------------------------------------------------------------


def test_sentinel_url_parts() -> None:
    t = parse_sentinel_url("redis+sentinel://bob:s3cret@10.0.0.1:26379,[::1]:26380,h3/cache/4")
    assert t.sentinels == (("10.0.0.1", 26379), ("::1", 26380), ("h3", 26379))
    assert (t.master_name, t.db, t.username, t.password) == ("cache", 4, "bob", "s3cret")
    # The master's credentials go to the sentinels too, unless the query says otherwise.
    assert (t.sentinel_username, t.sentinel_password) == ("bob", "s3cret")
    t = parse_sentinel_url("redis+sentinel://:pw@h:1/m?sentinel_password=other")
    assert (t.username, t.password, t.sentinel_password, t.db) == (None, "pw", "other", 0)
    t = parse_sentinel_url("redis+sentinel://:pw@h:1/m/?sentinel_password=")
    assert (t.password, t.sentinel_password) == ("pw", None)


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("redis+sentinel://:hunter2@h:1", "no master name"),
        ("redis+sentinel://:hunter2@h:1/", "no master name"),
        ("redis+sentinel://:hunter2@/m", "no sentinel host"),
        ("redis+sentinel://:hunter2@h:1,/m", "no host"),
        ("redis+sentinel://:hunter2@h:99999/m", "bad sentinel port"),
        ("redis+sentinel://:hunter2@h:x/m", "bad sentinel port"),
        ("redis+sentinel://:hunter2@h:1/m/zero", "must be a number"),
        ("redis+sentinel://:hunter2@h:1/m/0/1", "/MASTER_NAME[/DB]"),
        ("redis+sentinel://:hunter2@h:1/m?password=hunter2", "unknown parameter"),
        ("redis+sentinel://:hunter2@[::1/m", "bad sentinel address"),
    ],
)
def test_malformed_sentinel_urls(url: str, needle: str) -> None:
    with pytest.raises(ConfigError) as caught:
        client_for(url)
    assert needle in str(caught.value)
    assert "hunter2" not in str(caught.value)


def test_sentinel_password_is_redacted() -> None:
    text = redact("redis+sentinel://:pw1@h:1/m?sentinel_password=pw2&x=1")
    assert "pw1" not in text and "pw2" not in text


# -- Postgres errors that mean "reconnect" ------------------------------------------------


def test_read_only_and_shutdown_errors_are_connection_failures(env: Env) -> None:
    conn = env.connect()
    conn.execute("CREATE TABLE t (id int PRIMARY KEY)")
    conn.execute("INSERT INTO t VALUES (1)")
    with pytest.raises(psycopg.Error) as duplicate:
        conn.execute("INSERT INTO t VALUES (1)")
    assert not db.is_connection_failure(duplicate.value)
    conn.execute("SET default_transaction_read_only = on")
    with pytest.raises(psycopg.Error) as read_only:
        conn.execute("INSERT INTO t VALUES (2)")
    assert read_only.value.sqlstate == "25006"
    assert db.is_connection_failure(read_only.value)
    wrapped = DatabaseError("claim failed")
    wrapped.__cause__ = read_only.value
    assert db.is_connection_failure(wrapped)
    victim = env.connect()
    conn.execute("SELECT pg_terminate_backend(%s)", [victim.info.backend_pid])
    with pytest.raises(psycopg.Error) as terminated:
        victim.execute("SELECT 1")
    assert db.is_connection_failure(terminated.value)


def test_prepared_statements_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert db.prepared_statements_enabled({}) is None  # each connection decides
    assert db.prepared_statements_enabled({db.PREPARED_STATEMENTS_ENV: "1"}) is True
    assert db.prepared_statements_enabled({db.PREPARED_STATEMENTS_ENV: "off"}) is False
    with pytest.raises(ConfigError):
        db.prepared_statements_enabled({db.PREPARED_STATEMENTS_ENV: "maybe"})
    monkeypatch.setattr(db, "_prepared_statements", True)
    assert db.prepared_statements_enabled({})


def prepared_after_ten_runs(conn: psycopg.Connection[Any]) -> int:
    for _ in range(10):
        conn.execute("SELECT 1 WHERE %s", [True])
    row = conn.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("autocommit", [True, False])
def test_a_direct_session_prepares_by_default_and_refusing_turns_it_off(
    env: Env, monkeypatch: pytest.MonkeyPatch, autocommit: bool
) -> None:
    monkeypatch.delenv(db.PREPARED_STATEMENTS_ENV, raising=False)
    with db.connect(env.database_url, autocommit=autocommit) as conn:
        assert db.direct_session(conn)
        assert prepared_after_ten_runs(conn) == 1
        assert conn.autocommit is autocommit
    monkeypatch.setenv(db.PREPARED_STATEMENTS_ENV, "0")
    with db.connect(env.database_url, autocommit=True) as conn:
        assert prepared_after_ten_runs(conn) == 0


#: A statement-level trigger runs inside the claim's own session, so it can read that
#: session's pg_prepared_statements (a view of the current session only) and note it.
NOTE_PREPARED = """
CREATE TABLE prepared_seen (app text NOT NULL, prepared int NOT NULL);
CREATE FUNCTION note_prepared() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO prepared_seen (app, prepared)
    SELECT current_setting('application_name'), count(*)
      FROM pg_prepared_statements WHERE NOT from_sql;
    RETURN NULL;
END $$;
CREATE TRIGGER note_prepared AFTER UPDATE ON photo_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION note_prepared();
"""


@pytest.mark.parametrize(
    ("args", "prepared"),
    [
        (("--prepared-statements", "--doorbell", "poll-only", "--poll-interval", "0.05"), True),
        (("--doorbell", "poll-only", "--poll-interval", "0.05"), True),
        ((), True),
        (("--no-prepared-statements",), False),
        (("--no-prepared-statements", "--doorbell", "poll-only", "--poll-interval", "0.05"), False),
    ],
    ids=[
        "flag-on-polling",
        "default-polling",
        "default-listening",
        "flag-off-listening",
        "flag-off-polling",
    ],
)
def test_run_prepares_its_claims_as_the_flag_says(
    env: Env, spawn: Callable[..., Process], args: tuple[str, ...], prepared: bool
) -> None:
    """`reactor run` on a direct session dispatches rows with its claims prepared on the
    server, by default or with --prepared-statements; --no-prepared-statements prepares none."""
    conn = env.connect()
    conn.execute(NOTE_PREPARED)
    start_reactor(spawn, *args)
    # Claims enough (psycopg prepares a statement at its fifth run on a connection).
    for batch in range(8):
        insert_rows(conn, 10, prefix=f"b{batch}-")
        wait_for(
            lambda: states(conn) == {"active": 10 * (batch + 1)},  # noqa: B023
            timeout=20,
            what=f"batch {batch} dispatched",
        )
    seen = conn.execute(
        "SELECT count(*), max(prepared) FROM prepared_seen WHERE app LIKE 'photo-reactor work%%'"
    ).fetchone()
    assert seen is not None and seen[0] >= 8, seen
    assert (seen[1] > 0) is prepared, seen


# -- multi-host URLs and read-only servers ------------------------------------------------


def multi_host(url: str, dead_port: int) -> str:
    """`url` with a host that refuses connections listed first."""
    parts = urlsplit(url)
    auth = parts.netloc.rpartition("@")[0]
    hosts = f"127.0.0.1:{dead_port},{parts.hostname}:{parts.port or 5432}"
    return f"{parts.scheme}://{auth + '@' if auth else ''}{hosts}{parts.path}"


def test_commands_take_a_multi_host_url(
    env: Env, spawn: Callable[..., Process], empty_database: str
) -> None:
    url = multi_host(env.database_url, free_port())
    migrate = run_cli(
        env, "migrate", extra_env={"DATABASE_URL": multi_host(empty_database, free_port())}
    )
    assert migrate.returncode == 0, migrate.stderr
    env.database_url = url  # every process below gets the multi-host URL
    assert env.cli_json("submit", "a", "b") == {"submitted": 2, "unchanged": 0}
    assert env.cli_json("status", "--json")["types"]
    start_reactor(spawn, "--route", "photo.process=tests.handlers.ok")
    conn = psycopg.connect(url, autocommit=True)
    env.cleanups.append(conn.close)
    conn.execute(SCHEMA)
    start_worker(spawn, env, burst=False)
    wait_for(lambda: states(conn) == {"done": 2}, timeout=60, what="both rows done")


def test_a_read_only_server_is_retried_not_fatal(env: Env, spawn: Callable[..., Process]) -> None:
    """The reactor's sessions are cut and every new session of its database is read-only (as
    on a standby): it must keep retrying, dispatch nothing, and resume when writes work."""
    admin = env.connect()
    reactor = start_reactor(spawn, "--route", "photo.process=tests.handlers.ok")
    insert_rows(admin, 3, prefix="before-")
    client = env.redis()
    # Committed, not only enqueued (a cut before the COMMIT would leave them pending).
    wait_for(lambda: states(admin) == {"active": 3}, timeout=20, what="first rows dispatched")
    admin.execute(f'ALTER DATABASE "{env.database_name}" SET default_transaction_read_only = on')
    try:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND application_name LIKE 'photo-reactor %'"
        )
        insert_rows(admin, 3, prefix="during-")  # this session was opened writable
        reactor.wait_for_line("read-only", timeout=30)
        seen = len(reactor.lines)
        wait_for(
            lambda: sum("reconnect_retry" in line for line in reactor.lines[seen:]) >= 2,
            timeout=30,
            what="two more reconnect attempts",
        )
        assert reactor.proc.poll() is None, reactor.output()
        assert states(admin) == {"active": 3, "pending": 3}
    finally:
        admin.execute(f'ALTER DATABASE "{env.database_name}" RESET default_transaction_read_only')
    wait_for(lambda: len(queue_ids(client)) == 6, timeout=30, what="rows dispatched after")
    assert "Traceback" not in reactor.output()


def test_losing_the_listener_reopens_both_connections(
    env: Env, spawn: Callable[..., Process]
) -> None:
    """After a failover both sessions are on the old server; the first one noticed gone must
    take the other with it, so the reactor reconnects in one round, not when a claim fails."""
    admin = env.connect()
    reactor = start_reactor(spawn, "--route", "photo.process=tests.handlers.ok")

    def pids() -> dict[str, int]:
        return {
            str(name): int(pid)
            for name, pid in admin.execute(
                "SELECT application_name, pid FROM pg_stat_activity"
                " WHERE datname = current_database()"
                " AND application_name IN ('photo-reactor work', 'photo-reactor listener')"
            )
        }

    def both(unlike: dict[str, int]) -> dict[str, int]:
        found = pids()
        return found if len(found) == 2 and found != unlike else {}

    before = wait_for(lambda: both({}), what="both sessions")
    admin.execute("SELECT pg_terminate_backend(%s)", [before["photo-reactor listener"]])
    after = wait_for(
        lambda: both(before),
        timeout=20,
        what="both sessions reopened",
    )
    assert after["photo-reactor work"] != before["photo-reactor work"]
    assert after["photo-reactor listener"] != before["photo-reactor listener"]
    insert_rows(admin, 2)
    client = env.redis()
    wait_for(lambda: len(queue_ids(client)) == 2, timeout=20, what="dispatch after reconnect")
    assert reactor.proc.poll() is None


def test_connect_refuses_a_read_only_server_whatever_the_url_asks(env: Env) -> None:
    admin = env.connect()
    admin.execute(f'ALTER DATABASE "{env.database_name}" SET default_transaction_read_only = on')
    try:
        for query in ("", "?target_session_attrs=any"):
            with pytest.raises(DatabaseError, match="read-only"):
                db.connect(env.database_url + query)
        # Reading is fine: `reactor status` may run against a standby.
        db.connect(env.database_url + "?target_session_attrs=any", read_write=False).close()
    finally:
        admin.execute(f'ALTER DATABASE "{env.database_name}" RESET default_transaction_read_only')


# -- bad set-ups exit 2 with one line ------------------------------------------------------


def run_reactor(env: Env, **variables: str) -> subprocess.CompletedProcess[str]:
    return run_cli(env, "run", extra_env=variables)


def assert_one_line_exit_2(result: subprocess.CompletedProcess[str], needle: str) -> None:
    out = (result.stdout + result.stderr).strip()
    assert result.returncode == 2, out
    assert len(out.splitlines()) == 1, out
    assert "Traceback" not in out and "hunter2" not in out, out
    assert needle in out, out


@pytest.fixture
def sentinel() -> Iterator[tuple[RedisServer, SentinelServer]]:
    master = RedisServer()
    watcher = SentinelServer(master.port, "photos", quorum=1)
    try:
        yield master, watcher
    finally:
        watcher.close()
        master.close()


@pytest.mark.slow
def test_bad_multi_host_and_sentinel_set_ups_exit_2(
    env: Env, sentinel: tuple[RedisServer, SentinelServer]
) -> None:
    _master, watcher = sentinel
    pg_port = urlsplit(env.database_url).port
    bad_multi_host = f"postgresql://u:hunter2@127.0.0.1:{pg_port},127.0.0.1:x/db"
    assert_one_line_exit_2(run_reactor(env, DATABASE_URL=bad_multi_host), "bad database URL")
    dead = f"postgresql://u:hunter2@127.0.0.1:{free_port()},127.0.0.1:{free_port()}/db"
    assert_one_line_exit_2(run_reactor(env, DATABASE_URL=dead), "cannot connect to Postgres")
    malformed = "redis+sentinel://:hunter2@127.0.0.1:1,127.0.0.1:/"
    assert_one_line_exit_2(run_reactor(env, REDIS_URL=malformed), "bad Redis Sentinel URL")
    refusing = f"redis+sentinel://:hunter2@127.0.0.1:{free_port()},127.0.0.1:{free_port()}/photos"
    assert_one_line_exit_2(run_reactor(env, REDIS_URL=refusing), "no sentinel answered")
    unknown = f"redis+sentinel://127.0.0.1:{watcher.port}/nope"
    assert_one_line_exit_2(run_reactor(env, REDIS_URL=unknown), "knows a healthy master 'nope'")


@pytest.mark.slow  # a Sentinel set-up of its own
def test_reactor_dispatches_through_sentinel(
    env: Env, spawn: Callable[..., Process], sentinel: tuple[RedisServer, SentinelServer]
) -> None:
    master, watcher = sentinel
    url = f"redis+sentinel://127.0.0.1:{free_port()},127.0.0.1:{watcher.port}/photos/3"
    start_reactor(spawn, "--route", "photo.process=tests.handlers.ok", REDIS_URL=url)
    insert_rows(env.connect(), 5)
    plain = redis.Redis(port=master.port, db=3)
    env.cleanups.append(plain.close)
    wait_for(lambda: len(queue_ids(plain)) == 5, timeout=20, what="jobs in the master's db 3")


# -- PgBouncer in transaction mode ---------------------------------------------------------


def pgbouncer_binary() -> str | None:
    found = find_binary("pgbouncer")
    if found:
        return found
    return "/usr/sbin/pgbouncer" if Path("/usr/sbin/pgbouncer").exists() else None


def pgbouncer_in_front(env: Env) -> tuple[PgBouncer, str]:
    """PgBouncer in transaction mode in front of the test server (the test is skipped when it
    cannot run), and the URL of the test database through it."""
    binary = pgbouncer_binary()
    if binary is None:
        pytest.skip("pgbouncer is not installed (Debian: apt-get install pgbouncer)")
    server = urlsplit(env.pg_server_url)
    user = server.username or os.environ.get("PGUSER") or os.environ.get("USER", "postgres")
    if server.password:
        pytest.skip("the PgBouncer test needs a trust-auth Postgres server")
    bouncer = PgBouncer(binary, server.hostname or "127.0.0.1", server.port or 5432, user)
    env.cleanups.append(bouncer.close)
    return bouncer, f"postgresql://{user}@127.0.0.1:{bouncer.port}/{env.database_name}"


def test_reactor_and_workers_through_pgbouncer(env: Env, spawn: Callable[..., Process]) -> None:
    """A poll-only reactor and a worker of each kind (plain `rq worker`, `reactor.Worker`,
    `reactor.SimpleWorker`), all through PgBouncer in transaction mode with fewer server
    connections than clients (so consecutive transactions of one client run on different
    server sessions): no row may fail or be lost."""
    bouncer, pooled = pgbouncer_in_front(env)
    admin = env.connect()
    admin.execute(SCHEMA)
    with db.connect(pooled, autocommit=True) as through:
        # A pooled session is told from a direct one, and prepares nothing by default.
        assert not db.direct_session(through)
        assert through.prepare_threshold is None
    env.database_url = pooled  # the reactor's and the workers' DATABASE_URL
    poll = 0.2
    reactor = start_reactor(
        spawn,
        "--doorbell",
        "poll-only",
        "--poll-interval",
        str(poll),
        "--batch-size",
        "7",
        "--route",
        "photo.process=tests.handlers.ok",
    )
    workers = [
        start_worker(spawn, env, extra_args=extra)
        for extra in ((), ("-w", "reactor.Worker"), ("-w", "reactor.SimpleWorker"))
    ]
    total = 0
    for i in range(40):
        with admin.transaction():
            insert_rows(admin, 3, prefix=f"b{i}-")
        total += 3
        time.sleep(0.05)  # pacing: batches keep arriving while work runs
    wait_for(
        lambda: states(admin).get("done", 0) == total,
        timeout=180,
        interval=0.2,
        what=f"{total} rows done",
    )
    assert states(admin) == {"done": total}
    runs = Counter(
        photo
        for (photo,) in admin.execute("SELECT photo_id FROM handler_runs WHERE outcome = 'ok'")
    )
    assert len(runs) == total and set(runs.values()) == {1}, runs.most_common(3)
    attempts = admin.execute("SELECT max(attempts) FROM photo_jobs").fetchone()
    assert attempts == (1,), "an attempt was retried or rescued"
    # Dispatch delay: the insert's transaction start to its claim (reported, not asserted:
    # a timing bound would fail on a loaded machine; bench/README.md has the figures).
    delay = admin.execute(
        "SELECT percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (ORDER BY d), max(d)"
        " FROM (SELECT extract(epoch FROM t.at - j.created_at) AS d"
        "       FROM transitions t JOIN photo_jobs j USING (photo_id)"
        "       WHERE t.new_state = 'active') AS delays"
    ).fetchone()
    assert delay is not None
    (p50, p99), worst = delay
    print(
        f"\npgbouncer: {total} rows done; dispatch delay p50 {p50 * 1000:.0f} ms,"
        f" p99 {p99 * 1000:.0f} ms, max {float(worst) * 1000:.0f} ms (poll {poll * 1000:.0f} ms)"
    )
    for proc in [reactor, *workers]:
        assert proc.proc.poll() is None, proc.output()
        assert "prepared statement" not in proc.output(), proc.output()
    for proc in workers:  # each kind took its share (blocked workers are served in turn)
        assert "Job OK" in proc.output(), proc.output()
    assert "prepared statement" not in bouncer.log()
    # Full batches came, and no second session claimed ahead: behind a transaction pooler,
    # each reactor's two server connections could wait on each other.
    assert sum("claim_ahead_off reason=pooler" in line for line in reactor.lines) == 1
    assert "claim_ahead_unavailable" not in reactor.output()


def test_routes_behind_pgbouncer_are_live_while_the_reactor_runs_and_end_when_it_stops(
    env: Env, spawn: Callable[..., Process]
) -> None:
    """Behind PgBouncer in transaction mode the routes' liveness lock stays with the server
    session that took it. A running reactor is still live after that session is closed (it
    takes the lock again at its next check of its routes), and a clean stop ends its liveness at once, so
    the route can be changed without waiting for the pooler."""
    _, pooled = pgbouncer_in_front(env)
    admin = env.connect()
    admin.execute(SCHEMA)
    env.database_url = pooled
    no_routes = {"REACTOR_ROUTES": ""}
    ok, fails = "photo.process=tests.handlers.ok", "photo.process=tests.handlers.always_fails"
    reactor = start_reactor(
        spawn,
        *("--doorbell", "poll-only", "--poll-interval", "0.2", "--sweep-interval", "0.3"),
        *("--route", ok),
        **no_routes,
    )

    def holders() -> list[int]:
        return [
            pid
            for (pid,) in admin.execute(
                "SELECT l.pid FROM pg_locks AS l JOIN reactor_routes AS r"
                " ON l.objid = r.lock_key::oid AND l.objsubid = 2"
                " WHERE l.locktype = 'advisory' AND l.granted"
                " AND l.classid = reactor_routes_lock_class()::oid"
            )
        ]

    def change_route() -> subprocess.CompletedProcess[str]:
        return run_cli(env, "sweep", "--route", fails, extra_env=no_routes)

    refused = change_route()
    assert refused.returncode == 2 and "conflicts with" in refused.stderr, refused.stderr
    # PgBouncer closes the server sessions holding the lock (as server_lifetime would). A CI
    # run once found two holding it here; which session held the second is not known.
    gone = holders()
    assert gone, "the running reactor holds its routes' lock"
    for pid in gone:
        admin.execute("SELECT pg_terminate_backend(%s)", [pid])
    wait_for(
        lambda: len(now := holders()) == 1 and now[0] not in gone,
        timeout=30,
        what="the running reactor holding its routes' lock again",
    )
    # The session that took the lock again is the one recorded: only its hold counts. (The
    # lock shows as granted as soon as it is taken; the record commits just after it.)
    (holder,) = holders()

    def recorded() -> list[tuple[int]]:
        return admin.execute("SELECT DISTINCT backend_pid FROM reactor_routes").fetchall()

    wait_for(lambda: recorded() == [(holder,)], timeout=10, what="the new holder recorded")
    assert holders() == [holder]
    refused = change_route()
    assert refused.returncode == 2 and "conflicts with" in refused.stderr, refused.stderr

    # Stop while another client's transaction holds the server session with the lock, so the
    # stopping reactor's unlock runs on another session and cannot release it: as when the
    # pooler handed that session on. Only the stop mark can end the liveness then.
    (holder,) = holders()
    pinned = pin_server_session(env.database_url, holder)
    try:
        assert reactor.stop() == 0
        assert holders() == [holder]
        changed = change_route()
        assert changed.returncode == 0, changed.stderr
    finally:
        pinned.close()
    assert admin.execute(
        "SELECT count(*) FROM reactor_routes WHERE stopped_at IS NULL"
    ).fetchone() == (0,)
    latest = admin.execute("SELECT handler FROM reactor_routes ORDER BY registered_at DESC LIMIT 1")
    assert latest.fetchone() == ("tests.handlers.always_fails",)


def pin_server_session(url: str, pid: int) -> psycopg.Connection[Any]:
    """A client connection through the pooler inside a transaction on the server session
    `pid` (transaction mode pins a server session to a client for a transaction)."""
    deadline = time.monotonic() + 30
    others: list[psycopg.Connection[Any]] = []
    try:
        while time.monotonic() < deadline:
            conn = psycopg.connect(url, autocommit=True)
            conn.execute("BEGIN")
            row = conn.execute("SELECT pg_backend_pid()").fetchone()
            if row == (pid,):
                return conn
            others.append(conn)  # pinned meanwhile, so the next client gets another session
            if len(others) >= 2:
                for other in others:
                    other.close()
                others = []
        raise AssertionError(f"no client got the server session {pid}")
    finally:
        for other in others:
            other.close()
