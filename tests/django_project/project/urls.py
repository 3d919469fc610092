"""The admin, at /admin/, and the upload view."""

from __future__ import annotations

from django.contrib import admin
from django.urls import path
from photos.views import upload  # type: ignore[import-not-found]  # the project's app

urlpatterns = [path("admin/", admin.site.urls), path("upload/", upload)]
