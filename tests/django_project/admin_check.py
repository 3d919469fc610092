"""Drive the admin with Django's test client: the changelist filtered and searched, the
requeue actions, and the history's list and its requeue. Prints one JSON object of what it
saw."""

from __future__ import annotations

import json
import os

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
seen = {}
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
# Select every row (one photo id may stand for rows of several types), under a filter.
selected = ["IMG_1", "IMG_2", "IMG_3", "IMG_4"]
for action, query in (("requeue_failed", "?type__exact=photo.process"), ("requeue_done", "")):
    page = client.post(url + query, {"action": action, "_selected_action": selected}, follow=True)
    seen[action] = {
        "status": page.status_code,
        "messages": [str(m) for m in page.context["messages"]],
    }
history = "/admin/reactor/archivedphotojob/"
page = client.get(history)
seen["history"] = {
    "status": page.status_code,
    "photos": sorted(r.photo_id for r in page.context["cl"].result_list),
}
page = client.post(
    history, {"action": "restore", "_selected_action": ["IMG_1", "IMG_9"]}, follow=True
)
seen["restore"] = {
    "status": page.status_code,
    "messages": [str(m) for m in page.context["messages"]],
}
print(json.dumps(seen))
