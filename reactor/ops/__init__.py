"""Operator tools: status, failures, pause, requeue and prune, the dashboard."""
