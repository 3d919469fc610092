"""Who may use the dashboard when its actions are on (`reactor dashboard --actions`).

Credentials come from the environment, never from flags (`ps` shows flags):
- `REACTOR_DASHBOARD_TOKEN` (may act) and `REACTOR_DASHBOARD_READ_TOKEN` (may only look):
  bearer tokens, sent as `Authorization: Bearer TOKEN` (scripts);
- `REACTOR_DASHBOARD_USERS`: comma-separated `NAME:HASH` (may act) or `NAME:HASH:read-only`
  entries for basic auth (browsers), where HASH is what `reactor dashboard --hash-password`
  prints: salted scrypt (`hashlib.scrypt`, N=2^14, r=8, p=1), never the password.

Every comparison runs in constant time (`hmac.compare_digest`). A password is checked with
scrypt (about 16 MiB and a few tens of milliseconds) one at a time, so a flood of guesses
cannot exhaust memory; an `Authorization` header that passed once is remembered (its SHA-256,
in memory) so a page that reloads every few seconds costs no scrypt each time.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from reactor.errors import ConfigError

__all__ = ["Credentials", "User", "hash_password", "load_credentials"]

_SCRYPT_N, _SCRYPT_R, _SCRYPT_P = 2**14, 8, 1
_KEY_BYTES = 32
_SALT_BYTES = 16
#: Authorization headers that passed, remembered (by hash) at most this many.
_REMEMBERED = 1000
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


class Credentials:
    """The credentials the dashboard accepts; `identify` tells who sent a request."""

    def __init__(self, tokens: Mapping[str, User], users: Mapping[str, tuple[_Hash, User]]) -> None:
        self._tokens = dict(tokens)
        self._users = dict(users)
        self._checking = threading.Lock()  # one scrypt at a time
        self._passed: dict[bytes, User] = {}

    @property
    def basic(self) -> bool:
        """Whether users (basic auth) are configured: the 401 then asks browsers to log in."""
        return bool(self._users)

    def identify(self, authorization: str | None) -> User | None:
        """The user of an `Authorization` header, or None (missing or wrong)."""
        if not authorization:
            return None
        scheme, _, value = authorization.strip().partition(" ")
        value = value.strip()
        if scheme.lower() == "bearer":
            return self._bearer(value)
        if scheme.lower() == "basic":
            return self._basic(value)
        return None

    def _bearer(self, token: str) -> User | None:
        found = None
        for known, user in self._tokens.items():  # every one compared: no early exit
            if hmac.compare_digest(known.encode(), token.encode()):
                found = user
        return found

    def _basic(self, value: str) -> User | None:
        digest = hashlib.sha256(value.encode()).digest()
        remembered = self._passed.get(digest)
        if remembered is not None:
            return remembered
        try:
            name, sep, password = base64.b64decode(value, validate=True).decode().partition(":")
        except (ValueError, binascii.Error):
            return None
        entry = self._users.get(name)
        if not sep or entry is None:
            return None
        stored, user = entry
        with self._checking:
            key = _scrypt(password, stored.salt, stored.n, stored.r, stored.p)
        if not hmac.compare_digest(key, stored.key):
            return None
        if len(self._passed) >= _REMEMBERED:
            self._passed.clear()
        self._passed[digest] = user
        return user


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
