"""Runs sql/0012_refuse_nonfinite_timestamps.sql (unless the ledger has it)."""

from reactor.contrib.django.sql_migrations import sql_migration

Migration = sql_migration(__name__)
