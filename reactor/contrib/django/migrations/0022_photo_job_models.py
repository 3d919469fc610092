"""The models `PhotoJob` and `ArchivedPhotoJob` in Django's migration state, and nothing in the
database (the SQL migrations made their tables): without them Django knew no model of this app,
so it made no content types or permissions (a staff user could not be given the admin) and
`makemigrations` wanted to write a migration into the installed package. It must match
models.py: `makemigrations --check` fails while it does not. Every SQL migration after 0021
depends on it too (`sql_migrations.MODELS_STATE`), so the app's migrations keep one leaf."""

from django.db import migrations, models

STATES = [(s, s) for s in ("pending", "active", "done", "failed", "cancelled")]


class Migration(migrations.Migration):
    dependencies = (("reactor", "0021_pin_function_search_paths"),)

    operations = (
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name="ArchivedPhotoJob",
                    fields=[
                        ("photo_id", models.TextField(primary_key=True, serialize=False)),
                        ("type", models.TextField()),
                        ("state", models.TextField(choices=STATES)),
                        ("attempts", models.IntegerField()),
                        ("max_attempts", models.IntegerField()),
                        ("prior_attempts", models.BigIntegerField()),
                        ("last_error", models.TextField(null=True)),
                        ("created_at", models.DateTimeField()),
                        ("finished_at", models.DateTimeField()),
                        ("archived_at", models.DateTimeField()),
                    ],
                    options={
                        "verbose_name": "archived photo job",
                        "db_table": "photo_jobs_history",
                        "ordering": ("-finished_at",),
                        "managed": False,
                    },
                ),
                migrations.CreateModel(
                    name="PhotoJob",
                    fields=[
                        ("photo_id", models.TextField(primary_key=True, serialize=False)),
                        ("type", models.TextField()),
                        ("state", models.TextField(choices=STATES)),
                        ("attempts", models.IntegerField()),
                        ("max_attempts", models.IntegerField()),
                        ("prior_attempts", models.BigIntegerField()),
                        ("next_retry_at", models.DateTimeField(null=True)),
                        ("last_error", models.TextField(null=True)),
                        ("created_at", models.DateTimeField()),
                        ("updated_at", models.DateTimeField()),
                        ("heartbeat_at", models.DateTimeField(null=True)),
                    ],
                    options={
                        "verbose_name": "photo job",
                        "db_table": "photo_jobs",
                        "ordering": ("-updated_at",),
                        "managed": False,
                    },
                ),
            ],
        ),
    )
