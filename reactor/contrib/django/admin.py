"""The admin of `photo_jobs`: read-only rows, listed by type and state, searched by photo id,
and two actions that requeue the selected failed or done rows.

The actions run `REQUEUE_PHOTOS`, the statement of `reactor requeue`: only rows still done or
failed move (a new life at attempts 0, the token going on), so a row a worker holds is never
touched. The selection is by (photo id, type) as the list shows it filtered.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from django.contrib import admin, messages
from django.db import connections, transaction

from reactor.contrib.django.models import PhotoJob
from reactor.pg import queries
from reactor.producer import sync_executor

#: Photo ids per requeue statement, as `reactor requeue` batches them.
REQUEUE_BATCH = 5000


def requeue(queryset: Any, state: str) -> int:
    """Requeue the rows of `queryset` that are in `state`; rows moved."""
    by_type: dict[str, list[str]] = defaultdict(list)
    for job_type, photo_id in queryset.filter(state=state).values_list("type", "photo_id"):
        by_type[job_type].append(photo_id)
    connection = connections[queryset.db]
    moved = 0
    with transaction.atomic(using=queryset.db):
        execute = sync_executor(connection)
        for job_type, photo_ids in by_type.items():
            for start in range(0, len(photo_ids), REQUEUE_BATCH):
                chunk = photo_ids[start : start + REQUEUE_BATCH]
                params = {"photo_ids": chunk, "type": job_type}
                moved += execute(queries.REQUEUE_PHOTOS, params)[0]
    return moved


@admin.register(PhotoJob)
class PhotoJobAdmin(admin.ModelAdmin):
    list_display = (
        "photo_id",
        "type",
        "state",
        "attempts",
        "max_attempts",
        "next_retry_at",
        "updated_at",
        "last_error",
    )
    list_filter = ("type", "state")
    search_fields = ("=photo_id",)
    list_display_links = None
    actions = ("requeue_failed", "requeue_done")

    def has_add_permission(self, request: Any) -> bool:
        return False

    def has_change_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def has_requeue_permission(self, request: Any) -> bool:
        opts = self.opts
        return bool(request.user.has_perm(f"{opts.app_label}.change_{opts.model_name}"))

    def _requeue(self, request: Any, queryset: Any, state: str) -> None:
        moved = requeue(queryset, state)
        self.message_user(request, f"{moved} {state} row(s) requeued", messages.SUCCESS)

    @admin.action(description="Requeue selected failed rows", permissions=["requeue"])
    def requeue_failed(self, request: Any, queryset: Any) -> None:
        self._requeue(request, queryset, "failed")

    @admin.action(description="Requeue selected done rows", permissions=["requeue"])
    def requeue_done(self, request: Any, queryset: Any) -> None:
        self._requeue(request, queryset, "done")
