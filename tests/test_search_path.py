"""Built-in calls an untrusted schema cannot capture, against a real Postgres.

A role that may CREATE in `public` defines functions and operators there whose argument types
match the reactor's calls exactly (`unnest(text[])`, `format(text, text, integer, integer)`,
`count(oid)`, `oid = regclass`, ...): Postgres prefers such a match to pg_catalog's polymorphic
or casting one wherever the schemas stand in the search_path. Each one records its call (a row,
and a sequence, which a rollback does not undo) and then does what the built-in does, so the
reactor's paths run to the end: `reactor run`, `sweep`, `submit_many`, `archive` (the history
functions), `status`, `pause`, `migrate`, and the statements whose parameter types depend on a
value. None may call one. `reactor run` also says, once, who could plant them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from typing import Any, cast

import psycopg
import pytest
from psycopg import sql

import reactor
from reactor.pg import queries, trust
from tests.support.cli import run_cli
from tests.support.env import Env
from tests.support.processes import Process, start_reactor
from tests.support.roles import as_role, throwaway_role
from tests.support.waiting import wait_for

TYPE = "photo.process"

#: What the attacker plants: each shadow notes its name, then does what the built-in does.
SHADOWS = [
    "CREATE TABLE public.shadow_calls (name text)",
    "CREATE SEQUENCE public.shadow_calls_seq",
    "GRANT INSERT ON public.shadow_calls TO PUBLIC",
    "GRANT USAGE ON SEQUENCE public.shadow_calls_seq TO PUBLIC",
    """CREATE FUNCTION public.shadow_note(name text) RETURNS void LANGUAGE plpgsql
       SET search_path = pg_catalog, pg_temp AS $$
       BEGIN
           PERFORM pg_catalog.nextval('public.shadow_calls_seq');
           INSERT INTO public.shadow_calls VALUES (name);
       END $$""",
    *(
        f"""CREATE FUNCTION public.{name}({args}) RETURNS {returns} LANGUAGE plpgsql
            SET search_path = pg_catalog, pg_temp AS $$
            BEGIN PERFORM public.shadow_note('{name}({args})'); {body}; END $$"""
        for name, args, returns, body in [
            ("unnest", "text[]", "SETOF text", "RETURN QUERY SELECT pg_catalog.unnest($1)"),
            (
                "unnest",
                "timestamp[]",
                "SETOF timestamp",
                "RETURN QUERY SELECT pg_catalog.unnest($1)",
            ),
            (
                "unnest",
                "text[], double precision[]",
                "TABLE (a text, b double precision)",
                "RETURN QUERY SELECT * FROM ROWS FROM (pg_catalog.unnest($1),"
                " pg_catalog.unnest($2))",
            ),
            (
                "unnest",
                "text[], text[], bigint[]",
                "TABLE (a text, b text, c bigint)",
                "RETURN QUERY SELECT * FROM ROWS FROM (pg_catalog.unnest($1),"
                " pg_catalog.unnest($2), pg_catalog.unnest($3))",
            ),
            (
                "unnest",
                "text[], text[], text[]",
                "TABLE (a text, b text, c text)",
                "RETURN QUERY SELECT * FROM ROWS FROM (pg_catalog.unnest($1),"
                " pg_catalog.unnest($2), pg_catalog.unnest($3))",
            ),
            ("format", "text, text", "text", "RETURN pg_catalog.format($1, $2)"),
            ("format", "text, integer, integer", "text", "RETURN pg_catalog.format($1, $2, $3)"),
            (
                "format",
                "text, text, integer, integer",
                "text",
                "RETURN pg_catalog.format($1, $2, $3, $4)",
            ),
            (
                "format",
                "text, text, text, text",
                "text",
                "RETURN pg_catalog.format($1, $2, $3, $4)",
            ),
            ("substr", "name, integer", "text", "RETURN pg_catalog.substr($1::text, $2)"),
            (
                "make_interval",
                "secs smallint",
                "interval",
                "RETURN pg_catalog.make_interval(secs => $1)",
            ),
            (
                "make_interval",
                "secs integer",
                "interval",
                "RETURN pg_catalog.make_interval(secs => $1)",
            ),
            # As exact as pg_catalog's for a float8: pg_catalog, searched first, keeps the call.
            (
                "make_interval",
                "secs double precision",
                "interval",
                "RETURN pg_catalog.make_interval(secs => $1)",
            ),
            (
                "pg_try_advisory_lock",
                "integer, smallint",
                "boolean",
                "RETURN pg_catalog.pg_try_advisory_lock($1, $2)",
            ),
            (
                "pg_advisory_unlock",
                "integer, smallint",
                "boolean",
                "RETURN pg_catalog.pg_advisory_unlock($1, $2)",
            ),
            ("pg_advisory_lock", "smallint", "void", "PERFORM pg_catalog.pg_advisory_lock($1)"),
            (
                "pg_advisory_unlock",
                "smallint",
                "boolean",
                "RETURN pg_catalog.pg_advisory_unlock($1)",
            ),
            (
                "reactor_routes_lock_held",
                "smallint",
                "boolean",
                "RETURN public.reactor_routes_lock_held($1::integer)",
            ),
            # Operators' functions (named apart: the operators below take their places).
            ("shadow_eq_regclass", "oid, regclass", "boolean", "RETURN $1 = $2::oid"),
            ("shadow_eq_regprocedure", "oid, regprocedure", "boolean", "RETURN $1 = $2::oid"),
            ("shadow_eq_text_array", "text[], text[]", "boolean", "RETURN $1 = $2"),
            ("shadow_match_name", "name, name", "boolean", "RETURN $1::text ~ $2::text"),
            ("shadow_count_oid", "bigint, oid", "bigint", "RETURN $1 + 1"),
            ("shadow_count_void", "text", "bigint", "RETURN 0"),
        ]
    ),
    "CREATE OPERATOR public.= (leftarg = oid, rightarg = regclass,"
    " function = public.shadow_eq_regclass)",
    "CREATE OPERATOR public.= (leftarg = oid, rightarg = regprocedure,"
    " function = public.shadow_eq_regprocedure)",
    "CREATE OPERATOR public.= (leftarg = text[], rightarg = text[],"
    " function = public.shadow_eq_text_array)",
    "CREATE OPERATOR public.~ (leftarg = name, rightarg = name,"
    " function = public.shadow_match_name)",
    "CREATE AGGREGATE public.count(oid) (sfunc = public.shadow_count_oid, stype = bigint,"
    " initcond = '0')",
    # count(pg_advisory_lock(...)) counts void values: a built-in that takes "any" steps it.
    "CREATE AGGREGATE public.count(void) (sfunc = pg_catalog.concat_ws, stype = text,"
    " finalfunc = public.shadow_count_void)",
]


class Shadows:
    """The attacker's role and a reader of what its shadows recorded."""

    def __init__(self, env: Env, role: str) -> None:
        self.role = role
        self._conn = env.connect()

    def calls(self) -> int:
        row = self._conn.execute(
            "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM public.shadow_calls_seq"
        ).fetchone()
        return int(row[0]) if row else 0

    def names(self) -> list[str]:
        return sorted(
            {str(r[0]) for r in self._conn.execute("SELECT name FROM public.shadow_calls")}
        )

    def assert_none_ran(self) -> None:
        assert self.calls() == 0, f"{self.calls()} shadow calls, among them {self.names()}"


