"""The application's handler."""

from __future__ import annotations

from reactor import PermanentError


def process(photo_id: str) -> None:
    if not photo_id.startswith("IMG_"):
        raise PermanentError(f"{photo_id} is not a photo id")
