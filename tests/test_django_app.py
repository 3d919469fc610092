"""The Django app, `reactor.contrib.django`, in a real Django project run in subprocesses
(tests/django_project): `manage.py migrate` builds the schema `reactor migrate` builds (and
each recognises what the other applied) and Django's state has the models (their permissions
exist, `makemigrations` finds nothing to write), the admin lists, filters, searches and
requeues through the fenced statement, as its users' permissions allow, and logs each action,
and `manage.py reactor` (and `call_command`) runs the CLI on the project's database."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from reactor.pg.db import LATEST_SCHEMA_VERSION
from tests.support.cli import run_cli
from tests.support.db import schema_dump
from tests.support.env import Env
from tests.support.paths import ROOT
from tests.support.processes import child_environ

PROJECT = ROOT / "tests" / "django_project"
#: A photo id whose checkbox must survive a browser's form encoding (admin_check.py names it).
ODD_ID = "odd\r\n100%:IMG_2"
LIST = "/admin/reactor/photojob/"


def manage(url: str, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    """`python manage.py ARGS` of the test project on the database at `url` (given to its
    settings as APP_DATABASE, never as DATABASE_URL)."""
    return subprocess.run(
        [sys.executable, *args],
        env=child_environ(APP_DATABASE=url, **extra),
        cwd=PROJECT,
        capture_output=True,
        text=True,
        timeout=180,
    )


def ledger(url: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT version, name, applied_at FROM reactor_migrations ORDER BY 1")
        return [tuple(r) for r in rows]


def rows(url: str) -> dict[tuple[str, str], tuple[str, int, int]]:
    with psycopg.connect(url) as conn:
        found = conn.execute(
            "SELECT photo_id, type, state, attempts, prior_attempts FROM photo_jobs"
        )
        return {(r[0], r[1]): (r[2], r[3], r[4]) for r in found}


def drop_djangos_tables(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        names = [
            r[0]
            for r in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = 'public'"
                " AND tablename NOT IN ('photo_jobs', 'photo_jobs_history')"
                " AND tablename NOT LIKE 'reactor\\_%'"
            )
        ]
        assert "django_migrations" in names
        for name in names:
            conn.execute(f'DROP TABLE "{name}" CASCADE')


def test_manage_migrate_then_the_admin(
    make_empty_database: Callable[[], str], database_url: str
) -> None:
    url = make_empty_database()
    migrated = manage(url, "manage.py", "migrate", "--noinput")
    assert migrated.returncode == 0, migrated.stderr
    assert "Applying reactor.0001_create_photo_jobs... OK" in migrated.stdout
    # The other way round: reactor migrate finds everything applied.
    again = run_cli(None, "migrate", "--database-url", url)
    assert again.returncode == 0, again.stderr
    expected = f"nothing to do: database is already at schema version {LATEST_SCHEMA_VERSION}"
    assert again.stdout.strip() == expected

    with psycopg.connect(url, autocommit=True) as conn:
        # The failed rows updated at three times (the list of failed rows is newest first);
        # a type only routed, one only paused, one only pending (the type filter's sources).
        conn.execute(
            "INSERT INTO photo_jobs (photo_id, type, state, attempts, last_error, updated_at)"
            " VALUES"
            " ('IMG_1', 'photo.process', 'failed', 2, 'boom IMG_1', now() - interval '2 hours'),"
            " ('IMG_2', 'photo.process', 'done', 1, NULL, now()),"
            " ('IMG_3', 'photo.process', 'active', 1, NULL, now()),"
            " ('IMG_4', 'photo.thumb', 'failed', 5, 'boom IMG_4', now() - interval '1 hour'),"
            " ('IMG_1', 'photo.thumb', 'failed', 1, 'boom thumb', now() - interval '3 hours'),"
            " ('IMG_5', 'photo.pend', 'pending', 0, NULL, now()),"
            " (%s, 'photo.thumb', 'done', 1, NULL, now())",
            [ODD_ID],
        )
        conn.execute(
            "INSERT INTO reactor_routes (type, handler, queue, lock_key, registered_by)"
            " VALUES ('photo.routed', 'photos.handlers.process', 'photo-routed', 1, 'test');"
            " INSERT INTO reactor_paused_types (type) VALUES ('photo.paused')"
        )
        # Archived lives: of a photo that has a row (it stays), and of one that has none, in
        # two types.
        conn.execute(
            "SELECT photo_jobs_history_add_months(now() - interval '2 days', now());"
            " INSERT INTO photo_jobs_history (photo_id, type, state, attempts, max_attempts,"
            " prior_attempts, created_at, finished_at) VALUES"
            " ('IMG_1', 'photo.process', 'done', 1, 5, 0, now() - interval '3 days',"
            "  now() - interval '2 days'),"
            " ('IMG_9', 'photo.process', 'failed', 5, 5, 0, now() - interval '3 days',"
            "  now() - interval '2 days'),"
            " ('IMG_9', 'photo.thumb', 'failed', 3, 5, 0, now() - interval '3 days',"
            "  now() - interval '2 days')"
        )
    checked = manage(url, "admin_check.py")
    assert checked.returncode == 0, checked.stderr
    seen = json.loads(checked.stdout)
    assert seen["all"] == {
        "status": 200,
        "photos": sorted(["IMG_1", "IMG_1", "IMG_2", "IMG_3", "IMG_4", "IMG_5", ODD_ID]),
        "html_has_error": True,  # last_error is listed
    }
    assert seen["failed"]["photos"] == ["IMG_1", "IMG_1", "IMG_4"]
    assert seen["thumb"]["photos"] == sorted(["IMG_1", "IMG_4", ODD_ID])
    # The search is by exact photo id (case counts), any of the terms, quoted or not.
    assert seen["search"]["photos"] == ["IMG_2"]
    assert seen["search_lower"]["photos"] == []
    assert seen["search_two"]["photos"] == seen["search_quoted"]["photos"] == ["IMG_2", "IMG_4"]
    assert seen["search_nul"]["status"] == 200  # Django's form refuses the term: every row
    check_list_reads(seen)
    check_refused(seen["refused"])

    def said(action: str) -> list[str]:
        assert seen[action]["status"] == 200, seen[action]
        return list(seen[action]["messages"])

    # Each row's link opens that row's page; its History link that row's history, which
    # links back to the same page: IMG_1's rows of two types each have their own.
    assert sorted(seen["rows"]) == sorted(seen["checkboxes"])
    for name, row in [*seen["rows"].items(), *seen["lives"].items()]:
        assert row["page"]["status"] == row["history"]["status"] == 200, (name, row)
        assert row["page"]["row"] == row["history"]["row"] == name, (name, row)
        assert row["back"], (name, row)
    assert sorted(seen["lives"]) == [
        "photo.process IMG_1",
        "photo.process IMG_9",
        "photo.thumb IMG_9",
    ]
    # A bare photo id: its row when it has one; refused in one line when it has several.
    several = "photo id 'IMG_1' names several rows: open one from the list"
    listed = {"status": 200, "led_to": "/admin/reactor/photojob/", "messages": [several]}
    bare = seen["bare"]
    assert bare["IMG_1 change"] == bare["IMG_1 history"] == bare["IMG_1 to_field"] == listed
    assert bare["IMG_1 delete"] == {"status": 403}  # nobody deletes rows here
    assert bare["IMG_2 change"]["row"] == "photo.process IMG_2"
    for missing in ("no row", "nul"):
        assert bare[missing]["led_to"] == "/admin/", bare[missing]
        [gone] = bare[missing]["messages"]
        assert gone.startswith("photo job with ID") and gone.endswith("Perhaps it was deleted?")
    assert seen["bare_lives"]["IMG_9"] == {
        "status": 200,
        "led_to": "/admin/reactor/archivedphotojob/",
        "messages": ["photo id 'IMG_9' names several rows: open one from the list"],
    }
    assert seen["bare_lives"]["IMG_1"]["row"] == "photo.process IMG_1"

    assert said("requeue_one") == ["1 failed row(s) requeued"]  # not IMG_1's thumb row
    # Each row's checkbox names that row alone: one photo's rows of two types differ.
    boxes = seen["checkboxes"]
    assert len(set(boxes.values())) == len(boxes) == 7
    assert said("requeue_done") == ["1 done row(s) requeued"]  # the filter's type only
    assert said("requeue_odd") == ["1 done row(s) requeued"]
    [refused] = said("requeue_bare")
    assert refused.startswith("the selection is not this list's rows")
    assert said("requeue_across") == ["2 failed row(s) requeued"]  # every thumb row listed
    assert seen["history"] == {"status": 200, "photos": ["IMG_1", "IMG_9", "IMG_9"]}
    assert said("restore") == ["1 archived photo(s) requeued"]
    assert rows(url) == {
        ("IMG_1", "photo.process"): ("pending", 0, 2),  # a new life, the token going on
        ("IMG_2", "photo.process"): ("pending", 0, 1),
        ("IMG_3", "photo.process"): ("active", 1, 0),  # selected, but a worker's: untouched
        ("IMG_4", "photo.thumb"): ("pending", 0, 5),
        ("IMG_1", "photo.thumb"): ("pending", 0, 1),
        (ODD_ID, "photo.thumb"): ("pending", 0, 1),
        ("IMG_9", "photo.process"): ("pending", 0, 5),  # back from the history, its type only
        ("IMG_5", "photo.pend"): ("pending", 0, 0),
    }
    # Each action run is logged, and in Django's admin log: who, what, how many.
    runs = [
        ("photojob", "requeue_failed", "1", 1),
        ("photojob", "requeue_done", "7", 1),  # every row ticked; the filter's done row moved
        ("photojob", "requeue_done", "1", 1),
        ("photojob", "requeue_failed", "all", 2),
        ("archivedphotojob", "restore", "2", 1),
    ]
    assert seen["audit"] == {
        "log": [
            f"admin_action user=admin action={a} model={m} selected={n} rows={r}"
            for m, a, n, r in runs
        ],
        "entries": [
            ["admin", m, f"{r} row(s)", f"{a}: {r} row(s) moved, {n} selected"]
            for m, a, n, r in runs
        ],
    }

    drop_djangos_tables(url)
    assert schema_dump(url) == schema_dump(database_url)  # what `reactor migrate` built


def check_list_reads(seen: dict[str, Any]) -> None:
    """The list's reads are bounded: no `SELECT DISTINCT type` of the whole table, one count,
    an order an index keeps (by key; newest first under one finished state), no UPPER()."""
    assert seen["queries"] == {
        "all": {"distinct": 0, "counts": 1},
        "failed": {"distinct": 0, "counts": 1},  # not the whole table's count as well
        "search_upper": 0,
    }
    assert seen["order"] == {
        "all": [
            "photo.process IMG_1",
            "photo.thumb IMG_1",
            "photo.process IMG_2",
            "photo.process IMG_3",
            "photo.thumb IMG_4",
            "photo.pend IMG_5",
            f"photo.thumb {ODD_ID}",
        ],
        "failed": ["photo.thumb IMG_4", "photo.process IMG_1", "photo.thumb IMG_1"],
    }
    every = ["photo.paused", "photo.pend", "photo.process", "photo.routed", "photo.thumb"]
    bounded = ["photo.paused", "photo.pend", "photo.routed"]  # no row read for its type
    assert seen["type_choices"] == {
        "all": {"types": every, "selected": []},  # a small table: all its types
        "bounded": {"types": bounded, "selected": []},
        "selected": {"types": sorted([*bounded, "photo.thumb"]), "selected": ["photo.thumb"]},
        "history": {"types": every, "selected": []},
    }


def check_refused(refused: dict[str, Any]) -> None:
    """A NUL or a bad regex in a lookup: the list at ?e=1, as Django answers a bad lookup; in a
    row's key: no such row; in a checkbox: refused in one line, nothing done. Never a 500."""
    for name in ("state_nul", "type_nul", "type_filter_nul", "regex", "history_regex"):
        path = "/admin/reactor/archivedphotojob/" if name.startswith("history") else LIST
        assert refused[name] == {"status": 302, "location": f"{path}?e=1", "messages": []}, name
    for name in ("key_nul", "life_key_nul"):
        assert refused[name]["location"] == "/admin/", refused[name]
        [gone] = refused[name]["messages"]
        assert gone.endswith("Perhaps it was deleted?"), gone
    assert refused["action_nul"] == {
        "status": 302,
        "location": LIST,
        "messages": ["the selection is not this list's rows (reload the page): nothing done"],
    }


