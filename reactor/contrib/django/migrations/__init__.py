"""One migration per SQL file of `sql/` (`reactor.contrib.django.sql_migrations`)."""
