"""Runs sql/0021_pin_function_search_paths.sql (unless the ledger has it)."""

from reactor.contrib.django.sql_migrations import sql_migration

Migration = sql_migration(__name__)
