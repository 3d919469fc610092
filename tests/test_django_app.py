"""The Django app, `reactor.contrib.django`, in a real Django project run in subprocesses
(tests/django_project): `manage.py migrate` builds the schema `reactor migrate` builds (and
each recognises what the other applied), the admin lists, filters, searches and requeues
through the fenced statement, and `manage.py reactor` runs the CLI on the project's
database."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import psycopg

from reactor.pg.db import LATEST_SCHEMA_VERSION
from tests.support.cli import run_cli
from tests.support.db import schema_dump
from tests.support.env import Env
from tests.support.paths import ROOT
from tests.support.processes import child_environ

PROJECT = ROOT / "tests" / "django_project"
#: A photo id whose checkbox must survive a browser's form encoding (admin_check.py names it).
ODD_ID = "odd\r\n100%:IMG_2"


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
        conn.execute(
            "INSERT INTO photo_jobs (photo_id, type, state, attempts, last_error) VALUES"
            " ('IMG_1', 'photo.process', 'failed', 2, 'boom IMG_1'),"
            " ('IMG_2', 'photo.process', 'done', 1, NULL),"
            " ('IMG_3', 'photo.process', 'active', 1, NULL),"
            " ('IMG_4', 'photo.thumb', 'failed', 5, 'boom IMG_4'),"
            " ('IMG_1', 'photo.thumb', 'failed', 1, 'boom thumb'),"
            " (%s, 'photo.thumb', 'done', 1, NULL)",
            [ODD_ID],
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
        "photos": sorted(["IMG_1", "IMG_1", "IMG_2", "IMG_3", "IMG_4", ODD_ID]),
        "html_has_error": True,  # last_error is listed
    }
    assert seen["failed"]["photos"] == ["IMG_1", "IMG_1", "IMG_4"]
    assert seen["thumb"]["photos"] == sorted(["IMG_1", "IMG_4", ODD_ID])
    assert seen["search"]["photos"] == ["IMG_2"]

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
    assert len(set(boxes.values())) == len(boxes) == 6
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
    }

    drop_djangos_tables(url)
    assert schema_dump(url) == schema_dump(database_url)  # what `reactor migrate` built


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


def test_one_django_migration_per_sql_file() -> None:
    migrations = sorted(p.stem for p in (ROOT / "reactor/contrib/django/migrations").glob("0*.py"))
    assert migrations == sorted(p.stem for p in (ROOT / "sql").glob("[0-9][0-9][0-9][0-9]_*.sql"))


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