def test_admin_access_follows_permissions(database_url: str) -> None:
    """Django's state has the models: `makemigrations` finds nothing to write, `migrate` makes
    their permissions, and a staff user who is not a superuser sees the list with the view
    permission (no actions), requeues with the change permission, and without either is
    refused."""
    migrated = manage(database_url, "manage.py", "migrate", "--noinput")
    assert migrated.returncode == 0, migrated.stderr
    check = manage(database_url, "manage.py", "makemigrations", "--check", "--dry-run")
    assert (check.returncode, check.stdout) == (0, "No changes detected\n"), check.stdout
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO photo_jobs (photo_id, type, state, attempts) VALUES"
            " ('IMG_P', 'photo.process', 'failed', 1)"
        )
    out = manage(database_url, "admin_access.py")
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["permissions"] == sorted(
        f"{verb}_{model}"
        for verb in ("add", "change", "delete", "view")
        for model in ("photojob", "archivedphotojob")
    )
    assert seen["none"] == {"index": False, "list": 403, "history": 403, "requeue": 403}
    assert seen["viewer"] == {
        "index": True,
        "list": 200,
        "photos": ["IMG_P"],
        "actions": [],
        "history": 200,
        "history_actions": [],
        "requeue": 200,
        "state_after": "failed",  # the action is not offered, nor run
    }
    assert seen["operator"] == {
        "index": True,
        "list": 200,
        "photos": ["IMG_P"],
        "actions": ["requeue_failed", "requeue_done"],
        "history": 200,
        "history_actions": ["restore"],
        "requeue": 200,
        "messages": ["1 failed row(s) requeued"],
        "state_after": "pending",
    }


