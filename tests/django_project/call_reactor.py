"""Run the `reactor` command through `call_command`, as a Django program does in its own
process: `status --json` (on stdout, parsed), then `status --nope` (a CommandError), and what
the process's environment and logging set-up are afterwards. Prints one JSON object."""

from __future__ import annotations

import io
import json
import logging
import os
from typing import Any

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
django.setup()

from django.core.management import CommandError, call_command  # noqa: E402

os.environ.pop("DATABASE_URL", None)
root = logging.getLogger()
own = logging.NullHandler()  # the program's own logging set-up
root.handlers[:] = [own]
root.setLevel(logging.WARNING)

out, err = io.StringIO(), io.StringIO()
returned = call_command("reactor", "status", "--json", stdout=out, stderr=err)
status = json.loads(out.getvalue())
[process] = [t for t in status["types"] if t["type"] == "photo.process"]
seen: dict[str, Any] = {
    "returned": returned,
    "pending": process["counts"]["pending"],
    "stderr": err.getvalue(),
}
err = io.StringIO()
try:
    call_command("reactor", "status", "--nope", stdout=io.StringIO(), stderr=err)
except CommandError as exc:
    seen["bad"] = {"error": str(exc), "returncode": exc.returncode, "stderr": err.getvalue()}
seen["restored"] = {
    "database_url": os.environ.get("DATABASE_URL"),
    "handlers": root.handlers == [own],
    "level": logging.getLevelName(root.level),
}
print(json.dumps(seen))
