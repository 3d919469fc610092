"""Drive the admin with Django's test client: the changelist filtered and searched, each row's
page and history reached by the list's links, pages asked for by a bare photo id, the requeue
actions on the rows whose checkboxes the page renders, and the history's list, its rows' pages
and its requeue. Prints one JSON object of what it saw."""

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


def row_links(page: Any) -> dict[str, str]:
    """The link of each row of a list (its photo id column), by `type photo_id`."""
    hrefs = re.findall(r'<th class="field-photo_id"><a href="([^"]*)"', page.content.decode())
    rows = page.context["cl"].result_list
    assert len(hrefs) == len(rows), hrefs
    return {f"{r.type} {r.photo_id}": html.unescape(h) for r, h in zip(rows, hrefs, strict=True)}


def visit(path: str) -> dict[str, Any]:
    """What a GET of `path` shows: the row of a row's page or history (and, on a row's page, its
    History link; on a history, its link back), or where it led and the messages there."""
    page = client.get(path, follow=True)
    shown: dict[str, Any] = {"status": page.status_code}
    if page.redirect_chain:
        shown["led_to"] = page.redirect_chain[-1][0]
        shown["messages"] = [str(m) for m in page.context["messages"]]
        return shown
    if page.status_code != 200:
        return shown
    row = page.context.get("original") or page.context["object"]
    shown["row"] = f"{row.type} {row.photo_id}"
    text = page.content.decode()
    link = re.search(r'<a href="([^"]*)" class="historylink"', text) or re.search(
        r'&rsaquo; <a href="([^"]*/change/)">', text
    )
    shown["link"] = None if link is None else html.unescape(link.group(1))
    return shown


def follow_rows(links: dict[str, str]) -> dict[str, Any]:
    """Each row's page from its link, then the page its link leads to (history, then back)."""
    seen_rows = {}
    for name, link in links.items():
        page = visit(link)
        history = visit(page["link"])
        seen_rows[name] = {"page": page, "history": history, "back": history["link"] == link}
    return seen_rows


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
seen["rows"] = follow_rows(row_links(client.get(url)))
# Asked by a bare photo id, as Django's own links and old bookmarks do.
seen["bare"] = {
    "IMG_1 change": visit(url + "IMG_1/change/"),  # two types: refused, not a 500
    "IMG_1 history": visit(url + "IMG_1/history/"),
    "IMG_1 to_field": visit(url + "IMG_1/change/?_to_field=photo_id"),
    "IMG_1 delete": visit(url + "IMG_1/delete/"),
    "IMG_2 change": visit(url + "IMG_2/change/"),  # one row: its page
    "no row": visit(url + "photo.process_3AIMG_404/change/"),
    "nul": visit(url + "_00/change/"),
}
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
seen["lives"] = follow_rows(row_links(page))
seen["bare_lives"] = {
    "IMG_9": visit(history + "IMG_9/change/"),
    "IMG_1": visit(history + "IMG_1/change/"),
}
act("restore", history, "restore", [lives["photo.process IMG_1"], lives["photo.process IMG_9"]])
print(json.dumps(seen))
