"""The app's configuration: label `reactor`, so its tables' migrations are `reactor.0001_...`."""

from __future__ import annotations

from django.apps import AppConfig


class ReactorConfig(AppConfig):
    name = "reactor.contrib.django"
    label = "reactor"
    verbose_name = "photo-reactor"
    default_auto_field = "django.db.models.BigAutoField"
