"""Runs sql/0019_keep_heartbeats_heap_only.sql (unless the ledger has it)."""

from reactor.contrib.django.sql_migrations import sql_migration

Migration = sql_migration(__name__)