@pytest.fixture
def shadows(env: Env) -> Iterator[Shadows]:
    """A role that may CREATE in public (the default before PostgreSQL 15), with its shadows."""
    with throwaway_role(env) as role:
        admin = env.connect()
        # This role alone, whatever the server's version grants PUBLIC.
        admin.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
        admin.execute(sql.SQL("GRANT CREATE ON SCHEMA public TO {}").format(sql.Identifier(role)))
        with psycopg.connect(as_role(env.database_url, role), autocommit=True) as attacker:
            for statement in SHADOWS:
                attacker.execute(statement.encode())
        planted = Shadows(env, role)
        # The shadows do capture a call that needs them (the check of the check).
        admin.execute("SELECT * FROM unnest(ARRAY['x'])")
        assert planted.names() == ["unnest(text[])"]
        admin.execute("TRUNCATE public.shadow_calls")
        admin.execute("ALTER SEQUENCE public.shadow_calls_seq RESTART")
        assert planted.calls() == 0
        yield planted


def _state(conn: psycopg.Connection[Any], photo_id: str) -> tuple[str, str | None]:
    row = conn.execute(
        "SELECT state, last_error FROM photo_jobs WHERE photo_id = %s", [photo_id]
    ).fetchone()
    assert row is not None, photo_id
    return str(row[0]), row[1]


