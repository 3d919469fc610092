"""Which addresses a process listens on, read from the kernel (`/proc/PID/net/tcp{,6}` and
the process's file descriptors), not by connecting: a server bound to every address would
answer a connection to 127.0.0.1 too."""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path

_LISTEN = "0A"


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        found = re.fullmatch(r"socket:\[(\d+)\]", target)
        if found:
            inodes.add(found.group(1))
    return inodes


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    # The kernel prints each 32-bit word in host (little-endian) order.
    ordered = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(ordered))


def listening_addresses(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that process `pid` holds."""
    inodes = _socket_inodes(pid)
    found = set()
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == _LISTEN and inode in inodes:
                address, port = local.split(":")
                found.add((_address(address), int(port, 16)))
    return found