def test_admin_actions_act_on_what_the_page_showed(database_url: str) -> None:
    """A checkbox carries the life of the row the page showed: a row submitted again and run
    to done since is left alone (a third run nobody asked for), and said so. An action behind
    a row another session holds (the history's too) gives up after the lock timeout, doing
    nothing."""
    migrated = manage(database_url, "manage.py", "migrate", "--noinput")
    assert migrated.returncode == 0, migrated.stderr
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO photo_jobs (photo_id, type, state, attempts, last_error) VALUES"
            " ('IMG_D1', 'photo.process', 'done', 1, NULL),"
            " ('IMG_D2', 'photo.process', 'done', 1, NULL),"
            " ('IMG_F1', 'photo.process', 'failed', 2, 'boom'),"
            " ('IMG_F2', 'photo.process', 'failed', 2, 'boom');"
            " SELECT photo_jobs_history_add_months(now() - interval '2 days', now());"
            " INSERT INTO photo_jobs_history (photo_id, type, state, attempts, max_attempts,"
            " prior_attempts, created_at, finished_at) VALUES ('IMG_H', 'photo.process',"
            " 'failed', 5, 5, 0, now() - interval '3 days', now() - interval '2 days')"
        )
    out = manage(database_url, "admin_races.py")
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["shown"]["IMG_D1"] == ["done", 1]
    assert seen["ran_again"] == ["done", 2]  # another life, at another token
    assert seen["stale_page"]["messages"] == [
        "1 done row(s) requeued; 1 changed since the list was shown: left alone"
    ]
    assert seen["after_stale_page"]["IMG_D1"] == ["done", 2]  # not run a third time
    assert seen["after_stale_page"]["IMG_D2"] == ["pending", 1]
    assert seen["held"]["messages"] == [
        "a selected row is held by another session: nothing done; try again"
    ]
    assert seen["held"]["seconds"] < 10, seen["held"]
    assert seen["after_held"]["IMG_F2"] == ["failed", 2]  # all or nothing
    assert seen["released"]["messages"] == ["2 failed row(s) requeued"]
    assert seen["after_released"]["IMG_F1"] == seen["after_released"]["IMG_F2"] == ["pending", 2]
    assert seen["restore_held"]["messages"] == seen["held"]["messages"]
    assert seen["restore_held"]["seconds"] < 10, seen["restore_held"]
    assert seen["restored"]["messages"] == ["1 archived photo(s) requeued"]


