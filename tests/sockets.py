"""What a process holds open and listens on, read from /proc: no ``ss``, ``lsof`` or ``netstat`` needed."""

from __future__ import annotations

import ipaddress
import os

__all__ = ["descriptor_targets", "listening_sockets"]

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column


def descriptor_targets(pid: int | None = None) -> list[str]:
    """What each open descriptor of process ``pid`` (default: this one) points to.

    A file removed while open reads ``"PATH (deleted)"``, a socket ``"socket:[INODE]"``.
    """
    pid = os.getpid() if pid is None else pid
    targets = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # closed meanwhile
            continue
    return targets


def _socket_inodes(pid: int) -> set[str]:
    return {target[8:-1] for target in descriptor_targets(pid) if target.startswith("socket:[")}


def _address(hex_address: str) -> tuple[str, int]:
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    # The kernel prints each 32-bit word in host byte order (little-endian here).
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(raw)), int(port, 16)


def listening_sockets(pid: int | None = None) -> set[tuple[str, int]]:
    """The (address, port) of every tcp socket process ``pid`` (default: this one) listens on.

    Reads the tables of the process's own network namespace
    (``/proc/PID/net``), so it works for a process inside another namespace too.
    """
    pid = os.getpid() if pid is None else pid
    inodes = _socket_inodes(pid)
    found = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as rows:
                next(rows)
                for row in rows:
                    cols = row.split()
                    if cols[3] == _LISTEN and cols[9] in inodes:
                        found.add(_address(cols[1]))
        except FileNotFoundError:  # no IPv6 here
            continue
    return found
