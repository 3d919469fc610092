"""Integrations with application frameworks, each optional (installed through its extra)."""
