"""`manage.py reactor`."""
