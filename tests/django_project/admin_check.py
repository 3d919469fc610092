"""Drive the admin with Django's test client: the changelist filtered and searched, the
requeue actions on the rows whose checkboxes the page renders, and the history's list and its
requeue. Prints one JSON object of what it saw."""

from __future__ import annotations

import html
import json
import os
import re
from typing import Any

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
django.setup()

from django.contrib.auth.models import User  # noqa: E402
from django.test import Client  # noqa: E402
from django.test.utils import setup_test_environment  # noqa: E402

setup_test_environment()  # responses carry their template context

user = User.objects.create_superuser("admin", "admin@example.com", "pw")
client = Client()
client.force_login(user)
url = "/admin/reactor/photojob/"
history = "/admin/reactor/archivedphotojob/"
seen: dict[str, Any] = {}


def checkboxes(page: Any) -> dict[str, str]:
    """The value of each row's checkbox, by `type photo_id`, as the page renders them."""
    values = re.findall(r'name="_selected_action" value="([^"]*)"', page.content.decode())
    rows = page.context["cl"].result_list
    assert len(values) == len(rows)
    return {f"{r.type} {r.photo_id}": html.unescape(v) for r, v in zip(rows, values, strict=True)}


def act(name: str, path: str, action: str, selected: list[str], **extra: str) -> None:
    data = {"action": action, "_selected_action": selected, **extra}
    page = client.post(path, data, follow=True)
    seen[name] = {
        "status": page.status_code,
        "messages": [str(m) for m in page.context["messages"]],
    }


for name, query in {
    "all": "",
    "failed": "?state__exact=failed",
    "thumb": "?type__exact=photo.thumb",
    "search": "?q=IMG_2",
}.items():
    page = client.get(url + query)
    seen[name] = {
        "status": page.status_code,
        "photos": sorted(r.photo_id for r in page.context["cl"].result_list),
        "html_has_error": "boom IMG_1" in page.content.decode(),
    }
box = checkboxes(client.get(url))
seen["checkboxes"] = box
# One row of a photo failed in two types: only the ticked one.
act("requeue_one", url, "requeue_failed", [box["photo.process IMG_1"]])
# Every row ticked, under a type filter: only that type's rows.
act("requeue_done", url + "?type__exact=photo.process", "requeue_done", list(box.values()))
# A photo id holding a line break, `%` and `:`.
act("requeue_odd", url, "requeue_done", [box["photo.thumb odd\r\n100%:IMG_2"]])
# A bare photo id, as the checkboxes carried before: refused, nothing done.
act("requeue_bare", url, "requeue_failed", ["IMG_4"])
# "Select all" under a filter: every row the list shows.
thumbs = url + "?type__exact=photo.thumb"
act("requeue_across", thumbs, "requeue_failed", [box["photo.thumb IMG_4"]], select_across="1")

page = client.get(history)
seen["history"] = {
    "status": page.status_code,
    "photos": sorted(r.photo_id for r in page.context["cl"].result_list),
}
lives = checkboxes(page)
act("restore", history, "restore", [lives["photo.process IMG_1"], lives["photo.process IMG_9"]])
print(json.dumps(seen))
