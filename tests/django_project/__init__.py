"""A Django project for tests/test_django_app.py, run in a subprocess (its own settings)."""
