"""The test project's application: a view that submits, a handler, and their tests (the
examples of docs/testing.md)."""