def test_run_sweep_and_producers_call_no_shadow(
    env: Env, spawn: Callable[..., Process], shadows: Shadows
) -> None:
    conn = env.connect()
    with psycopg.connect(env.database_url) as producer:
        assert reactor.submit_many(producer, ["a", "b", "c"]) == 3
    # A row whose attempts are spent: the claim fails it, saying so (format()).
    conn.execute(
        "INSERT INTO photo_jobs (photo_id, type, attempts, max_attempts)"
        " VALUES ('spent', %s, 1, 1)",
        [TYPE],
    )
    running = start_reactor(spawn)
    wait_for(
        lambda: (
            [_state(conn, p)[0] for p in ("a", "b", "c", "spent")]
            == ["active", "active", "active", "failed"]
        ),
        timeout=30,
        what="three rows dispatched and the spent one failed",
    )
    assert _state(conn, "spent")[1] == "attempts spent before dispatch: attempt 1 of 1"
    # A new row while the reactor waits for the next one: its loop turns (NEXT_DUE_IN).
    with psycopg.connect(env.database_url) as producer:
        reactor.submit(producer, "d")
    wait_for(lambda: _state(conn, "d")[0] == "active", timeout=30, what="d dispatched")
    assert running.stop() == 0, running.output()
    # A lost job whose row has no attempt left: the sweep's rescue fails it (format()).
    conn.execute(
        "INSERT INTO photo_jobs (photo_id, type, state, attempts, max_attempts)"
        " VALUES ('lost', %s, 'active', 1, 1)",
        [TYPE],
    )
    swept = run_cli(env, "sweep")
    assert swept.returncode == 0, swept.stderr
    state, error = _state(conn, "lost")
    assert state == "failed" and error is not None and error.endswith("attempt 1 of 1"), error
    shadows.assert_none_ran()


def test_archive_status_pause_and_migrate_call_no_shadow(env: Env, shadows: Shadows) -> None:
    conn = env.connect()
    conn.execute(
        "INSERT INTO photo_jobs (photo_id, type, state, created_at, updated_at)"
        " SELECT 'old-' || i, %s, 'done', now() - interval '71 days', now() - interval '70 days'"
        " FROM generate_series(1, 5) AS i",
        [TYPE],
    )
    # The history's months are made (photo_jobs_history_add_months), then the old one dropped
    # (photo_jobs_history_drop_before, photo_jobs_history_months_before).
    for args in (("--older-than", "1d"), ("--drop-history-after", "1d", "--dry-run")):
        result = run_cli(env, "archive", *args)
        assert result.returncode == 0, result.stderr
    dropped = run_cli(env, "archive", "--older-than", "1d", "--drop-history-after", "1d")
    assert dropped.returncode == 0, dropped.stderr
    assert len(json.loads(dropped.stdout)["dropped"]) == 1, dropped.stdout
    commands: list[tuple[str, ...]] = [
        ("status", "--json"),
        ("pause", TYPE),
        ("resume", TYPE),
        ("pause", "photo.unknown"),  # refused (exit 2), after the look-up of known types
        ("migrate",),
    ]
    for command in commands:
        result = run_cli(env, *command)
        assert result.returncode == (2 if "photo.unknown" in command else 0), result.stderr
    shadows.assert_none_ran()


