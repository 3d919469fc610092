"""Checks of a job's identity before it reaches the database, as one-line project errors.

The bounds are the table's own (sql/0001 and sql/0005 enforce them too): a photo id is 1 to
`MAX_PHOTO_ID_BYTES` bytes of UTF-8 without NUL; a type is 1 to `MAX_TYPE_LENGTH` of
`[A-Za-z0-9_.-]` (it is the NOTIFY payload and names an RQ queue).
"""

from __future__ import annotations

import re

from reactor.errors import InvalidJobError

__all__ = ["MAX_PHOTO_ID_BYTES", "MAX_TYPE_LENGTH", "check_job_type", "check_photo_id"]

MAX_PHOTO_ID_BYTES = 255
MAX_TYPE_LENGTH = 128

_TYPE = re.compile(r"[A-Za-z0-9_.-]+")


def check_photo_id(photo_id: str) -> None:
    """Raises:
    InvalidJobError: `photo_id` is empty, too long, or holds a NUL character."""
    if not isinstance(photo_id, str) or not photo_id:
        raise InvalidJobError("photo id must be a non-empty string")
    size = len(photo_id.encode("utf-8", "surrogatepass"))
    if size > MAX_PHOTO_ID_BYTES:
        raise InvalidJobError(
            f"photo id is {size} bytes long; the limit is {MAX_PHOTO_ID_BYTES} (UTF-8)"
        )
    if "\x00" in photo_id:
        raise InvalidJobError("photo id must not contain a NUL character")


def check_job_type(job_type: str) -> None:
    """Raises:
    InvalidJobError: `job_type` is empty, too long, or not made of [A-Za-z0-9_.-]."""
    if not isinstance(job_type, str) or not _TYPE.fullmatch(job_type):
        raise InvalidJobError(
            f"job type must be 1-{MAX_TYPE_LENGTH} characters of [A-Za-z0-9_.-], "
            f"not {job_type[:40]!r}"
            if isinstance(job_type, str)
            else "job type must be a string"
        )
    if len(job_type) > MAX_TYPE_LENGTH:
        raise InvalidJobError(
            f"job type is {len(job_type)} characters long; the limit is {MAX_TYPE_LENGTH}"
        )
