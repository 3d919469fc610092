"""Benchmarks of photo-reactor against real Postgres and Redis (`python -m bench all`)."""
