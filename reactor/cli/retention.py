"""The retention commands of `reactor`: `prune` deletes old finished rows, `archive` moves them
into the monthly partitions of `photo_jobs_history` and drops old months there. Both work in
short batches (`reactor.ops.admin`) and never dispatch."""

from __future__ import annotations

import json
from typing import Any

import click

from reactor.cli.options import connect_migrated, database_option, duration
from reactor.ops import admin
from reactor.settings import MIN_RETENTION_AGE_SECONDS

__all__ = ["RETENTION_COMMANDS"]


@click.command()
@database_option
@click.option("--done-older-than", callback=duration, metavar="DURATION", help="e.g. 7d, 12h.")
@click.option("--failed-older-than", callback=duration, metavar="DURATION", help="e.g. 30d.")
@click.option("--cancelled-older-than", callback=duration, metavar="DURATION", help="e.g. 7d.")
@click.option("--dry-run", is_flag=True, help="Count the rows it would delete; delete nothing.")
@click.option(
    "--exact",
    is_flag=True,
    help="With --dry-run: count every row (a scan), not the planner's estimate of many rows.",
)
def prune(
    *,
    database_url: str,
    done_older_than: float | None,
    failed_older_than: float | None,
    cancelled_older_than: float | None,
    dry_run: bool,
    exact: bool,
) -> None:
    """Delete done, failed and/or cancelled rows older than a duration, in batches (give at
    least one). A dry run counts up to 100,000 rows of each state exactly and gives the
    planner's estimate beyond (named in `estimated`), unless --exact."""
    if done_older_than is None and failed_older_than is None and cancelled_older_than is None:
        raise click.UsageError(
            "give --done-older-than, --failed-older-than and/or --cancelled-older-than"
        )
    for hint, age in (
        ("--done-older-than", done_older_than),
        ("--failed-older-than", failed_older_than),
        ("--cancelled-older-than", cancelled_older_than),
    ):
        if age is not None and age < MIN_RETENTION_AGE_SECONDS:
            raise click.BadParameter("at least 1h", param_hint=hint)
    with connect_migrated(database_url, "prune", read_write=not dry_run) as conn:
        result = admin.prune(
            conn,
            done_older_than=done_older_than,
            failed_older_than=failed_older_than,
            cancelled_older_than=cancelled_older_than,
            dry_run=dry_run,
            exact=exact,
        )
    verb = "would_delete" if dry_run else "deleted"
    counts = {"done": result.done, "failed": result.failed, "cancelled": result.cancelled}
    shown: dict[str, Any] = {f"{verb}_{state}": count for state, count in counts.items()}
    if dry_run:
        shown["estimated"] = list(result.estimated)
    click.echo(json.dumps(shown))


@click.command()
@database_option
@click.option(
    "--older-than",
    callback=duration,
    metavar="DURATION",
    help="Move done, failed and cancelled rows older than this (e.g. 1d) to the history.",
)
@click.option(
    "--drop-history-after",
    callback=duration,
    metavar="DURATION",
    help="Drop the history months whose every row finished longer ago than this (e.g. 180d).",
)
@click.option("--dry-run", is_flag=True, help="Count what would go; change nothing.")
@click.option(
    "--exact",
    is_flag=True,
    help="With --dry-run: count every row (a scan), not the planner's estimate of many rows.",
)
def archive(
    *,
    database_url: str,
    older_than: float | None,
    drop_history_after: float | None,
    dry_run: bool,
    exact: bool,
) -> None:
    """Move old finished rows into photo_jobs_history (one partition per month) and drop old
    months of it (give at least one option). Needs the ownership of photo_jobs_history."""
    if older_than is None and drop_history_after is None:
        raise click.UsageError("give --older-than and/or --drop-history-after")
    if older_than is not None and older_than < MIN_RETENTION_AGE_SECONDS:
        raise click.BadParameter("at least 1h", param_hint="--older-than")
    with connect_migrated(database_url, "archive", read_write=not dry_run) as conn:
        result = admin.archive(
            conn,
            older_than=older_than,
            drop_history_after=drop_history_after,
            dry_run=dry_run,
            exact=exact,
        )
    verb = "would_move" if dry_run else "moved"
    moved = result.moved
    counts = {"done": moved.done, "failed": moved.failed, "cancelled": moved.cancelled}
    shown: dict[str, Any] = {f"{verb}_{state}": count for state, count in counts.items()}
    shown["would_drop" if dry_run else "dropped"] = [
        {"partition": m.name, "estimated_rows": m.estimated_rows}
        | ({} if m.rows is None else {"rows": m.rows})
        for m in result.dropped
    ]
    if dry_run:
        shown["estimated"] = list(moved.estimated)
    click.echo(json.dumps(shown))


#: The commands this module adds to `reactor`.
RETENTION_COMMANDS = (prune, archive)
