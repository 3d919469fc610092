"""Pure functions: routes, job ids, redaction, durations, backoff, settings (no I/O)."""

from __future__ import annotations

import random
import re
import zlib

import pytest
from rq.job import Job

from reactor import tracing
from reactor.errors import ConfigError
from reactor.jobs import MAX_ENCODED_PART, JobRef, job_id, parse_job_id
from reactor.ops.admin import parse_duration
from reactor.pg import queries
from reactor.pg.vacuum import NOTIFY_QUEUE_SHOWN, VacuumHealth
from reactor.redact import redact
from reactor.routes import (
    Route,
    handler_allowed,
    parse_handler_prefixes,
    parse_route,
    parse_routes,
    recorded_route,
)
from reactor.rq.job_errors import MAX_TRACEBACK_BYTES, last_line, read_failure_texts
from reactor.settings import ReactorSettings, WorkerSettings
from reactor.validate import MAX_ERROR_CHARS, error_column
from reactor.worker.entry import backoff_seconds
from reactor.worker.lifecycle import describe, error_text
from reactor.worker.own_routes import HandlerRefusedError, OwnRoutes
from tests.support.env import Env

RQ_ID = re.compile(r"[A-Za-z0-9_-]+")

TRICKY_IDS = [
    "plain",
    "with:colon",
    "with.dot",
    "with space",
    "under_score",
    "dash-dash",
    "_5f",
    "-",
    "ü",
    "写真-1",
    "emoji 📷",
    "x" * MAX_ENCODED_PART,
    "ü" * (MAX_ENCODED_PART // 6),
    "a-1",
    "a_2d1",
    "\x00\n\t",
    "%41",
]


@pytest.mark.parametrize("photo_id", TRICKY_IDS)
def test_job_id_is_valid_for_rq_and_round_trips(photo_id: str) -> None:
    value = job_id("photo.process", photo_id, 7)
    assert RQ_ID.fullmatch(value)
    ref = parse_job_id(value)
    assert (ref.type, ref.photo_id, ref.token) == ("photo.process", photo_id, 7)


@pytest.mark.parametrize("photo_id", ["x" * (MAX_ENCODED_PART + 1), "ü" * 34, "~" * 255])
def test_long_photo_ids_are_hashed_into_bounded_job_ids(photo_id: str) -> None:
    value = job_id("photo.process", photo_id, 7)
    assert RQ_ID.fullmatch(value) and len(value) <= 2 * MAX_ENCODED_PART + 12
    assert value == job_id("photo.process", photo_id, 7)
    assert value != job_id("photo.process", photo_id[:-1] + "y", 7)
    with pytest.raises(ValueError, match="hashed"):
        parse_job_id(value)


def test_job_ids_are_injective_on_random_inputs() -> None:
    rng = random.Random(1234)
    alphabet = "ab_-.:/ 0ü写"
    seen: dict[str, tuple[str, str, int]] = {}
    for _ in range(20_000):
        key = (
            "".join(rng.choice("ab._-") for _ in range(rng.randint(1, 4))),
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))),
            rng.randint(1, 3),
        )
        value = job_id(*key)
        assert seen.setdefault(value, key) == key, f"{key} and {seen[value]} share {value}"


def test_parse_job_id_rejects_foreign_ids() -> None:
    with pytest.raises(ValueError, match="not a photo-reactor job id"):
        parse_job_id("some-random-uuid-here")


def test_a_statement_without_parameters_holds_no_doubled_percent_sign() -> None:
    # psycopg reads `%%` as `%` only when it is given parameters: a statement sent without
    # them (LEDGER_PROBLEM) would pass `%%I` on to format(), and its message named no role.
    doubled = [
        name
        for name in queries.__all__
        if "%(" not in (text := getattr(queries, name)) and "%%" in text
    ]
    assert doubled == []


