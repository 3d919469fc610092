"""Runs sql/0006_create_paused_types.sql (unless the ledger has it)."""

from reactor.contrib.django.sql_migrations import sql_migration

Migration = sql_migration(__name__)
