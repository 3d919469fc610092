"""The admin of `photo_jobs`: read-only rows, listed by type and state, searched by photo id,
and two actions that requeue the selected failed or done rows; and of `photo_jobs_history`:
the archived lives, read-only, with an action that brings the selected photos back.

The actions run `REQUEUE_PHOTOS`, the statement of `reactor requeue`: only rows still done or
failed move (a new life at attempts 0, the token going on), so a row a worker holds is never
touched. The selection is by (photo id, type) as the list shows it filtered. The history's
action runs `RESTORE_ARCHIVED`, that of `reactor requeue` for archived photos: the latest
archived life of each comes back as a pending row (its token going on), unless the photo has a
row in `photo_jobs` already.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from django.contrib import admin, messages
from django.db import connections, transaction

from reactor.contrib.django.models import ArchivedPhotoJob, PhotoJob
from reactor.pg import queries
from reactor.producer import sync_executor

#: Photo ids per requeue statement, as `reactor requeue` batches them.
REQUEUE_BATCH = 5000


def requeue(queryset: Any, state: str | None, statement: str = queries.REQUEUE_PHOTOS) -> int:
    """Run `statement` for the photos of `queryset` (those in `state`, if given), type by
    type; rows it changed."""
    by_type: dict[str, set[str]] = defaultdict(set)
    if state is not None:
        queryset = queryset.filter(state=state)
    for job_type, photo_id in queryset.values_list("type", "photo_id"):
        by_type[job_type].add(photo_id)
    connection = connections[queryset.db]
    moved = 0
    with transaction.atomic(using=queryset.db):
        execute = sync_executor(connection)
        for job_type, ids in by_type.items():
            photo_ids = sorted(ids)
            for start in range(0, len(photo_ids), REQUEUE_BATCH):
                chunk = photo_ids[start : start + REQUEUE_BATCH]
                params = {"photo_ids": chunk, "type": job_type}
                moved += execute(statement, params)[0]
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


@admin.register(ArchivedPhotoJob)
class ArchivedPhotoJobAdmin(admin.ModelAdmin):
    list_display = ("photo_id", "type", "state", "attempts", "finished_at", "last_error")
    list_filter = ("type", "state")
    search_fields = ("=photo_id",)
    list_display_links = None
    actions = ("restore",)

    def has_add_permission(self, request: Any) -> bool:
        return False

    def has_change_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def has_restore_permission(self, request: Any) -> bool:
        return bool(request.user.has_perm(f"{self.opts.app_label}.change_photojob"))

    @admin.action(description="Requeue selected archived photos", permissions=["restore"])
    def restore(self, request: Any, queryset: Any) -> None:
        moved = requeue(queryset, None, queries.RESTORE_ARCHIVED)
        self.message_user(request, f"{moved} archived photo(s) requeued", messages.SUCCESS)
