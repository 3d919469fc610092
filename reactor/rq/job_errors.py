"""The error RQ recorded for a failed job, read from Redis without unpickling anything.

RQ keeps a job's results in the stream `rq:results:<job id>` (newest last); a failure's
`exc_string` field is the traceback, zlib-compressed and base64-encoded. Older jobs carry it
in the job hash's `exc_info` field (zlib-compressed, or plain). Both are text: decoding them
runs no code, unlike `Job.fetch` or `Result.restore`, which unpickle the job's data and return
value. Used by the sweep (through `reactor.rq.state`) to say why an attempt's job failed
when the job ended `failed` without the lifecycle recording an outcome (the handler could not
be imported, the worker could not reach the database, the work horse was killed).
"""

from __future__ import annotations

import base64
import binascii
import zlib
from collections.abc import Sequence

import redis
from rq.job import Job
from rq.results import Result

from reactor.jobs import JobRef
from reactor.validate import error_column

__all__ = ["MAX_TRACEBACK_BYTES", "last_line", "read_failure_texts"]

#: The most of a recorded traceback that is inflated to find its last line.
MAX_TRACEBACK_BYTES = 1 << 20


def last_line(traceback_text: str) -> str:
    """The line of a traceback that names the exception, as a row can hold it: the first
    unindented line after the last frame (an exception's message may go on over more lines,
    as Postgres errors do), else the last non-empty line."""
    lines = traceback_text.splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
    if frames:
        for line in lines[frames[-1] + 1 :]:
            if line.strip() and not line[0].isspace():
                return error_column(line.strip())
    text = [line.strip() for line in lines if line.strip()]
    return error_column(text[-1]) if text else ""


def _results_key(job_id: str) -> str:
    key: str = Result.get_key(job_id)  # type: ignore[no-untyped-call]  # rq's is untyped
    return key


def _inflate(raw: bytes) -> str | None:
    """The text of a compressed traceback; None if `raw` is not zlib data. Inflated to at
    most `MAX_TRACEBACK_BYTES`: whoever can write Redis could plant a small value that
    inflates to gigabytes."""
    inflater = zlib.decompressobj()
    try:
        text = inflater.decompress(raw, MAX_TRACEBACK_BYTES)
    except zlib.error:
        return None
    if inflater.unconsumed_tail:
        return f"(a traceback of more than {MAX_TRACEBACK_BYTES} bytes, not read)"
    if not inflater.eof:
        return None  # cut short: not a whole zlib stream
    return text.decode("utf-8", "replace")


def _from_result(entries: list[tuple[bytes, dict[bytes, bytes]]]) -> str | None:
    if not entries:
        return None
    encoded = entries[0][1].get(b"exc_string")
    if not encoded:
        return None
    try:
        return _inflate(base64.b64decode(encoded))
    except binascii.Error:
        return None


def _from_hash(raw: bytes | None) -> str | None:
    if not raw:
        return None
    return _inflate(raw) or raw.decode("utf-8", "replace")


def read_failure_texts(client: redis.Redis, refs: Sequence[JobRef]) -> list[str | None]:
    """For each attempt's job, the last line of the error RQ recorded (None: none found, or
    its keys cannot be read), in one round trip.

    Raises:
        redis.RedisError: Redis failed.
    """
    with client.pipeline(transaction=False) as pipe:
        for ref in refs:
            pipe.xrevrange(_results_key(ref.job_id), "+", "-", count=1)
            pipe.hget(Job.key_for(ref.job_id), "exc_info")
        # A key of the wrong type only loses its own text.
        replies = [
            None if isinstance(r, redis.ResponseError) else r
            for r in pipe.execute(raise_on_error=False)
        ]
    texts: list[str | None] = []
    for i in range(0, len(replies), 2):
        text = _from_result(replies[i] or []) or _from_hash(replies[i + 1])
        texts.append(last_line(text) if text else None)
    return texts
