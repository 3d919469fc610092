"""Whether Postgres can keep `photo_jobs` healthy: what holds its xmin horizon back, how much
of the table is dead row versions, and whether autovacuum runs on it.

Every claim and outcome writes a new row version; vacuum can remove the old ones only once no
transaction may still see them. The *xmin horizon* is the oldest snapshot or transaction id
that vacuum must respect: a session idle in a transaction, a prepared transaction never
committed, a replication slot (or a standby's `hot_standby_feedback`) holds it back, and
while it does, dead versions pile up in the table and its indexes and every claim reads
through them. `read_vacuum_health()` reads, in one short transaction of catalog and
statistics views (no row of the table, no lock):
- the oldest holder of each kind (a backend, a prepared transaction, a slot's `xmin`, a
  slot's `catalog_xmin`), its age in transactions and, for backends (`now() - xact_start`)
  and prepared transactions (`now() - prepared`), in seconds; slots record no time;
- how many sessions of other roles this role sees only in part (without `pg_read_all_stats`,
  which `pg_monitor` includes, their state and start read as NULL, and on some server
  versions their xmin too): then the figure is a lower bound, and says so instead of failing;
- the table's dead-tuple share (`n_dead_tup / (n_live_tup + n_dead_tup)`), its last vacuum
  and autovacuum, and whether autovacuum can run on it (the server's `autovacuum` and
  `track_counts`, the table's `autovacuum_enabled`);
- how full the server's NOTIFY queue is: a session that LISTENs and then stays in one
  transaction (any role that can connect may) keeps it from emptying, and once it is full
  every transaction that notifies fails at COMMIT, inserts into `photo_jobs` included.
The session reading is left out of the holders; every other one counts, the reactor's own
claims included (their transactions last milliseconds, so they never make the figure large).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from reactor.pg import queries
from reactor.pg.db import Connection, translating

__all__ = [
    "HOLDER_KINDS",
    "NOTIFY_QUEUE_SHOWN",
    "HorizonHolder",
    "VacuumHealth",
    "read_vacuum_health",
]

#: From this share of the NOTIFY queue in use, `reactor status` says so (below it the queue
#: is only catching up).
NOTIFY_QUEUE_SHOWN = 0.01
#: The kinds of holder, in the order they are read; the last holds back only the catalogs.
HOLDER_KINDS = ("backend", "prepared_xact", "replication_slot", "replication_slot_catalog")


@dataclass(frozen=True)
class HorizonHolder:
    """The oldest holder of one kind."""

    kind: str
    #: A backend's pid, a prepared transaction's gid, a slot's name.
    name: str
    #: Seconds since its transaction started (None: no time recorded, a slot or a walsender).
    age_seconds: float | None
    #: Transactions since its xmin (`age(xid)`).
    age_xids: int
    #: A backend's state (`idle in transaction`, `active`), a slot's `active`/`inactive`.
    state: str | None = None
    application_name: str | None = None
    database: str | None = None
    role: str | None = None

    @property
    def holds_the_table(self) -> bool:
        """Whether it holds back vacuum of `photo_jobs` (a slot's catalog_xmin does not)."""
        return self.kind != "replication_slot_catalog"

    def describe(self) -> str:
        """One line for people."""
        what = {
            "backend": f"pid {self.name}",
            "prepared_xact": f"prepared transaction {self.name!r}",
            "replication_slot": f"replication slot {self.name!r} (xmin)",
            "replication_slot_catalog": f"replication slot {self.name!r} (catalog_xmin)",
        }[self.kind]
        details = [
            value
            for value in (
                self.state,
                None if not self.application_name else f"application {self.application_name!r}",
                None if self.database is None else f"database {self.database}",
                None if self.role is None else f"role {self.role}",
            )
            if value
        ]
        age = "" if self.age_seconds is None else f"{self.age_seconds:.1f} s, "
        inside = f" ({', '.join(details)})" if details else ""
        return f"{what}{inside}: {age}{self.age_xids:,} transactions"


@dataclass(frozen=True)
class VacuumHealth:
    """What `read_vacuum_health` found."""

    holders: list[HorizonHolder] = field(default_factory=list)
    #: Sessions of this database whose snapshot this role cannot see.
    hidden_sessions: int = 0
    role: str = ""
    live_tuples: int = 0
    dead_tuples: int = 0
    last_autovacuum: datetime | None = None
    last_vacuum: datetime | None = None
    autovacuum_server: bool = True
    track_counts: bool = True
    autovacuum_table: bool = True
    #: The server's NOTIFY queue in use, 0 to 1 (`pg_notification_queue_usage()`).
    notify_queue_usage: float = 0.0

    @property
    def oldest(self) -> HorizonHolder | None:
        """The holder that holds `photo_jobs`' horizon furthest back (by transactions)."""
        holding = [h for h in self.holders if h.holds_the_table]
        return max(holding, key=lambda h: h.age_xids, default=None)

    @property
    def horizon_age_seconds(self) -> float:
        """The oldest holder's age in seconds among those with a time (0: none)."""
        return max(
            (h.age_seconds for h in self.holders if h.holds_the_table and h.age_seconds),
            default=0.0,
        )

    @property
    def dead_share(self) -> float | None:
        """Dead tuples over all tuples counted (None: none counted)."""
        total = self.live_tuples + self.dead_tuples
        return None if total == 0 else self.dead_tuples / total

    @property
    def autovacuum_enabled(self) -> bool:
        """Whether autovacuum can vacuum the table: on for the server and for the table, and
        `track_counts` on (autovacuum decides from those counts)."""
        return self.autovacuum_server and self.track_counts and self.autovacuum_table

    def autovacuum_off(self) -> list[str]:
        """The settings that keep autovacuum off the table (none: it runs)."""
        return [
            setting
            for setting, on in (
                ("autovacuum", self.autovacuum_server),
                ("track_counts", self.track_counts),
                ("photo_jobs.autovacuum_enabled", self.autovacuum_table),
            )
            if not on
        ]

    def as_dict(self) -> dict[str, Any]:
        oldest = self.oldest
        return {
            "xmin_horizon_age_seconds": round(self.horizon_age_seconds, 3),
            "xmin_horizon_holder": None if oldest is None else asdict(oldest),
            "xmin_horizon_holders": [asdict(h) for h in self.holders],
            "hidden_sessions": self.hidden_sessions,
            "role": self.role,
            "live_tuples": self.live_tuples,
            "dead_tuples": self.dead_tuples,
            "dead_share": None if self.dead_share is None else round(self.dead_share, 4),
            "last_autovacuum": None if self.last_autovacuum is None else str(self.last_autovacuum),
            "last_vacuum": None if self.last_vacuum is None else str(self.last_vacuum),
            "autovacuum_enabled": self.autovacuum_enabled,
            "autovacuum_off": self.autovacuum_off(),
            "notify_queue_usage": round(self.notify_queue_usage, 6),
        }

    def lines(self) -> list[str]:
        """What `reactor status` prints: the horizon, then the table (one line each)."""
        oldest = self.oldest
        if self.hidden_sessions:
            seen = "nothing else" if oldest is None else oldest.describe()
            horizon = (
                f"xmin horizon: unknown: {self.hidden_sessions} session(s) of other roles"
                f" hidden (grant pg_monitor to {self.role}); visible: {seen}"
            )
        elif oldest is None:
            horizon = "xmin horizon: nothing holds it back"
        else:
            horizon = f"xmin horizon held back by {oldest.describe()}"
        lines = [horizon]
        lines += [f"  also: {h.describe()}" for h in self.holders if h is not oldest and h.age_xids]
        share = self.dead_share
        dead = "no tuples counted" if share is None else f"{share:.1%} dead tuples"
        off = self.autovacuum_off()
        auto = "autovacuum on"
        if off:
            auto = f"AUTOVACUUM OFF ({', '.join(f'{s} = off' for s in off)})"
        lines.append(
            f"photo_jobs: {dead} ({self.dead_tuples:,} dead, {self.live_tuples:,} live),"
            f" last autovacuum {_when(self.last_autovacuum)}, last vacuum"
            f" {_when(self.last_vacuum)}; {auto}"
        )
        if self.notify_queue_usage >= NOTIFY_QUEUE_SHOWN:
            lines.append(
                f"NOTIFY queue {self.notify_queue_usage:.1%} full: a session that LISTENs is"
                " in a long transaction (the server's log names it); when full, inserts that"
                " notify fail"
            )
        return lines


def _when(value: datetime | None) -> str:
    return "never" if value is None else f"{value:%Y-%m-%d %H:%M:%S %Z}"


def read_vacuum_health(conn: Connection) -> VacuumHealth:
    """Read the horizon's holders and the table's vacuum figures (one read-only transaction).

    Raises:
        DatabaseError: the connection failed.
        StatementError: a query failed.
    """
    with translating("vacuum health query failed", conn), conn.transaction():
        holders = [
            HorizonHolder(
                str(kind),
                str(name),
                None if seconds is None else max(0.0, float(seconds)),
                int(xids or 0),
                state,
                application_name,
                database,
                role,
            )
            for kind, name, seconds, xids, state, application_name, database, role in conn.execute(
                queries.HORIZON_HOLDERS
            )
        ]
        row = conn.execute(queries.VACUUM_HEALTH).fetchone()
    assert row is not None  # the table exists: the schema was checked
    hidden, role, live, dead, autovacuumed, vacuumed, server, track, table, notify = row
    return VacuumHealth(
        holders,
        int(hidden),
        str(role),
        int(live),
        int(dead),
        autovacuumed,
        vacuumed,
        bool(server),
        bool(track),
        bool(table),
        float(notify),
    )
