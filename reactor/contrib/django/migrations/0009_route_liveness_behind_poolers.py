"""Runs sql/0009_route_liveness_behind_poolers.sql (unless the ledger has it)."""

from reactor.contrib.django.sql_migrations import sql_migration

Migration = sql_migration(__name__)