def test_manage_migrate_on_a_database_reactor_migrated(env: Env) -> None:
    before = ledger(env.database_url)
    redis = {"REDIS_URL": env.redis_url}
    migrated = manage(env.database_url, "manage.py", "migrate", "--noinput", **redis)
    assert migrated.returncode == 0, migrated.stderr
    assert "Applying reactor.0013_route_liveness_by_backend... OK" in migrated.stdout
    assert ledger(env.database_url) == before  # recognised: nothing ran twice

    submitted = manage(env.database_url, "manage.py", "reactor", "submit", "IMG_9", **redis)
    assert submitted.returncode == 0, submitted.stderr
    status = manage(env.database_url, "manage.py", "reactor", "status", "--json", **redis)
    assert status.returncode == 0, status.stderr
    [process] = [t for t in json.loads(status.stdout)["types"] if t["type"] == "photo.process"]
    assert process["counts"]["pending"] == 1
    assert rows(env.database_url) == {("IMG_9", "photo.process"): ("pending", 0, 0)}
    bad = manage(env.database_url, "manage.py", "reactor", "status", "--nope", **redis)
    assert bad.returncode == 2
    assert bad.stderr == (
        "reactor: error: No such option '--nope' (see `manage.py reactor status --help`)\n"
    )
    # call_command: returns on success, its output on the command's stdout; a failure raises
    # CommandError with reactor's exit code; DATABASE_URL and the logging set-up come back.
    called = manage(env.database_url, "call_reactor.py", **redis)
    assert called.returncode == 0, called.stderr
    assert json.loads(called.stdout) == {
        "returned": None,
        "pending": 1,
        "stderr": "",
        "bad": {
            "error": "reactor exited 2",
            "returncode": 2,
            "stderr": "reactor: error: No such option '--nope' "
            "(see `manage.py reactor status --help`)\n",
        },
        "restored": {"database_url": None, "handlers": True, "level": "WARNING"},
    }


