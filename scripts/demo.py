"""The demo behind `scripts/demo`: the whole flow, end to end, on real servers.

Migrates, starts `reactor run` with the demo route named (`photo.process` to the built-in demo
handler) and one `reactor worker`, submits sample photos through the `reactor submit` command (one
transaction), waits until every one is `done`, prints `reactor status`, and stops everything it
started. Exit code 0 only if every photo is done.

Servers: throwaway ones it starts from the postgres and redis-server binaries and removes at the
end; DEMO_DATABASE_URL / DEMO_REDIS_URL name servers of yours instead (the demo then writes
there: the `photo_jobs` rows of its photos, the RQ queue `photo-process`, its route). It never
uses DATABASE_URL / REDIS_URL (an application's, exported for `reactor` a line later in the
quickstart) nor any `REACTOR_` setting of the shell: its reactor and worker would join that
application's queue with the demo's route. Given a Redis whose queue `photo-process` already
has jobs or workers (another deployment's: they would take the demo's jobs and it theirs), it
refuses at once (exit 2). A reactor or worker of the demo that exits early ends the demo at once,
saying so (exit 1).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import redis
from rq import Queue, Worker

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from reactor.routes import DEMO_ROUTE  # noqa: E402
from tests.support.servers import PostgresServer, RedisServer  # noqa: E402

#: What each started process is, in the order they start.
_NAMES = ("reactor run", "reactor worker")


def _queue_in_use(url: str) -> str:
    """What already uses the demo's queue on the Redis at `url` ("" if nothing)."""
    with redis.Redis.from_url(url) as client:
        queue = Queue("photo-process", connection=client)
        jobs, workers = queue.count, len(Worker.all(queue=queue))
    found = [f"{n} {what}" for n, what in ((jobs, "jobs"), (workers, "workers")) if n]
    return "already has " + " and ".join(found) if found else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--photos", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=120.0)
    options = parser.parse_args()
    started: list[PostgresServer | RedisServer] = []
    procs: list[subprocess.Popen[bytes]] = []
    try:
        database_url = os.environ.get("DEMO_DATABASE_URL", "")
        if not database_url:
            pg = PostgresServer()
            started.append(pg)
            database_url = pg.url
            print(f"demo: started a throwaway PostgreSQL on port {pg.port}")
        redis_url = os.environ.get("DEMO_REDIS_URL", "")
        if not redis_url:
            rs = RedisServer()
            started.append(rs)
            redis_url = rs.url
            print(f"demo: started a throwaway Redis on port {rs.port}")

        if os.environ.get("DEMO_REDIS_URL") and (busy := _queue_in_use(redis_url)):
            print(
                f"demo: queue photo-process on DEMO_REDIS_URL {busy}: another deployment uses"
                " this Redis database; name one nothing else uses",
                file=sys.stderr,
            )
            return 2
        env = {k: v for k, v in os.environ.items() if not k.startswith("REACTOR_")}
        env.update(DATABASE_URL=database_url, REDIS_URL=redis_url)
        reactor = [sys.executable, "-m", "reactor"]
        subprocess.run([*reactor, "migrate"], env=env, check=True)
        procs.append(subprocess.Popen([*reactor, "run", "--route", DEMO_ROUTE], env=env))
        procs.append(subprocess.Popen([*reactor, "worker", "--route", DEMO_ROUTE], env=env))
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
                if ended := [p for p in procs if p.poll() is not None]:
                    names = ", ".join(
                        f"{_NAMES[procs.index(p)]} (exit {p.returncode})" for p in ended
                    )
                    print(f"demo: stopped early: {names}; {done} of {len(photos)} photos done")
                    return 1
                time.sleep(0.2)
        late = "" if done == len(photos) else f" (timed out after {options.timeout:g} s)"
        print(f"demo: {done} of {len(photos)} photos done{late}")
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
    try:
        raise SystemExit(main())
    except RuntimeError as exc:  # a server that cannot be started here: say what is missing
        raise SystemExit(f"demo: {exc}") from None