def test_route_parsing() -> None:
    assert parse_route("photo.process=app.jobs.process") == Route(
        "photo.process", "app.jobs.process", "photo-process"
    )
    assert parse_route(" photo.thumb = app.jobs.thumb @ thumbs ").queue == "thumbs"
    routes = parse_routes(["a.b=m.f,c=m.g@q", "d=m.h"])
    assert list(routes) == ["a.b", "c", "d"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("photo.process", "expected TYPE=DOTTED.PATH"),
        ("photo.process=", "expected TYPE=DOTTED.PATH"),
        ("bad type=m.f", "type must match"),
        ("t=notdotted", "handler must be a dotted path"),
        ("t=m.f@bad queue", "queue must match"),
    ],
)
def test_bad_routes_are_one_clear_error(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_route(text)


def test_routes_twice_or_none() -> None:
    with pytest.raises(ConfigError, match="routed twice"):
        parse_routes(["a=m.f", "a=m.g"])
    with pytest.raises(ConfigError, match="no route"):
        parse_routes([" , "])


def test_handler_prefixes_name_whole_modules() -> None:
    prefixes = parse_handler_prefixes(["myapp, other.jobs.", ""])
    assert prefixes == ("myapp", "other.jobs")
    assert handler_allowed("myapp.photos.process", prefixes)
    assert handler_allowed("other.jobs.thumb", prefixes)
    assert not handler_allowed("myapp2.x.f", prefixes)
    assert not handler_allowed("other.f", prefixes)
    assert not handler_allowed("os.system", prefixes)
    assert handler_allowed("os.system", ())
    with pytest.raises(ConfigError, match=r"^bad handler prefix 'my app': expected a module"):
        parse_handler_prefixes(["my app"])
    with pytest.raises(ConfigError, match=r"^bad handler prefix 'a\.\.b'"):
        WorkerSettings.from_env({"REACTOR_HANDLER_PREFIXES": "a..b"})


def test_recorded_routes_are_checked_like_flags() -> None:
    assert recorded_route("t", "m.f", "q") == Route("t", "m.f", "q")
    with pytest.raises(ConfigError) as caught:
        recorded_route("t", "os.system; x" * 50, "q")
    message = str(caught.value)
    assert message.startswith("bad route 't=os.system; xos.system; x")
    assert message.endswith(
        "... recorded in reactor_routes: handler must be a dotted path like pkg.module.func"
    )
    assert "\n" not in message and len(message) < 300
    with pytest.raises(ConfigError, match="queue must not be empty"):
        recorded_route("t", "m.f", "")


def test_a_job_naming_anything_but_the_own_route_is_refused() -> None:
    reads: list[int] = []

    def recorded() -> dict[str, Route]:
        reads.append(1)
        return {"t": Route("t", "m.f", "q")}

    own = OwnRoutes(None, (), recorded)
    own.check("t", "m.f")
    for handler, why in (
        ("m.g", "this worker's route runs m.f"),
        (["m.f"], "not a dotted path"),
        ("x" * 1000, "this worker's route runs m.f"),
    ):
        with pytest.raises(HandlerRefusedError, match=why) as caught:
            own.check("t", handler)
        assert len(str(caught.value)) < 400
    with pytest.raises(HandlerRefusedError, match="has no route for the type"):
        own.check("u", "m.f")
    # Read at the first job, then once for each new type and handler that did not match.
    assert len(reads) == 4
    with pytest.raises(HandlerRefusedError):
        own.check("t", "m.g")
    assert len(reads) == 4
    given = OwnRoutes({"t": Route("t", "m.f", "q")}, ("n",), recorded)
    with pytest.raises(HandlerRefusedError, match=r"outside the allowed handler prefixes \(n\)"):
        given.check("t", "m.f")
    assert len(reads) == 4


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("postgresql://user:s3cret@db:5432/x", "postgresql://user:***@db:5432/x"),
        ("redis://:p%40ss@cache:6379/0", "redis://:***@cache:6379/0"),
        ("host=db password=s3cret user=u", "host=db password=*** user=u"),
        ("password='a b' x", "password=*** x"),
        ("postgresql://user@db/x", "postgresql://user@db/x"),
    ],
)
def test_redact(text: str, expected: str) -> None:
    assert redact(text) == expected


def test_parse_duration() -> None:
    assert parse_duration("90s") == 90
    assert parse_duration("15m") == 900
    assert parse_duration("7d") == 7 * 86400
    assert parse_duration("1.5h") == 5400
    with pytest.raises(ConfigError, match="bad duration"):
        parse_duration("seven days")
    with pytest.raises(ConfigError, match="give a number and a unit"):
        parse_duration("7")


def test_backoff_grows_exponentially_with_bounded_jitter() -> None:
    for attempt in range(1, 10):
        step = min(3600.0, 5.0 * 2 ** (attempt - 1))
        for _ in range(50):
            delay = backoff_seconds(attempt, 5.0, 3600.0)
            assert step / 2 <= delay <= step
    assert backoff_seconds(10_000, 5.0, 60.0) <= 60.0


def test_settings_validation() -> None:
    routes = parse_routes(["a=m.f"])
    with pytest.raises(ConfigError, match="batch size"):
        ReactorSettings("", "redis://", routes, batch_size=0)
    with pytest.raises(ConfigError, match="REACTOR_RETRY_BASE_SECONDS must be a number"):
        WorkerSettings.from_env({"REACTOR_RETRY_BASE_SECONDS": "soon"})
    settings = WorkerSettings.from_env({"DATABASE_URL": "x", "REACTOR_HEARTBEAT_SECONDS": "2"})
    assert settings.heartbeat_seconds == 2.0


