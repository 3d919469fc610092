"""photo-reactor's Django app (`pip install 'photo-reactor[django]'`, then
`"reactor.contrib.django"` in `INSTALLED_APPS`).

- `manage.py migrate` creates the tables with the project's own SQL files: one Django
  migration per file of `sql/`, each running the packaged file as it is
  (`reactor.contrib.django.sql_migrations`). A file already applied by `reactor migrate` or
  psql is recognised in the ledger and skipped; `reactor migrate` after `manage.py migrate`
  finds nothing to do.
- `PhotoJob`, an unmanaged model over `photo_jobs`, and its admin: a list by type and
  state, search by exact photo id, `last_error`, each row's page (read-only) and history at
  its (type, photo id), and actions that requeue the ticked failed or done rows, each a (type,
  photo id), with the statement `reactor requeue` runs (fenced: only done/failed rows move),
  each run logged. Migration 0022 puts the models in Django's state (no SQL), so their
  permissions exist.
- `manage.py reactor ...` (or `call_command("reactor", ...)`) runs the `reactor` command on
  `settings.DATABASES["default"]`.
"""
