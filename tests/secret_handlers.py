"""A handler whose errors carry a password in each of the forms people and libraries write
one, for the redaction tests. The secret is assembled at run time, so the source lines a
traceback quotes never hold it."""

from __future__ import annotations

import json

from psycopg.conninfo import conninfo_to_dict

#: Pieces of the secret: none may appear in any output.
SECRET_HEAD = "Hunter"
SECRET_TAIL = "2Sekret"


def _secret() -> str:
    return SECRET_HEAD + SECRET_TAIL


def leak(photo_id: str) -> None:
    """Raise an error holding the password in the form `photo_id` names (see `FORMS`)."""
    secret = _secret()
    if photo_id == "conninfo-percent":
        conninfo_to_dict(f"postgresql://app:{secret}%zz@db/app")  # psycopg echoes the token
    if photo_id == "conninfo-space":
        conninfo_to_dict(f"postgresql://app:{secret[:3]} {secret[3:]}@db/app")
    texts = {
        "pgpassword": f"psql exited 2 (env PGPASSWORD={secret} PGHOST=db)",
        "dict-single": f"bad settings: { ({'host': 'db', 'password': secret})!r}",
        "dict-double": f"bad settings: {json.dumps({'user': 'app', 'password': secret})}",
        "passwd": f"ftp login refused: user=app passwd={secret}",
    }
    raise RuntimeError(texts[photo_id])


#: The photo ids `leak` knows, one per form.
FORMS = (
    "pgpassword",
    "dict-single",
    "dict-double",
    "passwd",
    "conninfo-percent",
    "conninfo-space",
)
