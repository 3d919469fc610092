"""The project's package."""
