"""The `reactor` command (also `python -m reactor`)."""

from reactor.cli.main import main

__all__ = ["main"]
