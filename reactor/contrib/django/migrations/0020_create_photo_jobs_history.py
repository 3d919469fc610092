"""Runs sql/0020_create_photo_jobs_history.sql (unless the ledger has it)."""

from reactor.contrib.django.sql_migrations import sql_migration

Migration = sql_migration(__name__)
