"""Checks of a job's identity before it reaches the database, as one-line project errors.

The bounds are the table's own (its CHECK constraints enforce them too): a photo id is 1 to
`MAX_PHOTO_ID_BYTES` bytes of UTF-8 without NUL; a type is 1 to `MAX_TYPE_LENGTH` characters
of `[A-Za-z0-9_.-]` (it is the NOTIFY payload and names an RQ queue); `max_attempts` is 1 to
`MAX_ATTEMPTS` (so a row's token, `prior_attempts + attempts`, cannot overflow). A photo id
that is blank (whitespace and invisible format characters such as U+200B alone: a slip of a
shell script, never a photo) or that no UTF-8 can encode (a lone surrogate) is refused here
too; a command that only names rows that exist (requeue, cancel) takes a blank id
(`check_row_photo_id`), since it can name only a row that has it. Error texts show at most
the first few dozen characters of the value, so a huge id cannot flood a terminal or a log.
An HTML form carries a photo id percent-encoded (`quoted_photo_id`), read back only from
exactly that encoding (`unquoted_photo_id`).
"""

from __future__ import annotations

import re
import unicodedata
import urllib.parse

from reactor.errors import InvalidJobError
from reactor.redact import redact

__all__ = [
    "MAX_ATTEMPTS",
    "MAX_ERROR_CHARS",
    "MAX_PHOTO_ID_BYTES",
    "MAX_TYPE_LENGTH",
    "check_job_type",
    "check_max_attempts",
    "check_photo_id",
    "check_row_photo_id",
    "error_column",
    "error_text",
    "is_blank",
    "is_valid_type",
    "message_of",
    "quoted_photo_id",
    "unquoted_photo_id",
    "validate_job",
]

MAX_PHOTO_ID_BYTES = 255
#: Longest `last_error` the project writes into a row (an outcome, RQ's error, a rescue) or
#: reads out of one for a page.
MAX_ERROR_CHARS = 2000
MAX_TYPE_LENGTH = 128
#: Highest `max_attempts` of a row (the table's photo_jobs_max_attempts_bound_check).
MAX_ATTEMPTS = 1_000_000

_TYPE = re.compile(rf"[A-Za-z0-9_.-]{{1,{MAX_TYPE_LENGTH}}}")
_SHOWN_CHARS = 40


def error_column(text: str) -> str:
    """`text` as a row's `last_error` can hold it: a NUL (which Postgres text refuses, and a
    handler's message about binary data may carry) written `\\x00`, a lone surrogate (which
    UTF-8 cannot encode: `os.fsdecode` of a file name that is not UTF-8) `\\udcff`, cut to
    `MAX_ERROR_CHARS`."""
    text = text.replace("\x00", "\\x00")
    return text.encode("utf-8", "backslashreplace").decode("utf-8")[:MAX_ERROR_CHARS]


def quoted_photo_id(photo_id: str) -> str:
    """A photo id as an HTML form carries it: percent-encoded UTF-8, nothing left bare but
    letters, digits and `_.-~` (no line break for a browser to rewrite)."""
    return urllib.parse.quote(photo_id, safe="")


def unquoted_photo_id(text: str) -> str | None:
    """The photo id that `quoted_photo_id` wrote as `text`, or None for any other text: one
    encoding per id, so a value a page did not write names none of its rows."""
    try:
        photo_id = urllib.parse.unquote(text, errors="strict")
    except UnicodeDecodeError:
        return None
    return photo_id if photo_id and quoted_photo_id(photo_id) == text else None


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def is_valid_type(job_type: object) -> bool:
    """Whether the table would accept `job_type` as a type."""
    return isinstance(job_type, str) and _TYPE.fullmatch(job_type) is not None


def check_photo_id(photo_id: object) -> None:
    """Raises:
    InvalidJobError: `photo_id` is not a non-empty string, is too long, or holds a NUL."""
    if not isinstance(photo_id, str) or not photo_id:
        raise InvalidJobError(f"invalid photo id {_show(photo_id)}: must be a non-empty string")
    if _is_blank(photo_id):
        raise InvalidJobError(f"invalid photo id {_show(photo_id)}: must not be blank")
    try:
        size = len(photo_id.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidJobError(
            f"invalid photo id {_show(photo_id)}: not valid Unicode text (a lone surrogate)"
        ) from None
    if size > MAX_PHOTO_ID_BYTES:
        raise InvalidJobError(
            f"invalid photo id {_show(photo_id)}: {size} bytes long, "
            f"the limit is {MAX_PHOTO_ID_BYTES} (UTF-8)"
        )
    if "\x00" in photo_id:
        raise InvalidJobError(f"invalid photo id {_show(photo_id)}: must not contain NUL")


def _is_blank(text: str) -> bool:
    # Format characters (category Cf: U+200B, U+2060, U+FEFF, ...) show as nothing at all.
    return all(c.isspace() or unicodedata.category(c) == "Cf" for c in text)


def is_blank(photo_id: str) -> bool:
    """Whether `photo_id` is blank: whitespace and invisible format characters alone (or
    empty)."""
    return _is_blank(photo_id)


def check_row_photo_id(photo_id: object) -> None:
    """`check_photo_id` for a photo id that names rows which exist (requeue, cancel): a blank
    id passes (the table holds any id but the empty one, and a blank id is refused only so
    that a slip makes no new row).

    Raises:
        InvalidJobError: `photo_id` is not a non-empty string, is too long, holds a NUL or a
            lone surrogate.
    """
    if isinstance(photo_id, str) and photo_id and _is_blank(photo_id):
        size = len(photo_id.encode("utf-8"))  # blank: no NUL, no surrogate
        if size > MAX_PHOTO_ID_BYTES:
            raise InvalidJobError(
                f"invalid photo id {_show(photo_id)}: {size} bytes long, "
                f"the limit is {MAX_PHOTO_ID_BYTES} (UTF-8)"
            )
        return
    check_photo_id(photo_id)


def check_max_attempts(max_attempts: object) -> None:
    """Raises:
    InvalidJobError: `max_attempts` is not an integer from 1 to `MAX_ATTEMPTS`."""
    if (
        isinstance(max_attempts, bool)
        or not isinstance(max_attempts, int)
        or not 1 <= max_attempts <= MAX_ATTEMPTS
    ):
        raise InvalidJobError(
            f"max_attempts must be an integer from 1 to {MAX_ATTEMPTS:,}, got {_show(max_attempts)}"
        )


def check_job_type(job_type: object) -> None:
    """Raises:
    InvalidJobError: `job_type` is not 1-128 characters of [A-Za-z0-9_.-]."""
    if not is_valid_type(job_type):
        raise InvalidJobError(
            f"invalid job type {_show(job_type)}: must match "
            f"[A-Za-z0-9_.-]{{1,{MAX_TYPE_LENGTH}}}, e.g. photo.process"
        )


def validate_job(photo_id: object, job_type: object) -> None:
    """Refuse a photo id or a type that the table would refuse.

    Raises:
        InvalidJobError: see `check_photo_id` and `check_job_type`.
    """
    check_photo_id(photo_id)
    check_job_type(job_type)


def message_of(exc: BaseException) -> str:
    """`str(exc)`, or what `traceback` shows for an exception whose `__str__` raises."""
    try:
        return str(exc)
    except Exception:
        return "<exception str() failed>"


def error_text(exc: BaseException) -> str:
    """`Type: message` of an exception, password masked, as a row can hold it."""
    return error_column(redact(f"{type(exc).__name__}: {message_of(exc)}"))
