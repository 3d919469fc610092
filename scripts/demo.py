"""The demo behind `scripts/demo`: the whole flow, end to end, on real servers.

Migrates, starts `reactor run` and one `reactor worker`, submits sample photos through the
`reactor submit` command (one transaction), waits until every one is `done`, prints
`reactor status`, and stops everything it started. Exit code 0 only if every photo is done.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psycopg
from psycopg import sql

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.servers import PostgresServer, RedisServer  # noqa: E402

DEMO_DATABASE = "photo_reactor_demo"


def answers(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--photos", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=120.0)
    options = parser.parse_args()
    started: list[PostgresServer | RedisServer] = []
    procs: list[subprocess.Popen[bytes]] = []
    try:
        database_url = os.environ.get("DATABASE_URL", "")
        if not database_url:
            if answers(5432):
                admin_url = "postgresql://127.0.0.1:5432/postgres"
                with psycopg.connect(admin_url, autocommit=True) as admin:
                    exists = admin.execute(
                        "SELECT 1 FROM pg_database WHERE datname = %s", [DEMO_DATABASE]
                    ).fetchone()
                    if not exists:
                        admin.execute(
                            sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DEMO_DATABASE))
                        )
                database_url = f"postgresql://127.0.0.1:5432/{DEMO_DATABASE}"
                print(f"demo: using the local PostgreSQL, database {DEMO_DATABASE}")
            else:
                pg = PostgresServer()
                started.append(pg)
                database_url = pg.url
                print(f"demo: started a throwaway PostgreSQL on port {pg.port}")
        redis_url = os.environ.get("REDIS_URL", "")
        if not redis_url:
            if answers(6379):
                redis_url = "redis://127.0.0.1:6379/0"
                print("demo: using the local Redis")
            else:
                rs = RedisServer()
                started.append(rs)
                redis_url = rs.url
                print(f"demo: started a throwaway Redis on port {rs.port}")

        env = {**os.environ, "DATABASE_URL": database_url, "REDIS_URL": redis_url}
        reactor = [sys.executable, "-m", "reactor"]
        subprocess.run([*reactor, "migrate"], env=env, check=True)
        procs.append(subprocess.Popen([*reactor, "run"], env=env))
        procs.append(subprocess.Popen([*reactor, "worker"], env=env))
        photos = [f"demo-photo-{i}" for i in range(1, options.photos + 1)]
        subprocess.run([*reactor, "submit", *photos], env=env, check=True)

        deadline = time.monotonic() + options.timeout
        done = 0
        with psycopg.connect(database_url, autocommit=True) as conn:
            while time.monotonic() < deadline:
                row = conn.execute(
                    "SELECT count(*) FILTER (WHERE state = 'done') FROM photo_jobs"
                    " WHERE photo_id = ANY(%s)",
                    [photos],
                ).fetchone()
                done = int(row[0]) if row else 0
                if done == len(photos):
                    break
                time.sleep(0.2)
        print(f"demo: {done} of {len(photos)} photos done")
        subprocess.run([*reactor, "status"], env=env, check=True)
        return 0 if done == len(photos) else 1
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)
        for server in started:
            if isinstance(server, PostgresServer):
                server.stop()
            else:
                server.close()


if __name__ == "__main__":
    raise SystemExit(main())
