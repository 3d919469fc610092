"""The admin's filter by type, whose choices come from bounded reads rather than a
`SELECT DISTINCT type` over the whole table (no index leads with the type, so that read every
row: 0.22 s a page on a million rows).

The choices are the types the database knows cheaply: those of the recorded routes, the paused
ones, those with pending rows (a loose scan of the pending index, one probe per type), the
common ones of the table's statistics (the last ANALYZE: a type with many finished rows that
no reactor routes), those of the first `sampled_rows` rows the table gives (all of a small
table's types), and the one selected. A rare type outside all of these is still filtered by
its URL (`?type=...`), as any value is.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db import connections

from reactor.pg import queries
from reactor.producer import sync_executor
from reactor.validate import is_valid_type

__all__ = ["TypeListFilter", "listed_types"]


def listed_types(queryset: Any, sampled_rows: int) -> list[str]:
    """The types the filter of `queryset`'s list offers, sorted, read on its database."""
    execute = sync_executor(connections[queryset.db])
    found = set(queryset.order_by().values_list("type", flat=True)[:sampled_rows])
    for statement in (
        queries.RECORDED_ROUTES,
        queries.PAUSED_TYPES,
        queries.PENDING_TYPES,
        queries.COMMON_TYPES,
    ):
        found.update(str(row[0]) for row in execute(statement, {})[1])
    return sorted(t for t in found if is_valid_type(t))


class TypeListFilter(admin.AllValuesFieldListFilter):
    """Django's filter of a field's values, its choices read by `listed_types`."""

    #: Rows read for their types (the first the table gives: no order, so no sort).
    sampled_rows = 1000

    def __init__(  # noqa: PLR0917  (Django's signature)
        self, field: Any, request: Any, params: Any, model: Any, model_admin: Any, field_path: str
    ) -> None:
        super().__init__(field, request, params, model, model_admin, field_path)
        selected = self.lookup_val
        # Django 5 gives the parameter's values as a list, 4.2 as a string.
        selected = [selected] if isinstance(selected, str) else list(selected or [])
        listed = listed_types(model_admin.get_queryset(request), self.sampled_rows)
        self.lookup_choices = sorted({*listed, *filter(is_valid_type, selected)})
