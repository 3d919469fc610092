"""Postgres: connections, the runtime SQL by name, migrations, and the routes recorded there."""
