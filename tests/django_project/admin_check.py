"""Drive the admin with Django's test client: the changelist filtered and searched (and the
queries a page runs, its order, its type filter's choices), each row's page and history reached
by the list's links, pages asked for by a bare photo id, values the database refuses, the
requeue actions on the rows whose checkboxes the page renders, and the history's list, its
rows' pages and its requeue; then what the actions wrote to the log and the admin's log. Prints
one JSON object of what it saw."""

from __future__ import annotations

import html
import json
import logging
import os
import re
from typing import Any

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
django.setup()

from django.contrib.admin.models import LogEntry  # noqa: E402
from django.contrib.auth.models import User  # noqa: E402
from django.db import connection  # noqa: E402
from django.test import Client  # noqa: E402
from django.test.utils import CaptureQueriesContext, setup_test_environment  # noqa: E402

from reactor.contrib.django.filters import TypeListFilter  # noqa: E402

setup_test_environment()  # responses carry their template context


class Lines(logging.Handler):
    """The messages of the records it is handed."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


audit_log = Lines()
admin_logger = logging.getLogger("reactor.contrib.django.admin")
admin_logger.addHandler(audit_log)
admin_logger.setLevel(logging.INFO)

user = User.objects.create_superuser("admin", "admin@example.com", "pw")
client = Client()
client.force_login(user)
quiet = Client(raise_request_exception=False)  # a 500 is a status here, not an exception
quiet.force_login(user)
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


def probe(path: str, data: dict[str, Any] | None = None) -> dict[str, Any]:
    """A GET (with `data`, a POST) of `path`: its status, where it redirects, and the messages
    of the page there."""
    page = quiet.get(path) if data is None else quiet.post(path, data)
    shown: dict[str, Any] = {"status": page.status_code, "location": page.get("Location")}
    if page.status_code == 302:
        there = quiet.get(page["Location"])
        shown["messages"] = [str(m) for m in there.context["messages"]]
    return shown


def queries_of(path: str) -> list[str]:
    """The SQL a GET of `path` runs."""
    with CaptureQueriesContext(connection) as ran:
        client.get(path)
    return [q["sql"] for q in ran.captured_queries]


def type_choices(path: str) -> dict[str, Any]:
    """The type filter's choices on the list at `path` (All left out), and the selected one."""
    page = client.get(path)
    cl = page.context["cl"]
    [spec] = [s for s in cl.filter_specs if s.title == "type"]
    choices = list(spec.choices(cl))[1:]
    return {
        "types": [c["display"] for c in choices],
        "selected": [c["display"] for c in choices if c["selected"]],
    }


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
    "search_lower": "?q=img_2",  # exact: not IMG_2
    "search_two": "?q=IMG_2+IMG_4",  # a row matches any term
    "search_quoted": "?q=%22IMG_2%22+%27IMG_4%27",  # quoted terms, as Django's box takes them
    "search_nul": "?q=%00",  # never reaches Postgres
}.items():
    page = client.get(url + query)
    seen[name] = {
        "status": page.status_code,
        "photos": sorted(r.photo_id for r in page.context["cl"].result_list),
        "html_has_error": "boom IMG_1" in page.content.decode(),
    }
# The list's order: by key unfiltered, newest first under a state an index keeps by updated_at.
seen["order"] = {
    name: [f"{r.type} {r.photo_id}" for r in client.get(url + query).context["cl"].result_list]
    for name, query in {"all": "", "failed": "?state__exact=failed"}.items()
}
sql = {"all": queries_of(url), "failed": queries_of(url + "?state__exact=failed")}
seen["queries"] = {
    name: {
        "distinct": sum("DISTINCT" in q and '"photo_jobs"' in q for q in ran),
        "counts": sum('"__count"' in q for q in ran),
    }
    for name, ran in sql.items()
}
seen["queries"]["search_upper"] = sum("UPPER(" in q for q in queries_of(url + "?q=IMG_2"))
seen["type_choices"] = {"all": type_choices(url)}
TypeListFilter.sampled_rows = 0  # no row read: the routes', paused, pending and ANALYZE's types
seen["type_choices"]["bounded"] = type_choices(url)
seen["type_choices"]["selected"] = type_choices(url + "?type=photo.thumb")
TypeListFilter.sampled_rows = 1000
seen["type_choices"]["history"] = type_choices(history)
# Values the database refuses: answered as Django answers a bad lookup, never a 500.
seen["refused"] = {
    "state_nul": probe(url + "?state__exact=%00"),
    "type_nul": probe(url + "?type__exact=%00"),
    "type_filter_nul": probe(url + "?type=%00"),
    "regex": probe(url + "?last_error__regex=("),
    "history_regex": probe(history + "?last_error__regex=("),
    "key_nul": probe(url + "photo.process:%2500/change/"),
    "life_key_nul": probe(history + "photo.process:%2500:2024-01-01T00:00:00+00:00/change/"),
    "action_nul": probe(url, {"action": "requeue_failed", "_selected_action": "photo.process:%00"}),
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
seen["audit"] = {
    "log": audit_log.lines,
    "entries": [
        [e.user.username, e.content_type.model, e.object_repr, e.change_message]
        for e in LogEntry.objects.order_by("id")
    ],
}
print(json.dumps(seen))