def test_statements_whose_parameter_types_vary_call_no_shadow(env: Env, shadows: Shadows) -> None:
    """psycopg binds a Python int as smallint, integer or bigint by its value, and a shadow of
    that type would win over a built-in that takes a wider one."""
    conn, other = env.connect(), env.connect()
    key = {"lock_key": 7}
    for statement in (queries.ROUTES_LOCK_TRY, queries.ROUTES_KEPT, queries.ROUTES_LOCK_KEEP):
        conn.execute(statement, key)
    conn.execute(queries.ROUTES_UNLOCK, key)
    conn.execute(queries.MIGRATION_LOCK, {"key": 7})
    conn.execute(queries.MIGRATION_UNLOCK, {"key": 7})
    # Held by `conn`, as by an armed reactor's listener, the doorbell's keys are rows for the
    # count(DISTINCT objid) of the other session's statements.
    conn.execute("SET application_name = 'photo-reactor listener'")
    conn.execute(queries.DOORBELL_ARM)
    assert other.execute(queries.DOORBELL_HOLDERS).fetchone() == (0, True, 16)
    other.execute(queries.REACTOR_SESSIONS)
    conn.execute(queries.DOORBELL_RELEASE)
    row = {"photo_id": "w", "type": TYPE, "token": 1}
    conn.execute(
        "INSERT INTO photo_jobs (photo_id, type, state, attempts, updated_at)"
        " VALUES ('w', %s, 'active', 1, now() - interval '1 hour')",
        [TYPE],
    )
    assert conn.execute(queries.ATTEMPT_START, {**row, "fresh": 60}).fetchone() is not None
    assert conn.execute(queries.ATTEMPT_RETRY, {**row, "error": "x", "delay": 5}).rowcount == 1
    assert conn.execute(queries.KIT_ADVANCE, {"seconds": 10, "type": TYPE}).rowcount == 1
    shadows.assert_none_ran()


def test_the_schemas_functions_resolve_names_in_pg_catalog_alone(env: Env) -> None:
    conn = env.connect()
    settings = conn.execute(
        "SELECT p.proname, p.proconfig FROM pg_proc AS p"
        " WHERE p.pronamespace = 'public'::regnamespace ORDER BY 1"
    ).fetchall()
    assert {"photo_jobs_history_add_months", "photo_jobs_new_life"} <= {n for n, _ in settings}
    pinned = "search_path=pg_catalog, pg_temp"
    assert [name for name, config in settings if pinned not in (config or [])] == [], settings


def test_run_names_the_roles_that_may_create_in_its_schemas(
    env: Env, spawn: Callable[..., Process], shadows: Shadows
) -> None:
    running = start_reactor(spawn)
    warned = [line for line in running.lines if "schema_writable_by_others" in line]
    assert len(warned) == 1, running.output()
    assert "WARNING" in warned[0] and f"schema=public roles={shadows.role} " in warned[0], warned
    assert running.stop() == 0
    env.connect().execute(
        sql.SQL("REVOKE CREATE ON SCHEMA public FROM {}").format(sql.Identifier(shadows.role))
    )
    again = start_reactor(spawn)
    assert not any("schema_writable_by_others" in line for line in again.lines), again.output()


def test_the_owner_and_its_members_may_create_unnamed(env: Env) -> None:
    """The roles the check leaves out: superusers, the tables' owner and its members."""
    conn = env.connect()
    with (
        throwaway_role(env) as owner,
        throwaway_role(env) as member,
        throwaway_role(env) as other,
    ):
        for statement in (
            "REVOKE CREATE ON SCHEMA public FROM PUBLIC",
            "ALTER TABLE photo_jobs OWNER TO {owner}",
            "GRANT {owner} TO {member}",
            "GRANT CREATE ON SCHEMA public TO {owner}, {member}, {other}",
        ):
            names = {"owner": owner, "member": member, "other": other}
            conn.execute(
                sql.SQL(statement).format(**{k: sql.Identifier(v) for k, v in names.items()})
            )
        found = conn.execute(queries.SEARCH_PATH_WRITERS).fetchall()
        assert found == [("public", [other])], found


def test_the_warning_names_ten_roles_and_counts_the_rest(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    roles = ["bad\nWARNING forged", *(f"r{i:02d}" for i in range(11))]
    monkeypatch.setattr(trust, "untrusted_writers", lambda conn: [("public", roles)])
    with caplog.at_level(logging.WARNING, logger="reactor.pg.trust"):
        trust.warn_untrusted_writers(cast(Any, None))
    (line,) = caplog.messages
    assert line.startswith(
        "schema_writable_by_others schema=public roles='bad\\nWARNING forged',r00,r01,"
    ), line
    assert "r08(+2) (" in line and "r09" not in line and "\n" not in line, line
