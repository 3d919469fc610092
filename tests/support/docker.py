"""Whether the suite may take its servers from Docker (testcontainers): only when asked with
`REACTOR_TEST_DOCKER=1`, and only if a Docker engine answers."""

from __future__ import annotations

import os
import socket


def docker_answers() -> bool:
    if os.environ.get("REACTOR_TEST_DOCKER") != "1":
        return False
    sock_path = "/var/run/docker.sock"
    if os.environ.get("DOCKER_HOST"):
        return True
    if not os.path.exists(sock_path):
        return False
    with socket.socket(socket.AF_UNIX) as sock:
        try:
            sock.connect(sock_path)
        except OSError:
            return False
    return True
