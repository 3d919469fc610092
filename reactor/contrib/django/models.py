"""`PhotoJob`: the rows of `photo_jobs`; `ArchivedPhotoJob`: those of `photo_jobs_history`.
Both unmanaged (the SQL migrations own the tables).

The table's key is (photo_id, type); Django's admin takes only a one-column key, so
`photo_id` stands in for it here: query with both (`PhotoJob.objects.filter(photo_id=...,
type=...)`), since `.get(pk=...)` and `pk__in` find a photo's rows of every type; the admin's
checkboxes, actions and row pages go by both, never by this key. Write rows through
`reactor.submit()` and the admin's actions, never `save()`: those keep the fence.
"""

from __future__ import annotations

from django.db import models

STATES = [(s, s) for s in ("pending", "active", "done", "failed", "cancelled")]


class PhotoJob(models.Model):
    photo_id = models.TextField(primary_key=True)
    type = models.TextField()
    state = models.TextField(choices=STATES)
    attempts = models.IntegerField()
    max_attempts = models.IntegerField()
    prior_attempts = models.BigIntegerField()
    next_retry_at = models.DateTimeField(null=True)
    last_error = models.TextField(null=True)
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()
    heartbeat_at = models.DateTimeField(null=True)

    class Meta:
        managed = False
        db_table = "photo_jobs"
        verbose_name = "photo job"
        ordering = ("-updated_at",)

    def __str__(self) -> str:
        return f"{self.type} {self.photo_id} ({self.state})"


class ArchivedPhotoJob(models.Model):
    """A finished life of a photo's job, moved out of `photo_jobs` by `reactor archive`.
    Several lives of one (photo_id, type) may be here; `photo_id` stands in for a key as in
    `PhotoJob`."""

    photo_id = models.TextField(primary_key=True)
    type = models.TextField()
    state = models.TextField(choices=STATES)
    attempts = models.IntegerField()
    max_attempts = models.IntegerField()
    prior_attempts = models.BigIntegerField()
    last_error = models.TextField(null=True)
    created_at = models.DateTimeField()
    finished_at = models.DateTimeField()
    archived_at = models.DateTimeField()

    class Meta:
        managed = False
        db_table = "photo_jobs_history"
        verbose_name = "archived photo job"
        ordering = ("-finished_at",)

    def __str__(self) -> str:
        return f"{self.type} {self.photo_id} ({self.state}, archived)"
