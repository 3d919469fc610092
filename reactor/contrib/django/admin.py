"""The admin of `photo_jobs`: read-only rows, listed by type and state, searched by photo id,
and two actions that requeue the selected failed or done rows; and of `photo_jobs_history`:
the archived lives, read-only, with an action that brings the selected photos back.

The actions run `REQUEUE_PHOTOS`, the statement of `reactor requeue`: only rows still done or
failed move (a new life at attempts 0, the token going on), so a row a worker holds is never
touched. The history's action runs `RESTORE_ARCHIVED`, that of `reactor requeue` for archived
photos: the latest archived life of each (photo, type) comes back as a pending row (its token
going on), unless it has a row in `photo_jobs` already.

An action acts on exactly the rows ticked, each a (type, photo id). The models' primary key is
the photo id alone (the admin takes no composite key), which would select a photo's rows of
every type; so each checkbox carries its row's `row_key` (the type, `:`, the photo id
percent-encoded: browsers rewrite line breaks in form values) and the list is narrowed to
those rows before Django's own selection. "Select all" acts on every row the list shows
(filtered), as Django's does.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.db import connections, transaction
from django.db.models import Q
from django.utils.html import format_html
from django.utils.translation import gettext

from reactor.contrib.django.models import ArchivedPhotoJob, PhotoJob
from reactor.pg import queries
from reactor.producer import sync_executor
from reactor.validate import is_valid_type, quoted_photo_id, unquoted_photo_id

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


def row_key(job_type: str, photo_id: str) -> str:
    """The value of a row's checkbox: its type, `:`, its photo id percent-encoded (UTF-8)."""
    return f"{job_type}:{quoted_photo_id(photo_id)}"


def parse_row_key(key: str) -> tuple[str, str] | None:
    """(type, photo id) of a `row_key`, or None: not one `row_key` writes."""
    job_type, _, encoded = key.partition(":")
    photo_id = unquoted_photo_id(encoded)
    if not is_valid_type(job_type) or photo_id is None:
        return None
    return job_type, photo_id


class _ByRowAdmin(admin.ModelAdmin):
    """Checkboxes and actions by (type, photo id), not by the one-column primary key."""

    def action_checkbox(self, obj: Any) -> Any:
        label = format_html(gettext("Select this object for an action - {}"), str(obj))
        attrs = {"class": "action-select", "aria-label": label}
        checkbox = forms.CheckboxInput(attrs, lambda value: False)  # rendered unticked
        return checkbox.render(helpers.ACTION_CHECKBOX_NAME, row_key(obj.type, obj.photo_id))

    # The column's header, as Django sets it on its own method (older releases need it).
    action_checkbox.__dict__.update(admin.ModelAdmin.action_checkbox.__dict__)

    def response_action(self, request: Any, queryset: Any) -> Any:
        across = self.action_form.base_fields["select_across"].clean(
            request.POST.get("select_across")
        )
        keys = request.POST.getlist(helpers.ACTION_CHECKBOX_NAME)
        if across or not keys:
            return super().response_action(request, queryset)
        by_type: dict[str, set[str]] = defaultdict(set)
        for key in keys:
            row = parse_row_key(key)
            if row is None:
                message = "the selection is not this list's rows (reload the page): nothing done"
                self.message_user(request, message, messages.ERROR)
                return None
            by_type[row[0]].add(row[1])
        ticked = Q()
        for job_type, photo_ids in by_type.items():
            ticked |= Q(type=job_type, photo_id__in=sorted(photo_ids))
        # Django then selects by primary key, the photo id: hand it those of the ticked rows.
        original, narrowed = request.POST, request.POST.copy()
        narrowed.setlist(helpers.ACTION_CHECKBOX_NAME, sorted(set().union(*by_type.values())))
        request.POST = narrowed
        try:
            return super().response_action(request, queryset.filter(ticked))
        finally:
            request.POST = original


@admin.register(PhotoJob)
class PhotoJobAdmin(_ByRowAdmin):
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
class ArchivedPhotoJobAdmin(_ByRowAdmin):
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
