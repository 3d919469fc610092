"""The admin of `photo_jobs`: read-only rows, listed by type and state, searched by photo id,
and two actions that requeue the selected failed or done rows; and of `photo_jobs_history`:
the archived lives, read-only, with an action that brings the selected photos back.

The actions lock the selected rows still in the action's state (done, or failed), then run
`REQUEUE_PHOTOS`, the statement of `reactor requeue`, on them: a new life at attempts 0, the
token going on; a row a worker holds is never touched. A ticked row moves only if it is still
at the token (`prior_attempts + attempts`) the page showed: one that was submitted again and
ran since is another life, left alone and counted in the message. The history's action runs
`RESTORE_ARCHIVED`, that of `reactor requeue` for archived photos: the latest archived life of
each (photo, type) comes back as a pending row (its token going on), unless it has a row in
`photo_jobs` already. An action waits at most `LOCK_TIMEOUT_MS` for a row another session
holds, then does nothing and says so.

An action acts on exactly the rows ticked, each a (type, photo id). The models' primary key is
the photo id alone (the admin takes no composite key), which would select a photo's rows of
every type; so each checkbox carries its row's `row_key` (the type, `:`, the photo id
percent-encoded: browsers rewrite line breaks in form values; in the rows' list, then `:` and
the row's token) and the list is narrowed to those rows before Django's own selection.
"Select all" acts on every row the list shows (filtered) in the action's state, as Django's
does.

A row's page (read-only) and its history are at its key too: the list links each row to
`.../<row_key>/change/` (an archived life's key adds `:` and its `finished_at`, since a photo
may have several lives of one type), and the page's History link and the history's link back
go by that key. A bare photo id, as Django writes its own links, opens the row only when one
row has that id; when several do, the page is refused in one line and the list shown: never a
500 for a photo with rows of two types.

The search is by exact photo id (`photo_id = term`, which the key's index serves): the box's
text splits into terms as Django splits it (a quoted term keeps its spaces) and a row matches
any term. A lookup value the database refuses (a NUL, a bad `__regex`) is answered as Django
answers an unknown lookup: the list again, at `?e=1`. The list counts only its filtered rows
and, unless filtered to one state an index keeps by `updated_at`, is ordered by the key (the
index of `(photo_id, type)`): the unfiltered list reads its page and its count, not the table.

Each action run is logged (`admin_action user=... action=... model=... selected=... rows=...`,
logger `reactor.contrib.django.admin`) and written to Django's admin log (one entry per run, not
per row: "select all" may take every row of a big table).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from datetime import datetime
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.admin.utils import quote, unquote
from django.contrib.admin.views.main import ChangeList
from django.contrib.contenttypes.models import ContentType
from django.db import DataError, transaction
from django.db.models import Q
from django.http import HttpResponseRedirect
from django.urls import reverse
from django.utils.html import format_html
from django.utils.text import smart_split, unescape_string_literal
from django.utils.translation import gettext

from reactor.contrib.django.actions import RowHeldError, requeue, restore
from reactor.contrib.django.filters import TypeListFilter
from reactor.contrib.django.models import ArchivedPhotoJob, PhotoJob
from reactor.errors import InvalidJobError
from reactor.validate import (
    check_row_photo_id,
    is_valid_type,
    quoted_photo_id,
    unquoted_photo_id,
)

logger = logging.getLogger(__name__)


def row_key(job_type: str, photo_id: str) -> str:
    """The value of a row's checkbox: its type, `:`, its photo id percent-encoded (UTF-8)."""
    return f"{job_type}:{quoted_photo_id(photo_id)}"


def names_a_row(photo_id: str) -> bool:
    """Whether the table could hold a row of `photo_id` (no NUL, at most 255 bytes): any other
    id names no row, and Postgres refuses a NUL in a query."""
    try:
        check_row_photo_id(photo_id)
    except InvalidJobError:
        return False
    return True


def parse_row_key(key: str) -> tuple[str, str] | None:
    """(type, photo id) of a `row_key`, or None: not one `row_key` writes, or no row's."""
    job_type, _, encoded = key.partition(":")
    photo_id = unquoted_photo_id(encoded)
    if not is_valid_type(job_type) or photo_id is None or not names_a_row(photo_id):
        return None
    return job_type, photo_id


class _RowChangeList(ChangeList):
    """The list, each row linked to its own page (by its key, not its photo id)."""

    def url_for_result(self, result: Any) -> str:
        return str(self.model_admin.row_url("change", result))

    def get_results(self, request: Any) -> None:
        # A value Postgres refuses (a NUL, a bad regex) fails the count: answered as Django
        # answers a bad lookup. In a savepoint, so the request's transaction goes on.
        try:
            with transaction.atomic(using=self.queryset.db):
                super().get_results(request)
        except DataError as exc:
            raise IncorrectLookupParameters(exc) from exc


