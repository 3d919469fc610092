"""Routes: which handler runs a job type, and on which RQ queue.

A route is written `TYPE=DOTTED.PATH[@QUEUE]` (flag `--route`, or comma-separated in
`REACTOR_ROUTES`). The reactor never imports the handler: it only passes the dotted path to the
worker entry point inside the RQ job. Parsing refuses anything that would fail later (a type
the table's CHECK rejects, a path that is not dotted identifiers, a type routed twice).
"""

from __future__ import annotations

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
    "parse_route",
    "parse_routes",
]

#: The built-in demo handler's route. Used only where it is named (`scripts/demo`): a process
#: with no route never falls back to it.
DEMO_ROUTE = "photo.process=reactor.demo.process_photo"

_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+")
_QUEUE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


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
    if not is_valid_type(job_type):
        raise ConfigError(f"bad route {text!r}: type must match [A-Za-z0-9_.-]{{1,128}}")
    if not _DOTTED.fullmatch(handler):
        raise ConfigError(f"bad route {text!r}: handler must be a dotted path like pkg.module.func")
    if queue and not _QUEUE.fullmatch(queue):
        raise ConfigError(f"bad route {text!r}: queue must match [A-Za-z0-9_.:-]{{1,128}}")
    return Route(job_type, handler, queue or default_queue(job_type))


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
