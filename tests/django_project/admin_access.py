"""Drive the admin as staff users who are not superusers: one with no permission of the app,
one with the view permissions, one that may also change photo jobs. For each: whether the
index lists the app, the list and the history (their actions), and a requeue of the failed row
IMG_P. Prints one JSON object of what it saw."""

from __future__ import annotations

import json
import os
from typing import Any

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
django.setup()

from django.contrib.auth.models import Permission, User  # noqa: E402
from django.test import Client  # noqa: E402
from django.test.utils import setup_test_environment  # noqa: E402

from reactor.contrib.django.models import PhotoJob  # noqa: E402

setup_test_environment()  # responses carry their template context

url = "/admin/reactor/photojob/"
history = "/admin/reactor/archivedphotojob/"
granted = Permission.objects.filter(content_type__app_label="reactor")
seen: dict[str, Any] = {"permissions": sorted(granted.values_list("codename", flat=True))}


def actions(page: Any) -> list[str]:
    """The actions a list offers (none: Django renders no action form)."""
    form = page.context["action_form"]
    return [] if form is None else [c for c, _ in form.fields["action"].choices if c]


for name, codenames in {
    "none": [],
    "viewer": ["view_photojob", "view_archivedphotojob"],
    "operator": ["view_photojob", "change_photojob", "view_archivedphotojob"],
}.items():
    user = User.objects.create_user(name, password="pw", is_staff=True)
    user.user_permissions.set(granted.filter(codename__in=codenames))
    client = Client()
    client.force_login(user)
    shown: dict[str, Any] = {"index": url in client.get("/admin/").content.decode()}
    page = client.get(url)
    shown["list"] = page.status_code
    if page.status_code == 200:
        shown["photos"] = sorted(r.photo_id for r in page.context["cl"].result_list)
        shown["actions"] = actions(page)
    page = client.get(history)
    shown["history"] = page.status_code
    if page.status_code == 200:
        shown["history_actions"] = actions(page)
    # The checkbox's value as the list renders it: the row's key, then its token.
    data = {"action": "requeue_failed", "_selected_action": ["photo.process:IMG_P:1"]}
    page = client.post(url, data, follow=True)
    shown["requeue"] = page.status_code
    if page.redirect_chain:
        shown["messages"] = [str(m) for m in page.context["messages"]]
    if page.status_code == 200:
        shown["state_after"] = PhotoJob.objects.get(photo_id="IMG_P", type="photo.process").state
    seen[name] = shown
print(json.dumps(seen))
