"""What a dashboard action's request asks (`reactor.ops.actions`), read from a form or from the
JSON API and checked, before anything runs.

A form names one row or one state, never a list: a row's form carries its photo id in one
`photo_id` field, percent-encoded UTF-8 (`quoted_photo_id`), decoded whole and never split.
Photo ids may hold any character but NUL (line breaks, U+2028 …), and browsers rewrite every
line break of a form value to CRLF, so the id is encoded to come back exactly; a value that is
not the encoding the page writes is refused. Lists of ids go through the JSON API.

A row's form also carries the row as the page showed it (`Fence`): its state (`row_state`) and,
when the page knows it, its token (`token`: `prior_attempts + attempts`, which grows with every
dispatch over all the row's lives). The action then acts only on a row still so: a form kept in
a tab, replayed or resubmitted acts on no later life of its row (a 409, `reactor.ops.fenced`).
The JSON API takes the same two fields, optional, with exactly one photo id.

A JSON body is parsed by `json.loads`, which recurses once per level of nesting: a body nested
deeper than Python's recursion limit is refused (400), never a 500.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from reactor.errors import ConfigError, InvalidJobError
from reactor.validate import (
    MAX_PHOTO_ID_BYTES,
    check_job_type,
    check_row_photo_id,
    unquoted_photo_id,
)

__all__ = [
    "MAX_PHOTO_IDS",
    "Fence",
    "RefusedError",
    "Request",
    "request_from_form",
    "request_from_json",
]

#: The most photo ids one action takes (the largest body: `reactor.http_server.MAX_BODY_BYTES`).
MAX_PHOTO_IDS = 10_000
#: The states a row's action may find it in: a requeue takes a finished row, a cancel a live one.
_ROW_STATES = {"requeue": ("done", "failed", "cancelled"), "cancel": ("pending", "active")}
#: A token is a bigint (`prior_attempts + attempts`): at most 19 digits.
_TOKEN_DIGITS = 19


class RefusedError(Exception):
    """The request is refused with `status` (4xx, 5xx) and this one-line message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Fence:
    """The row as the page showed it: the action acts only on a row still so (None: unchecked)."""

    state: str | None
    token: int | None


@dataclass(frozen=True)
class Request:
    action: str
    job_type: str
    photo_ids: tuple[str, ...]
    bulk_state: str | None  # "failed" (requeue) or "pending" (cancel): every such row
    fence: Fence | None = None  # only with one photo id


def _request(action: str, job_type: Any, photo_ids: Any, state: Any) -> Request:
    if not isinstance(job_type, str):
        raise RefusedError(400, 'give "type"')
    try:
        check_job_type(job_type)
        if action in ("pause", "resume"):
            return Request(action, job_type, (), None)
        bulk = {"requeue": "failed", "cancel": "pending"}[action]
        if state is not None:
            if state != bulk or photo_ids:
                raise RefusedError(400, f'{action}: give "photo_ids" or "state": "{bulk}"')
            return Request(action, job_type, (), bulk)
        if not isinstance(photo_ids, list) or not photo_ids or len(photo_ids) > MAX_PHOTO_IDS:
            raise RefusedError(400, f'{action}: give "photo_ids" (1 to {MAX_PHOTO_IDS}) or "state"')
        for photo_id in photo_ids:
            if not isinstance(photo_id, str):
                raise RefusedError(400, "photo ids are strings")
            check_row_photo_id(photo_id)  # a blank id names the row that has it
    except (ConfigError, InvalidJobError) as exc:
        raise RefusedError(400, str(exc)) from None
    return Request(action, job_type, tuple(dict.fromkeys(photo_ids)), None)


def _fence(action: str, state: Any, token: Any) -> Fence | None:
    """The fence given (None: neither field).

    Raises:
        RefusedError: a state the action cannot find its row in, or a token that is not one.
    """
    if state is None and token is None:
        return None
    if action not in _ROW_STATES:
        raise RefusedError(400, f'{action}: "row_state" and "token" go with a requeue or cancel')
    if state is not None and state not in _ROW_STATES[action]:
        raise RefusedError(400, f'{action}: "row_state" is one of {", ".join(_ROW_STATES[action])}')
    if isinstance(token, str) and token.isascii() and token.isdigit():  # a form's field
        token = int(token) if len(token) <= _TOKEN_DIGITS else -1
    if token is not None and (
        isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < 2**63
    ):
        raise RefusedError(400, '"token" is a whole number: the row\'s prior_attempts + attempts')
    return Fence(state, token)


def request_from_json(action: str, body: bytes) -> Request:
    """The request of an API body: `{"type": T}`, with `"photo_ids": [...]` or `"state"` for a
    requeue or cancel, and `"row_state"` / `"token"` (optional) with one photo id."""
    try:
        data = json.loads(body)
    except RecursionError:  # each level of nesting is a level of json's recursion
        raise RefusedError(400, "the body is not JSON we take: nested too deeply") from None
    except (ValueError, UnicodeDecodeError):
        raise RefusedError(400, "the body is not JSON") from None
    if not isinstance(data, dict):
        raise RefusedError(400, "the body is not a JSON object")
    request = _request(action, data.get("type"), data.get("photo_ids"), data.get("state"))
    fence = _fence(action, data.get("row_state"), data.get("token", None))
    if fence is not None and len(request.photo_ids) != 1:
        raise RefusedError(400, f'{action}: "row_state" and "token" go with one photo id')
    return replace(request, fence=fence)


def _row_photo_id(encoded: str) -> str:
    """The photo id a row's form names, decoded exactly (`quoted_photo_id` wrote it).

    Raises:
        RefusedError: not an encoding `quoted_photo_id` writes, or not an id the table holds.
    """
    photo_id = unquoted_photo_id(encoded)
    if photo_id is None:
        raise RefusedError(400, "photo_id is not a photo id as the page encodes it")
    # The table's own bounds, not validate_job's: a blank id is refused from a person's
    # typing, but a row that holds one may be acted on by its own form.
    if "\x00" in photo_id or len(photo_id.encode()) > MAX_PHOTO_ID_BYTES:
        raise RefusedError(400, "photo_id names no row the table could hold")
    return photo_id


def request_from_form(action: str, fields: Mapping[str, list[str]]) -> Request:
    """The request of a page's form: a type, with one `photo_id` (and its `row_state` and
    `token`) or one `state` (every such row) for a requeue or cancel."""
    job_type = fields.get("type", [None])[0]
    named = fields.get("photo_id", [])
    fenced = ("row_state", "token")
    if "photo_ids" in fields or len(named) > 1 or any(len(fields.get(f, [])) > 1 for f in fenced):
        raise RefusedError(400, f"{action}: a form names one row (photo_id) or a state")
    if not named or action in ("pause", "resume"):
        if any(f in fields for f in fenced):
            raise RefusedError(400, f'{action}: "row_state" and "token" go with a photo_id')
        return _request(action, job_type, None, fields.get("state", [None])[0])
    if "state" in fields:
        raise RefusedError(400, f'{action}: give "photo_id" or "state", not both')
    if not isinstance(job_type, str):
        raise RefusedError(400, 'give "type"')
    try:
        check_job_type(job_type)
    except InvalidJobError as exc:
        raise RefusedError(400, str(exc)) from None
    fence = _fence(action, fields.get("row_state", [None])[0], fields.get("token", [None])[0])
    return Request(action, job_type, (_row_photo_id(named[0]),), None, fence)
