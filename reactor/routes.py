"""Routes: which handler runs a job type, and on which RQ queue.

A route is written `TYPE=DOTTED.PATH[@QUEUE]` (flag `--route`, or comma-separated in
`REACTOR_ROUTES`). The reactor never imports the handler: it only passes the dotted path to the
worker entry point inside the RQ job. Parsing refuses anything that would fail later (a type
the table's CHECK rejects, a path that is not dotted identifiers, a type routed twice), and
routes read back from `reactor_routes` are checked the same way (`recorded_route`). The
handler allow-list (`parse_handler_prefixes`, `handler_allowed`) names the modules a worker
may import handlers from at all.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from reactor.errors import ConfigError
from reactor.validate import is_valid_type

__all__ = [
    "DEMO_ROUTE",
    "Route",
    "default_queue",
    "format_route",
    "given_routes",
    "handler_allowed",
    "parse_handler_prefixes",
    "parse_route",
    "parse_routes",
    "recorded_route",
]

#: The built-in demo handler's route. Used only where it is named (`scripts/demo`): a process
#: with no route never falls back to it.
DEMO_ROUTE = "photo.process=reactor.demo.process_photo"

_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+")
_QUEUE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
#: How much of a bad recorded route an error shows.
MAX_SHOWN = 200


@dataclass(frozen=True)
class Route:
    """Where the jobs of one type go."""

    type: str
    handler: str
    queue: str


def default_queue(job_type: str) -> str:
    """The queue of a type when the route names none: the type with `.` replaced by `-`."""
    return job_type.replace(".", "-")


def format_route(route: Route) -> str:
    """The route as it is written: `TYPE=DOTTED.PATH@QUEUE`."""
    return f"{route.type}={route.handler}@{route.queue}"


def _problem(job_type: str, handler: str, queue: str) -> str | None:
    """What is wrong with a route's parts (an empty queue means the default), or None."""
    if not is_valid_type(job_type):
        return "type must match [A-Za-z0-9_.-]{1,128}"
    if not _DOTTED.fullmatch(handler):
        return "handler must be a dotted path like pkg.module.func"
    if queue and not _QUEUE.fullmatch(queue):
        return "queue must match [A-Za-z0-9_.:-]{1,128}"
    return None


def parse_route(text: str) -> Route:
    """Parse `TYPE=DOTTED.PATH[@QUEUE]`.

    Raises:
        ConfigError: the text is not a valid route.
    """
    job_type, sep, rest = text.strip().partition("=")
    handler, _, queue = rest.partition("@")
    job_type, handler, queue = job_type.strip(), handler.strip(), queue.strip()
    if not sep or not job_type or not handler:
        raise ConfigError(f"bad route {text!r}: expected TYPE=DOTTED.PATH[@QUEUE]")
    problem = _problem(job_type, handler, queue)
    if problem is not None:
        raise ConfigError(f"bad route {text!r}: {problem}")
    return Route(job_type, handler, queue or default_queue(job_type))


def recorded_route(job_type: str, handler: str, queue: str) -> Route:
    """A route read from `reactor_routes`, checked as `parse_route` checks a flag: whoever
    could write that table must not get anything past a worker that a flag could not.

    Raises:
        ConfigError: the row is not a valid route (named, bounded, in one line).
    """
    problem = _problem(job_type, handler, queue) if queue else "queue must not be empty"
    if problem is not None:
        text = f"{job_type}={handler}@{queue}"
        shown = repr(text[:MAX_SHOWN]) + ("..." if len(text) > MAX_SHOWN else "")
        raise ConfigError(f"bad route {shown} recorded in reactor_routes: {problem}")
    return Route(job_type, handler, queue)


def parse_handler_prefixes(texts: Iterable[str]) -> tuple[str, ...]:
    """Parse the handler allow-list (`--handler-prefix`, repeatable, or comma-separated in
    `REACTOR_HANDLER_PREFIXES`): module prefixes like `myapp` or `myapp.photos.`.

    Raises:
        ConfigError: a prefix is not a dotted module path.
    """
    prefixes: list[str] = []
    for text in texts:
        for part in text.split(","):
            prefix = part.strip().removesuffix(".")
            if not part.strip():
                continue
            if not _MODULE.fullmatch(prefix):
                raise ConfigError(
                    f"bad handler prefix {part.strip()!r}: expected a module path like myapp or "
                    "myapp.photos"
                )
            prefixes.append(prefix)
    return tuple(prefixes)


def handler_allowed(handler: str, prefixes: tuple[str, ...]) -> bool:
    """Whether `handler` lies inside one of the module `prefixes` (every handler when there
    are none). `myapp` allows `myapp.photos.process`, never `myapp2.x` or `myapp`'s parent."""
    return not prefixes or any(handler.startswith(prefix + ".") for prefix in prefixes)


def parse_routes(texts: Iterable[str]) -> Mapping[str, Route]:
    """Parse several routes into a mapping type -> Route.

    Each text may itself hold several comma-separated routes (the `REACTOR_ROUTES` form).

    Raises:
        ConfigError: a route is invalid, a type is routed twice, or there is no route at all.
    """
    routes: dict[str, Route] = {}
    for text in texts:
        for part in text.split(","):
            if not part.strip():
                continue
            route = parse_route(part)
            if route.type in routes:
                raise ConfigError(f"type {route.type!r} is routed twice")
            routes[route.type] = route
    if not routes:
        raise ConfigError("no route configured")
    return routes


def given_routes(
    flags: Iterable[str] = (), env: Mapping[str, str] | None = None
) -> dict[str, Route]:
    """The routes a process was given: its `--route` flags, else `REACTOR_ROUTES`; empty when
    neither names one (the process then follows the routes the reactors recorded, never a
    built-in one).

    Raises:
        ConfigError: a route is invalid or a type is routed twice.
    """
    env = os.environ if env is None else env
    texts = list(flags) or [env.get("REACTOR_ROUTES", "")]
    return dict(parse_routes(texts)) if any(t.strip() for t in texts) else {}
