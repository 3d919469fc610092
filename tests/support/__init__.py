"""What the test modules share: throwaway servers, per-test databases and Redis dbs, running
the CLI and long-running processes, waiting on conditions, and reading the state of the table,
of RQ, of the doorbell and of the metrics.

Test modules import from here and never from each other; `tests/conftest.py` holds only the
fixtures. `servers` is also used by the benchmarks and `scripts/demo.py` (one way to start a
throwaway server); nothing else here is meant for them.
"""