class _ByRowAdmin(admin.ModelAdmin):
    """Checkboxes, actions and pages by row, not by the one-column primary key."""

    change_form_template = "admin/reactor/row_change_form.html"
    object_history_template = "admin/reactor/row_history.html"
    list_filter: tuple[Any, ...] = (("type", TypeListFilter), "state")
    search_fields = ("=photo_id",)  # the box shows; get_search_results does the search
    show_full_result_count = False  # a second COUNT(*), of the whole table, on every page

    def get_search_results(self, request: Any, queryset: Any, search_term: str) -> Any:
        # Exact, as documented: Django's "=photo_id" is UPPER(photo_id) = UPPER(term), which
        # matches other ids and no index serves.
        terms = [
            unescape_string_literal(t) if t.startswith(('"', "'")) and t[0] == t[-1] else t
            for t in smart_split(search_term)  # as Django splits and unquotes its terms
        ]
        if not terms:
            return queryset, False
        return queryset.filter(photo_id__in=sorted({t for t in terms if names_a_row(t)})), False

    def audit(self, request: Any, action: str, moved: int) -> None:
        """Log an action run, and write it to Django's admin log: who, what, how many (one
        entry per run; per row would be unbounded under "select all")."""
        selected = getattr(request, "reactor_selected", "all")
        user = request.user
        logger.info(
            "admin_action user=%s action=%s model=%s selected=%s rows=%d",
            user.get_username(),
            action,
            self.opts.model_name,
            selected,
            moved,
        )
        LogEntry.objects.create(
            user_id=user.pk,
            content_type_id=ContentType.objects.get_for_model(self.model).pk,
            object_repr=f"{moved} row(s)",
            action_flag=CHANGE,
            change_message=f"{action}: {moved} row(s) moved, {selected} selected",
        )

    def object_key(self, obj: Any) -> str:
        """A row's id in the admin's URLs: its `row_key`."""
        return row_key(obj.type, obj.photo_id)

    def rows_of_key(self, queryset: Any, key: str) -> Any:
        """The rows of `queryset` that `key` (an `object_key`) names, or None: not a key."""
        row = parse_row_key(key)
        return None if row is None else queryset.filter(type=row[0], photo_id=row[1])

    def row_url(self, view: str, obj: Any) -> str:
        """The URL of `view` ("change", "history") of the row `obj`."""
        name = f"admin:{self.opts.app_label}_{self.opts.model_name}_{view}"
        args = (quote(self.object_key(obj)),)
        return str(reverse(name, args=args, current_app=self.admin_site.name))

    def get_changelist(self, request: Any, **kwargs: Any) -> Any:
        return _RowChangeList

    def get_object(self, request: Any, object_id: str, from_field: Any = None) -> Any:
        # By the row's key whatever `_to_field` says: the only field Django lets it name here is
        # the stand-in key, which a photo's rows of two types share.
        queryset = self.get_queryset(request)
        if "\x00" in object_id:
            return None  # no row has it (and Postgres refuses it in a query)
        rows = self.rows_of_key(queryset, object_id)
        found = None if rows is None else rows.first()
        if found is None:  # a bare photo id: its row, if it is the only one
            bare = list(queryset.filter(photo_id=object_id)[:2])
            found = bare[0] if len(bare) == 1 else None
        return found

    def _get_obj_does_not_exist_redirect(self, request: Any, opts: Any, object_id: str) -> Any:
        # Django's hook for a page whose row get_object did not find: say so when a bare photo
        # id named several rows, rather than that it names none.
        photo_id = unquote(object_id)
        rows = self.get_queryset(request).filter(photo_id=photo_id)
        if "\x00" in photo_id or rows[:2].count() < 2:
            return super()._get_obj_does_not_exist_redirect(request, opts, object_id)
        message = f"photo id {photo_id!r} names several rows: open one from the list"
        self.message_user(request, message, messages.WARNING)
        changelist = f"admin:{opts.app_label}_{opts.model_name}_changelist"
        return HttpResponseRedirect(reverse(changelist, current_app=self.admin_site.name))

    def change_view(
        self, request: Any, object_id: str, form_url: str = "", extra_context: Any = None
    ) -> Any:
        return super().change_view(
            request, object_id, form_url, self._row_links(request, object_id, extra_context)
        )

    def history_view(self, request: Any, object_id: str, extra_context: Any = None) -> Any:
        return super().history_view(
            request, object_id, self._row_links(request, object_id, extra_context)
        )

    def _row_links(self, request: Any, object_id: str, extra_context: Any) -> dict[str, Any]:
        """`extra_context` and the links of the row's pages that the templates show (the change
        form's History, the history's way back), by the row's key."""
        context = dict(extra_context or {})
        obj = self.get_object(request, unquote(object_id))
        if obj is not None:
            context["row_change_url"] = self.row_url("change", obj)
            context["row_history_url"] = self.row_url("history", obj)
        return context

    def checkbox_value(self, obj: Any) -> str:
        """The value of a row's checkbox: its `row_key`."""
        return row_key(obj.type, obj.photo_id)

    def parse_checkbox(self, value: str) -> tuple[str, str, int | None] | None:
        """(type, photo id, token or None) of a `checkbox_value`, or None: not one."""
        row = parse_row_key(value)
        return None if row is None else (*row, None)

    def action_checkbox(self, obj: Any) -> Any:
        label = format_html(gettext("Select this object for an action - {}"), str(obj))
        attrs = {"class": "action-select", "aria-label": label}
        checkbox = forms.CheckboxInput(attrs, lambda value: False)  # rendered unticked
        return checkbox.render(helpers.ACTION_CHECKBOX_NAME, self.checkbox_value(obj))

    # The column's header, as Django sets it on its own method (older releases need it).
    action_checkbox.__dict__.update(admin.ModelAdmin.action_checkbox.__dict__)

    def response_action(self, request: Any, queryset: Any) -> Any:
        across = self.action_form.base_fields["select_across"].clean(
            request.POST.get("select_across")
        )
        keys = request.POST.getlist(helpers.ACTION_CHECKBOX_NAME)
        request.reactor_selected = "all" if across else str(len(set(keys)))  # for audit()
        if across or not keys:
            return super().response_action(request, queryset)
        by_type: dict[str, set[str]] = defaultdict(set)
        tokens: dict[tuple[str, str], int | None] = {}
        for key in keys:
            row = self.parse_checkbox(key)
            if row is None:
                message = "the selection is not this list's rows (reload the page): nothing done"
                self.message_user(request, message, messages.ERROR)
                return None
            by_type[row[0]].add(row[1])
            tokens[row[:2]] = row[2]
        request.reactor_tokens = tokens  # the lives the page showed, for the action
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
    actions = ("requeue_failed", "requeue_done")

    def has_add_permission(self, request: Any) -> bool:
        return False

    def has_change_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def get_ordering(self, request: Any) -> tuple[str, ...]:
        # Newest first where an index keeps that order (one state of those with an index on
        # updated_at); else the key's order, which the primary key's index keeps.
        if request.GET.getlist("state__exact") in (["active"], ["cancelled"], ["done"], ["failed"]):
            return ("-updated_at",)
        return ("photo_id", "type")

    def checkbox_value(self, obj: Any) -> str:
        """`row_key`, `:`, the row's token: which life of the row the page showed."""
        return f"{row_key(obj.type, obj.photo_id)}:{obj.prior_attempts + obj.attempts}"

    def parse_checkbox(self, value: str) -> tuple[str, str, int | None] | None:
        key, _, token = value.rpartition(":")
        row = parse_row_key(key)
        # A bare `row_key` is refused too (a page from before the token: reload it); a token
        # is a bigint, at most 19 digits (int() of thousands of digits raises).
        if row is None or not token.isascii() or not token.isdigit() or len(token) > 19:
            return None
        return (*row, int(token))

    def has_requeue_permission(self, request: Any) -> bool:
        opts = self.opts
        return bool(request.user.has_perm(f"{opts.app_label}.change_{opts.model_name}"))

    def _requeue(self, request: Any, queryset: Any, state: str) -> None:
        try:
            moved, changed = requeue(queryset, state, getattr(request, "reactor_tokens", None))
        except RowHeldError as exc:
            self.message_user(request, str(exc), messages.ERROR)
            return
        self.audit(request, f"requeue_{state}", moved)
        said, level = f"{moved} {state} row(s) requeued", messages.SUCCESS
        if changed:
            said, level = (
                f"{said}; {changed} changed since the list was shown: left alone",
                (messages.WARNING),
            )
        self.message_user(request, said, level)

    @admin.action(description="Requeue selected failed rows", permissions=["requeue"])
    def requeue_failed(self, request: Any, queryset: Any) -> None:
        self._requeue(request, queryset, "failed")

    @admin.action(description="Requeue selected done rows", permissions=["requeue"])
    def requeue_done(self, request: Any, queryset: Any) -> None:
        self._requeue(request, queryset, "done")