def test_last_line_of_a_traceback_names_the_exception() -> None:
    chained = (
        "Traceback (most recent call last):\n"
        '  File "w.py", line 3, in f\n'
        "    g()\n"
        "KeyError: 'x'\n\n"
        "During handling of the above exception, another exception occurred:\n\n"
        "Traceback (most recent call last):\n"
        '  File "w.py", line 9, in perform\n'
        "    conn.execute(query)\n"
        "    ~~~~~~~~~~~~^^^^^^^\n"
        'psycopg.errors.UndefinedTable: relation "photo_jobs" does not exist\n'
        "LINE 1: UPDATE photo_jobs SET state = 'active'\n"
        "               ^\n"
    )
    assert (
        last_line(chained) == 'psycopg.errors.UndefinedTable: relation "photo_jobs" does not exist'
    )
    assert last_line("Work-horse terminated unexpectedly; waitpid returned 9\n") == (
        "Work-horse terminated unexpectedly; waitpid returned 9"
    )
    assert last_line("") == ""
    assert len(last_line("ValueError: " + "x" * 2000)) == MAX_ERROR_CHARS
    # UTF-8 cannot encode a lone surrogate (`os.fsdecode` of a name that is not UTF-8).
    assert error_column("cannot read IMG_\udcff.jpg") == "cannot read IMG_\\udcff.jpg"
    # Postgres text refuses NUL.
    assert last_line("Traceback:\n  File 'h.py'\nValueError: \x89PNG\x00") == (
        "ValueError: \x89PNG\\x00"
    )


def test_a_recorded_traceback_is_inflated_within_a_bound(env: Env) -> None:
    # Whoever can write Redis could plant a few KB that inflate to gigabytes.
    client = env.redis()
    small, bomb = (JobRef("photo.process", f"p{i}", 1) for i in range(2))
    traceback = b"Traceback:\n  File 'h.py', line 1\nValueError: boom\n"
    client.hset(Job.key_for(small.job_id), "exc_info", zlib.compress(traceback))
    client.hset(
        Job.key_for(bomb.job_id), "exc_info", zlib.compress(b"x" * (4 * MAX_TRACEBACK_BYTES))
    )
    assert read_failure_texts(client, [small, bomb]) == [
        "ValueError: boom",
        f"(a traceback of more than {MAX_TRACEBACK_BYTES} bytes, not read)",
    ]


def test_status_of_an_empty_table_says_so() -> None:
    from reactor.ops.status import Status, format_status

    lines = format_status(Status([], [], [], [])).splitlines()
    assert lines[1].startswith("(no rows yet"), lines


def test_the_dashboard_shows_every_time_in_one_form() -> None:
    from datetime import datetime, timedelta, timezone

    from reactor.ops.dashboard import shown_time

    plus_two = timezone(timedelta(hours=2))
    for value in (
        datetime(2026, 12, 2, 15, 4, 5, 123456, tzinfo=plus_two),
        "2026-12-02T13:04:05.123456+00:00",
        "2026-12-02 13:04:05.12+00",
        "2026-12-02 14:04:05+01",
    ):
        assert shown_time(value) == "2026-12-02 13:04:05 UTC", value
    assert shown_time("infinity") == "infinity"
    assert shown_time(None) == "\N{EN DASH}"


def test_status_names_a_filling_notify_queue_only_past_its_threshold() -> None:
    quiet = VacuumHealth(notify_queue_usage=NOTIFY_QUEUE_SHOWN / 2).lines()
    assert not any("NOTIFY queue" in line for line in quiet)
    (line,) = [x for x in VacuumHealth(notify_queue_usage=0.375).lines() if "NOTIFY" in x]
    assert line.startswith("NOTIFY queue 37.5% full: a session that LISTENs is in a long")


def test_an_exception_whose_str_raises_still_has_an_error_text() -> None:
    class UnprintableError(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    assert error_text(UnprintableError()) == "UnprintableError: <exception str() failed>"


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e300", "315360001"])
@pytest.mark.parametrize(
    "name", ["REACTOR_HEARTBEAT_SECONDS", "REACTOR_RETRY_BASE_SECONDS", "REACTOR_RETRY_MAX_SECONDS"]
)
def test_worker_durations_are_finite_and_bounded(name: str, value: str) -> None:
    """`nan` crashed the worker's start unnamed; `1e300` passed, then overflowed Redis's TTLs
    and Postgres's intervals at every job."""
    with pytest.raises(ConfigError, match=f"^{name} must be"):
        WorkerSettings.from_env({"DATABASE_URL": "postgresql://h/db", name: value})


def test_a_job_s_meta_of_any_kind_is_read_without_failing() -> None:
    """`job.meta` comes from Redis: a list there stopped a worker of the classes."""
    ref = JobRef("photo.process", "p1", 1)
    for meta in (["traceparent"], "x", None, 3):
        with tracing.processing(ref, meta, "link"):  # type: ignore[arg-type]
            pass


def test_a_type_with_control_characters_is_escaped_in_log_lines() -> None:
    assert describe(JobRef("photo.x\nINFO forged", "p1", 1)).startswith(
        "type='photo.x\\nINFO forged' "
    )
    assert describe(JobRef("photo.process", "p1", 1)).startswith("type=photo.process ")
