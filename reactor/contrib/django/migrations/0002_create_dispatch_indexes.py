"""Runs sql/0002_create_dispatch_indexes.sql (unless the ledger has it)."""

from reactor.contrib.django.sql_migrations import sql_migration

Migration = sql_migration(__name__)
