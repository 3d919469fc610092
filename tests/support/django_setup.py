"""Django configured for a script the tests run in a subprocess: one `default` database, the
one `DATABASE_URL` names (the test's own)."""

from __future__ import annotations

import os
from urllib.parse import unquote, urlsplit

import django
from django.conf import settings


def configure() -> None:
    """`settings.configure` from `DATABASE_URL`, then `django.setup()`."""
    url = urlsplit(os.environ["DATABASE_URL"])
    settings.configure(
        DATABASES={
            "default": {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": url.path.lstrip("/"),
                "USER": unquote(url.username or ""),
                "PASSWORD": unquote(url.password or ""),
                "HOST": url.hostname,
                "PORT": str(url.port or 5432),
            }
        }
    )
    django.setup()
