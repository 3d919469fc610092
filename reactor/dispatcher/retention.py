"""Retention inside `reactor run`: delete old `done` (and `failed`) rows at a low, steady pace,
or move old finished rows into the history and drop its old months (`reactor.pg.history`).

`Pruner` runs in a thread of its own with a connection of its own (`application_name`
'photo-reactor prune'), never on the loop's thread or work connection: a DELETE batch then
never delays a claim, and a reactor without retention pays nothing. Every
`PRUNE_INTERVAL_SECONDS` it deletes the rows older than the configured ages, `batch_size` rows
per short transaction (`FOR UPDATE SKIP LOCKED`, oldest first, one range of the finished-rows
index), sleeping `PRUNE_PAUSE_SECONDS` between batches, so it never holds many locks or long
transactions and never floods the WAL. Several reactors pruning at once skip each other's
rows. A Postgres failure is logged and the round tried again later; it never stops the reactor.
"""

from __future__ import annotations

import logging
import threading
import time

from reactor.dispatcher.metrics import Metrics
from reactor.errors import ReactorError
from reactor.pg import db
from reactor.pg.db import Connection
from reactor.pg.history import (
    ARCHIVED_STATES,
    ArchiveIncompleteError,
    archive_finished,
    drop_history,
)
from reactor.pg.prune import PruneResult, prune_finished
from reactor.settings import DEFAULT_PRUNE_BATCH_SIZE

__all__ = [
    "PRUNE_INTERVAL_SECONDS",
    "PRUNE_PAUSE_SECONDS",
    "Pruner",
]

logger = logging.getLogger(__name__)

#: Pause between two batches of one round (caps the pace at batch_size / pause rows a second).
PRUNE_PAUSE_SECONDS = 0.5
#: Time between rounds, once a round found nothing more to delete (or failed).
PRUNE_INTERVAL_SECONDS = 60.0


class Pruner:
    """Deletes finished rows older than the given ages, or moves them into the history, from
    its own thread."""

    def __init__(
        self,
        database_url: str,
        *,
        done_after_seconds: float | None,
        failed_after_seconds: float | None = None,
        archive_after_seconds: float | None = None,
        drop_history_after_seconds: float | None = None,
        batch_size: int = DEFAULT_PRUNE_BATCH_SIZE,
        metrics: Metrics | None = None,
    ) -> None:
        self._database_url = database_url
        self._ages = [
            (state, age)
            for state, age in (("done", done_after_seconds), ("failed", failed_after_seconds))
            if age is not None
        ]
        self._archive_ages = (
            []
            if archive_after_seconds is None
            else [(state, archive_after_seconds) for state in ARCHIVED_STATES]
        )
        self._drop_history_after = drop_history_after_seconds
        self._batch_size = batch_size
        self._metrics = metrics
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn: Connection | None = None

    def start(self) -> None:
        """Start the thread (its first round begins at once)."""
        self._thread = threading.Thread(target=self._run, name="reactor-prune", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop after the batch in hand and close the connection."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_once()
            except ReactorError as exc:
                logger.warning(
                    "prune_failed error=%s (next round in %gs)", exc, PRUNE_INTERVAL_SECONDS
                )
                self._close()
            self._stop.wait(PRUNE_INTERVAL_SECONDS)
        self._close()

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def run_once(self) -> PruneResult:
        """Delete batches until each state comes back short or a stop is requested.

        Raises:
            DatabaseError: Postgres failed (the rows of the failed batch are kept).
        """
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._close()
            self._conn = db.connect(self._database_url, purpose="prune")
        started = time.monotonic()
        result = prune_finished(
            self._conn,
            self._ages,
            self._batch_size,
            pause_seconds=PRUNE_PAUSE_SECONDS,
            stop=self._stop,
            on_batch=self._counted,
        )
        if result.done or result.failed:
            logger.info(
                "rows_pruned done=%d failed=%d batches=%d seconds=%.1f",
                result.done,
                result.failed,
                result.batches,
                time.monotonic() - started,
            )
        if self._archive_ages:
            self._archive()
        if self._drop_history_after is not None and not self._stop.is_set():
            dropped = drop_history(self._conn, self._drop_history_after)
            if dropped:
                logger.info("history_dropped partitions=%s", ",".join(dropped))
                if self._metrics is not None:
                    self._metrics.history_months_dropped.inc(len(dropped))
        return result

    def _archive(self) -> None:
        # A state that cannot be archived (its partitions, a user's trigger), or whose rows
        # span more months than a round makes, is reported each round with the rows left; the
        # other states were archived, and the history's drop still runs.
        assert self._conn is not None
        started = time.monotonic()
        left_rows = 0.0
        try:
            moved = archive_finished(
                self._conn,
                self._archive_ages,
                self._batch_size,
                pause_seconds=PRUNE_PAUSE_SECONDS,
                stop=self._stop,
                on_batch=self._archived,
            )
        except ArchiveIncompleteError as exc:
            moved = exc.moved
            left = exc.left
            left_rows = 1.0 if left is None else float(left.rows)  # 1: at least that batch's
            logger.warning(
                "%s rows_left=%s error=%s (next round in %gs)",
                "archive_deferred" if exc.deferred else "archive_failed",
                "unknown" if left is None else f"{'~' if left.estimated else ''}{left.rows}",
                exc,
                PRUNE_INTERVAL_SECONDS,
            )
        if self._metrics is not None:
            self._metrics.archive_rows_left.set(left_rows)
        if moved.done or moved.failed or moved.cancelled:
            logger.info(
                "rows_archived done=%d failed=%d cancelled=%d batches=%d seconds=%.1f",
                moved.done,
                moved.failed,
                moved.cancelled,
                moved.batches,
                time.monotonic() - started,
            )

    def _counted(self, state: str, rows: int) -> None:
        if self._metrics is not None:
            self._metrics.pruned.labels(state).inc(rows)

    def _archived(self, state: str, rows: int) -> None:
        if self._metrics is not None:
            self._metrics.archived.labels(state).inc(rows)
