"""Moving bytes between processes and devices: one interface, one module per backend.

Installed as ``gputq.transport``. It imports nothing of gputq but the
exception tree (:mod:`gputq.errors`), and never Ray. Backends are loaded by
name with :func:`get_transport`, lazily, so a backend whose native library
is missing costs nothing until it is asked for.
"""

from __future__ import annotations

import importlib

from gputq.errors import InvalidInputError, MissingDependencyError
from gputq.transport.base import Channel, Server, TransportType, is_device_buffer
from gputq.transport.handler import ArenaHandler, Lease, Region, ServerLimits

__all__ = [
    "Region",
    "Lease",
    "ArenaHandler",
    "ServerLimits",
    "Channel",
    "Server",
    "TransportType",
    "is_device_buffer",
    "TRANSPORTS",
    "get_transport",
]

# name -> (module, class); modules are imported on first use.
TRANSPORTS: dict[str, tuple[str, str]] = {
    "tcp": ("gputq.transport.tcp", "TcpTransport"),
    "rdma": ("gputq.transport.nixl", "NixlTransport"),
    "shm": ("gputq.transport.shm", "ShmTransport"),
}


def get_transport(name: str) -> TransportType:
    """Return a backend by name (``"tcp"``, ``"rdma"`` or ``"shm"``).

    Raises
    ------
    InvalidInputError
        ``name`` is not a known backend (``auto`` is resolved by the caller).
    MissingDependencyError
        The backend's module or its native library is not installed.
    """
    try:
        module_name, class_name = TRANSPORTS[name]
    except KeyError:
        raise InvalidInputError(f"unknown transport {name!r}; choose one of {sorted(TRANSPORTS)}") from None
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise MissingDependencyError(f"transport {name!r} needs {exc.name!r}: {exc}") from exc
        raise MissingDependencyError(f"transport {name!r} is not available in this build ({module_name})") from exc
    return getattr(module, class_name)()
