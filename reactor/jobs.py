"""RQ job identity: deterministic, injective, RQ-valid job ids, and the job's metadata.

An attempt's job id is a pure function of (type, photo_id, token), so the reactor can find
the job of an attempt it may already have enqueued (a COMMIT lost after the enqueue) instead of
enqueueing it twice. The token is the row's `prior_attempts + attempts` at the dispatch: it
grows by one with every dispatch over the row's whole history, across re-arms, so a job id
never repeats for a row and a job of an earlier life is never taken for a later one's.

RQ accepts only `[A-Za-z0-9_-]+` in an id; photo ids are arbitrary text.
Encoding: ASCII letters and digits stand for themselves; every other character becomes `_xx`
for each byte of its UTF-8 form (so `_` itself is `_5f`); the three parts are joined with `-`,
which the encoding never produces. Hence ids are valid, readable for ordinary photo ids, and
distinct inputs give distinct ids (`parse_job_id` inverts `job_id`).

Bounded length: a part whose encoding is longer than `MAX_ENCODED_PART` characters is written
`_h` followed by the 64 hex digits of the SHA-256 of its UTF-8 form. The encoding never
produces `_h` (an escape is `_` and two hex digits), so a hashed part never equals an encoded
one, and two hashed parts are equal only for equal inputs (barring a SHA-256 collision). A job
id is thus at most 2 x 200 + 21 characters (a token has at most 19 digits), whatever the
photo id holds; `parse_job_id` cannot invert a hashed part (`job.meta` carries the photo id).
"""

from __future__ import annotations

import hashlib
import re
import uuid
from dataclasses import dataclass, field
from functools import cached_property

__all__ = [
    "ENTRY_POINT",
    "MAX_ENCODED_PART",
    "JobRef",
    "job_id",
    "parse_job_id",
    "short_id",
    "shown_type",
    "warm_up_ref",
]

#: The function every dispatched job runs: the worker-side lifecycle around the handler.
ENTRY_POINT = "reactor.worker.perform"

#: Characters of a photo id that log lines show (ids are outside input, up to 255 bytes).
LOGGED_ID_CHARS = 64

#: Longest encoded part kept as it is; a longer one is hashed.
MAX_ENCODED_PART = 200
_HASHED = "_h"

_PLAIN = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")
_ESCAPE = re.compile(r"_([0-9a-f]{2})")
_ALL_PLAIN = re.compile(r"[A-Za-z0-9]*")


@dataclass(frozen=True)
class JobRef:
    """The attempt an RQ job belongs to: its row and the row's token at the dispatch."""

    type: str
    photo_id: str
    token: int
    #: The row's stored W3C trace context (`reactor.tracing`), carried in `job.meta`; not part
    #: of the attempt's identity.
    traceparent: str | None = field(default=None, compare=False)
    tracestate: str | None = field(default=None, compare=False)

    @cached_property
    def job_id(self) -> str:
        # Built once per ref: a batch asks for it several times (dedup check, enqueue).
        return job_id(self.type, self.photo_id, self.token)

    def meta(self) -> dict[str, object]:
        """What `job.meta` carries, so tools can map a job back to its row (and the row's
        trace context, when it has one)."""
        meta: dict[str, object] = {
            "type": self.type,
            "photo_id": self.photo_id,
            "token": self.token,
        }
        if self.traceparent is not None:
            meta["traceparent"] = self.traceparent
            if self.tracestate is not None:
                meta["tracestate"] = self.tracestate
        return meta


def shown_type(job_type: str) -> str:
    """A type for a log line: as it is when printable without blanks (every valid one), else
    its repr (a job from Redis may carry anything)."""
    return job_type if job_type.isprintable() and " " not in job_type else repr(job_type)


def short_id(photo_id: str) -> str:
    """A photo id for a log line: its repr (control characters escaped), cut to
    `LOGGED_ID_CHARS` characters with the full length said."""
    if len(photo_id) <= LOGGED_ID_CHARS:
        return repr(photo_id)
    return f"{photo_id[:LOGGED_ID_CHARS]!r}...({len(photo_id)} chars)"


def _encode(text: str) -> str:
    if _ALL_PLAIN.fullmatch(text):
        encoded = text  # the common case, without a pass per character
    else:
        encoded = "".join(
            ch if ch in _PLAIN else "".join(f"_{b:02x}" for b in ch.encode("utf-8")) for ch in text
        )
    if len(encoded) > MAX_ENCODED_PART:
        return _HASHED + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    return encoded


def _decode(text: str) -> str:
    raw = bytearray()
    pos = 0
    for match in _ESCAPE.finditer(text):
        raw += text[pos : match.start()].encode("ascii")
        raw.append(int(match.group(1), 16))
        pos = match.end()
    raw += text[pos:].encode("ascii")
    return raw.decode("utf-8")


def job_id(job_type: str, photo_id: str, token: int) -> str:
    """The RQ job id of one attempt (`token`) of one row."""
    return f"{_encode(job_type)}-{_encode(photo_id)}-{token}"


def parse_job_id(value: str) -> JobRef:
    """Invert `job_id`.

    Raises:
        ValueError: `value` is not a job id this module made.
    """
    parts = value.split("-")
    if len(parts) != 3 or not parts[2].isdigit():
        raise ValueError(f"not a photo-reactor job id: {value[:100]!r}")
    if any(part.startswith(_HASHED) for part in parts[:2]):
        raise ValueError("a hashed job id cannot be inverted: read the job's meta")
    return JobRef(_decode(parts[0]), _decode(parts[1]), int(parts[2]))


def warm_up_ref() -> JobRef:
    """A throwaway attempt that no row or route has, for a process's start-up rehearsal
    (`reactor.pg.db.rehearse`): its row is rolled back and its job never sent."""
    return JobRef("reactor.warm-up", f"warm-up-{uuid.uuid4().hex}", 1)
