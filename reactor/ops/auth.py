"""Who may use the dashboard when its actions are on (`reactor dashboard --actions`).

Credentials come from the environment, never from flags (`ps` shows flags):
- `REACTOR_DASHBOARD_TOKEN` (may act) and `REACTOR_DASHBOARD_READ_TOKEN` (may only look):
  bearer tokens, sent as `Authorization: Bearer TOKEN` (scripts);
- `REACTOR_DASHBOARD_USERS`: comma-separated `NAME:HASH` (may act) or `NAME:HASH:read-only`
  entries for basic auth (browsers), where HASH is what `reactor dashboard --hash-password`
  prints: salted scrypt (`hashlib.scrypt`, N=2^14, r=8, p=1), never the password.

Every comparison runs in constant time (`hmac.compare_digest`). A password is checked with
scrypt (about 16 MiB and a few tens of milliseconds) one at a time, so a flood of guesses
cannot exhaust memory, and no request ever waits for another's check: while one runs, a
request that needs one is answered at once (`CheckBusyError`: a 503 with Retry-After), so
guesses cannot hold every connection the server serves. What keeps the right password from
being crowded out by guesses:
- an `Authorization` header that passed once is remembered (its SHA-256, in memory), so a page
  that reloads every few seconds costs no scrypt each time; one that failed is remembered too,
  so a wrong header sent again and again costs one check;
- a client address whose password was wrong waits `FAILED_PAUSE_SECONDS` before another of its
  passwords is checked (a busy answer meanwhile): guesses from one address take a check a
  second at most, and leave the checker free for everyone else (clients behind one proxy
  share its address, and its pause).
An unknown user name costs the same scrypt as a known one (against a decoy hash of the first
user's parameters): how long a wrong answer takes tells no one which names exist.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

from reactor.errors import ConfigError

__all__ = ["CheckBusyError", "Credentials", "User", "hash_password", "load_credentials"]

_SCRYPT_N, _SCRYPT_R, _SCRYPT_P = 2**14, 8, 1
_KEY_BYTES = 32
_SALT_BYTES = 16
#: Authorization headers that passed, and that failed, remembered (by hash) at most this many
#: each; client addresses whose password failed lately, at most this many.
_REMEMBERED = 1000
#: How long a client address whose password was wrong waits before another is checked.
FAILED_PAUSE_SECONDS = 1.0
READ_ONLY = "read-only"


@dataclass(frozen=True)
class User:
    """Who sent a request, and whether they may act (else only look)."""

    name: str
    can_act: bool


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _scrypt(password: str, salt: bytes, n: int, r: int, p: int) -> bytes:
    return hashlib.scrypt(
        password.encode(), salt=salt, n=n, r=r, p=p, maxmem=2 * 128 * n * r, dklen=_KEY_BYTES
    )


def hash_password(password: str) -> str:
    """A salted hash of `password` for `REACTOR_DASHBOARD_USERS` (`scrypt$N$r$p$SALT$KEY`)."""
    salt = secrets.token_bytes(_SALT_BYTES)
    key = _scrypt(password, salt, _SCRYPT_N, _SCRYPT_R, _SCRYPT_P)
    return f"scrypt${_SCRYPT_N}${_SCRYPT_R}${_SCRYPT_P}${_b64(salt)}${_b64(key)}"


@dataclass(frozen=True)
class _Hash:
    n: int
    r: int
    p: int
    salt: bytes
    key: bytes

    @classmethod
    def parse(cls, text: str, user: str) -> _Hash:
        parts = text.split("$")
        try:
            if len(parts) != 6 or parts[0] != "scrypt":
                raise ValueError
            n, r, p = (int(v) for v in parts[1:4])
            # Bounded: a hash from the environment must not make each check take gigabytes.
            if n < 2 or n & (n - 1) or not 1 <= r <= 16 or not 1 <= p <= 4 or n * r > 2**18:
                raise ValueError
            return cls(n, r, p, _unb64(parts[4]), _unb64(parts[5]))
        except (ValueError, binascii.Error):
            raise ConfigError(
                f"REACTOR_DASHBOARD_USERS: the hash of user {user[:40]!r} is not one "
                "`reactor dashboard --hash-password` prints"
            ) from None


class CheckBusyError(Exception):
    """The password cannot be checked now (another check is running, or this client address
    sent a wrong one `FAILED_PAUSE_SECONDS` ago): ask again in `retry_after` seconds."""

    retry_after = 1


class Credentials:
    """The credentials the dashboard accepts; `identify` tells who sent a request."""

    def __init__(self, tokens: Mapping[str, User], users: Mapping[str, tuple[_Hash, User]]) -> None:
        self._tokens = dict(tokens)
        self._users = dict(users)
        self._checking = threading.Lock()  # one scrypt at a time; held by the one that runs
        # Written only with `_checking` held (reads are single lookups): no torn bookkeeping.
        self._passed: dict[bytes, User] = {}
        self._failed: set[bytes] = set()
        self._failed_at: dict[str, float] = {}  # client address -> its last wrong password
        first = next(iter(self._users.values()), None)
        like = first[0] if first is not None else _Hash(_SCRYPT_N, _SCRYPT_R, _SCRYPT_P, b"", b"")
        self._decoy = _Hash(like.n, like.r, like.p, secrets.token_bytes(_SALT_BYTES), b"")

    @property
    def basic(self) -> bool:
        """Whether users (basic auth) are configured: the 401 then asks browsers to log in."""
        return bool(self._users)

    def identify(self, authorization: str | None, client: str | None = None) -> User | None:
        """The user of an `Authorization` header sent from address `client` (None: no address,
        no pause), or None (missing or wrong).

        Raises:
            CheckBusyError: its password cannot be checked now; nothing was decided.
        """
        if not authorization:
            return None
        scheme, _, value = authorization.strip().partition(" ")
        value = value.strip()
        if scheme.lower() == "bearer":
            return self._bearer(value)
        if scheme.lower() == "basic":
            return self._basic(value, client)
        return None

    def _bearer(self, token: str) -> User | None:
        found = None
        for known, user in self._tokens.items():  # every one compared: no early exit
            if hmac.compare_digest(known.encode(), token.encode()):
                found = user
        return found

    def _basic(self, value: str, client: str | None) -> User | None:
        digest = hashlib.sha256(value.encode()).digest()
        remembered = self._passed.get(digest)
        if remembered is not None:
            return remembered
        if digest in self._failed:  # wrong before, wrong now: no scrypt for it again
            return None
        try:
            name, sep, password = base64.b64decode(value, validate=True).decode().partition(":")
        except (ValueError, binascii.Error):
            return None
        if not sep:
            return None
        entry = self._users.get(name)
        stored = entry[0] if entry is not None else self._decoy
        failed_at = self._failed_at.get(client) if client is not None else None
        if failed_at is not None and time.monotonic() - failed_at < FAILED_PAUSE_SECONDS:
            raise CheckBusyError
        if not self._checking.acquire(blocking=False):  # never wait: see the module
            raise CheckBusyError
        try:
            key = _scrypt(password, stored.salt, stored.n, stored.r, stored.p)
            if entry is None or not hmac.compare_digest(key, stored.key):
                self._remember_failure(digest, client)
                return None
            if len(self._passed) >= _REMEMBERED:
                self._passed.clear()
            self._passed[digest] = entry[1]
            return entry[1]
        finally:
            self._checking.release()

    def _remember_failure(self, digest: bytes, client: str | None) -> None:
        """Called with `_checking` held."""
        if len(self._failed) >= _REMEMBERED:
            self._failed.clear()
        self._failed.add(digest)
        if client is None:
            return
        now = time.monotonic()
        if len(self._failed_at) >= _REMEMBERED:  # those whose pause is over first, else all
            for address, at in list(self._failed_at.items()):
                if now - at >= FAILED_PAUSE_SECONDS:
                    del self._failed_at[address]
            if len(self._failed_at) >= _REMEMBERED:
                self._failed_at.clear()
        self._failed_at[client] = now


def load_credentials(environ: Mapping[str, str]) -> Credentials:
    """The credentials the environment gives.

    Raises:
        ConfigError: none is given, or an entry is malformed.
    """
    tokens: dict[str, User] = {}
    for variable, user in (
        ("REACTOR_DASHBOARD_TOKEN", User("token", True)),
        ("REACTOR_DASHBOARD_READ_TOKEN", User("read-token", False)),
    ):
        token = environ.get(variable, "").strip()
        if token:
            if len(token) < 16:
                raise ConfigError(f"{variable} is too short: give at least 16 characters")
            tokens[token] = user
    users: dict[str, tuple[_Hash, User]] = {}
    for entry in environ.get("REACTOR_DASHBOARD_USERS", "").split(","):
        if not entry.strip():
            continue
        name, _, rest = entry.strip().partition(":")
        hashed, _, role = rest.partition(":")
        if not name or not hashed or role not in ("", READ_ONLY):
            raise ConfigError(
                "REACTOR_DASHBOARD_USERS: give NAME:HASH or NAME:HASH:read-only entries, "
                "comma-separated"
            )
        users[name] = (_Hash.parse(hashed, name), User(name, role != READ_ONLY))
    if not tokens and not users:
        raise ConfigError(
            "--actions needs a credential: REACTOR_DASHBOARD_TOKEN or REACTOR_DASHBOARD_USERS"
        )
    return Credentials(tokens, users)
