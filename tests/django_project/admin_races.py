"""Drive the admin's requeue actions against rows that change under them: a page's checkbox
acts on the life of the row the page showed (a row submitted again and run to done since is
left alone), and an action behind a row another session holds gives up, doing nothing, after
the lock timeout. Prints one JSON object of what it saw."""

from __future__ import annotations

import html
import json
import os
import re
import threading
import time
from typing import Any

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
django.setup()

import psycopg  # noqa: E402
from django.contrib.auth.models import User  # noqa: E402
from django.db import connection, transaction  # noqa: E402
from django.test import Client  # noqa: E402
from django.test.utils import setup_test_environment  # noqa: E402

import reactor  # noqa: E402
from reactor.contrib.django import actions  # noqa: E402

setup_test_environment()  # responses carry their template context

url = "/admin/reactor/photojob/"
client = Client()
client.force_login(User.objects.create_superuser("admin", "admin@example.com", "pw"))
seen: dict[str, Any] = {}


def rows() -> dict[str, list[Any]]:
    """Each row's state and token, by photo id."""
    with connection.cursor() as cur:
        cur.execute("SELECT photo_id, state, prior_attempts + attempts FROM photo_jobs")
        return {r[0]: [r[1], r[2]] for r in cur.fetchall()}


def checkboxes(path: str) -> dict[str, str]:
    """The value of each row's checkbox on the list at `path`, by photo id."""
    page = client.get(path)
    values = re.findall(r'name="_selected_action" value="([^"]*)"', page.content.decode())
    found = page.context["cl"].result_list
    return {r.photo_id: html.unescape(v) for r, v in zip(found, values, strict=True)}


def act(action: str, selected: list[str], path: str = url) -> dict[str, Any]:
    started = time.monotonic()
    page = client.post(path, {"action": action, "_selected_action": selected}, follow=True)
    return {
        "messages": [str(m) for m in page.context["messages"]],
        "seconds": round(time.monotonic() - started, 1),
    }


# The list of done rows, as an operator loads it; then the application submits IMG_D1 again
# and a worker runs that new life to done, before the operator ticks it on the page.
done = checkboxes(url + "?state__exact=done")
seen["shown"] = rows()
with transaction.atomic():
    reactor.submit(connection, "IMG_D1")
with connection.cursor() as cur:
    cur.execute("UPDATE photo_jobs SET state = 'active', attempts = 1 WHERE photo_id = 'IMG_D1'")
    cur.execute("UPDATE photo_jobs SET state = 'done' WHERE photo_id = 'IMG_D1'")
seen["ran_again"] = rows()["IMG_D1"]
seen["stale_page"] = act("requeue_done", [done["IMG_D1"], done["IMG_D2"]])
seen["after_stale_page"] = rows()


def held(statement: str, action: str, selected: list[str], path: str = url) -> dict[str, Any]:
    """`act` while another session, having run `statement`, holds its rows (an operator's
    open transaction); it lets go after 20 s at the latest."""
    holder = psycopg.connect(os.environ["APP_DATABASE"])
    holder.execute(statement)
    release = threading.Timer(20, holder.rollback)
    release.start()
    try:
        return act(action, selected, path)
    finally:
        release.cancel()
        holder.rollback()
        holder.close()


# Behind a row another session holds, an action gives up after the lock timeout (shortened
# here), doing nothing; then, the row let go, it runs.
actions.LOCK_TIMEOUT_MS = 300
failed = checkboxes(url + "?state__exact=failed")
ticked = [failed["IMG_F1"], failed["IMG_F2"]]
lock = "SELECT FROM photo_jobs WHERE photo_id = 'IMG_F1' FOR UPDATE"
seen["held"] = held(lock, "requeue_failed", ticked)
seen["after_held"] = rows()
seen["released"] = act("requeue_failed", ticked)
seen["after_released"] = rows()
# The history's action, behind a session inserting the row it would bring back.
history = "/admin/reactor/archivedphotojob/"
life = checkboxes(history)["IMG_H"]
insert = "INSERT INTO photo_jobs (photo_id, type) VALUES ('IMG_H', 'photo.process')"
seen["restore_held"] = held(insert, "restore", [life], history)
seen["restored"] = act("restore", [life], history)
print(json.dumps(seen))