def test_one_django_migration_per_sql_file() -> None:
    """One per SQL file, and the one that puts the models in Django's state."""
    from reactor.contrib.django.sql_migrations import MODELS_STATE

    migrations = sorted(p.stem for p in (ROOT / "reactor/contrib/django/migrations").glob("0*.py"))
    sql = sorted(p.stem for p in (ROOT / "sql").glob("[0-9][0-9][0-9][0-9]_*.sql"))
    assert migrations == sorted([*sql, MODELS_STATE])


def test_a_later_sql_migration_follows_the_models_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """The migrations keep one leaf: the next SQL file's migration depends on its predecessor
    and on the models' state, which depends on 0021."""
    from reactor.contrib.django import sql_migrations
    from reactor.pg.migrate import Migration, load_migrations

    files = load_migrations()
    later = Migration(len(files) + 1, "add_something", "SELECT 1;")
    monkeypatch.setattr(sql_migrations, "load_migrations", lambda: [*files, later])
    migration = sql_migrations.sql_migration(f"m.migrations.{later.version:04d}_add_something")
    last = f"{files[-1].version:04d}_{files[-1].name}"
    assert migration.dependencies == [
        ("reactor", last),
        ("reactor", sql_migrations.MODELS_STATE),
    ]


def test_the_projects_own_tests_use_the_kit(make_empty_database: Callable[[], str]) -> None:
    """`manage.py test`: Django's runner migrates its test database through the app, and each
    TestCase test (in its own transaction) submits, runs and retries with the kit."""
    out = manage(make_empty_database(), "manage.py", "test", "photos", "--noinput")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Ran 3 tests" in out.stderr
    assert "\n\nOK\n" in out.stderr


def test_the_documented_tests_are_the_projects() -> None:
    docs = (ROOT / "docs" / "testing.md").read_text()
    tests = (PROJECT / "photos" / "tests.py").read_text()
    assert f"```python\n{tests}```" in docs