@admin.register(ArchivedPhotoJob)
class ArchivedPhotoJobAdmin(_ByRowAdmin):
    list_display = ("photo_id", "type", "state", "attempts", "finished_at", "last_error")
    actions = ("restore",)

    def object_key(self, obj: Any) -> str:
        """A life's id in the admin's URLs: its `row_key`, `:`, its `finished_at` (ISO 8601)."""
        return f"{row_key(obj.type, obj.photo_id)}:{obj.finished_at.isoformat()}"

    def rows_of_key(self, queryset: Any, key: str) -> Any:
        job_type, _, rest = key.partition(":")
        encoded, _, when = rest.partition(":")
        row = parse_row_key(f"{job_type}:{encoded}")
        try:
            finished_at = datetime.fromisoformat(when)
        except ValueError:
            return None
        if row is None or finished_at.isoformat() != when:
            return None
        # Two lives finished in the same microsecond are one page (the first).
        return queryset.filter(type=row[0], photo_id=row[1], finished_at=finished_at)

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
        try:
            moved = restore(queryset)
        except RowHeldError as exc:
            self.message_user(request, str(exc), messages.ERROR)
            return
        self.audit(request, "restore", moved)
        self.message_user(request, f"{moved} archived photo(s) requeued", messages.SUCCESS)
