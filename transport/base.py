"""The transport interface: what every backend implements.

A *server* side lives in the StorageUnit process and serves one arena; it
calls back into an :class:`ArenaHandler` (the StorageUnit) for everything
that is not moving bytes: allocation, commit, leases and control calls.
A *client* side is a :class:`Channel` to one unit. A :class:`TransportType`
builds both, in the manner of Ray's channel type objects.

Timeouts (seconds, ``None`` means wait forever):

- a write's timeout covers waiting for arena space (back-pressure) and the
  transfer; on expiry the write is aborted and nothing is kept;
- a read's timeout covers lease, transfer and completion; on expiry the
  lease is dropped and :class:`~transport.errors.GputqTimeoutError` raised;
- a control call's timeout covers the round trip.
"""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable

from transport.errors import InvalidInputError

__all__ = [
    "Region",
    "Lease",
    "ArenaHandler",
    "Closeable",
    "Channel",
    "Server",
    "TransportType",
    "is_device_buffer",
    "byte_view",
]


@dataclass(frozen=True)
class Region:
    """A byte range of an arena."""

    offset: int
    nbytes: int


@dataclass(frozen=True)
class Lease:
    """Regions a unit promises not to free or reuse until the lease ends.

    ``generations`` are the allocation generations of the regions; a backend
    that reads one-sided (NIXL) checks them again after the transfer.
    """

    lease_id: int
    regions: tuple[Region, ...]
    generations: tuple[int, ...] = field(default=())


@runtime_checkable
class ArenaHandler(Protocol):
    """What a transport server needs from the owner of the arena."""

    name: str

    @property
    def arena(self) -> memoryview:
        """The whole arena as one writable, C-contiguous byte view."""

    def begin_write(self, key: str, nbytes: int, meta: dict, timeout: float | None) -> int:
        """Reserve ``nbytes`` for ``key``; return the arena offset.

        Waits for space up to ``timeout`` (back-pressure) and then raises
        ``CapacityError``. Raises ``DuplicateKeyError`` for a known key and
        ``RequestTooLargeError`` when ``nbytes`` can never fit.
        """

    def commit_write(self, key: str) -> dict:
        """Make a reserved, fully written key visible; return a receipt."""

    def abort_write(self, key: str) -> None:
        """Drop a reservation whose bytes did not all arrive."""

    def lease(self, keys: Sequence[str]) -> Lease:
        """Pin the regions of ``keys`` (in order); ``UnknownKeyError`` names a missing key."""

    def end_lease(self, lease_id: int) -> None:
        """Unpin; regions released meanwhile are freed now. Idempotent."""

    def control(self, method: str, args: dict) -> Any:
        """Answer a control call (release, stats, ...); the result is msgpack-able."""


class Closeable(abc.ABC):
    """Something holding sockets, memory or registrations: ``close()`` and ``with``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release what is held. Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Channel(Closeable):
    """A client connection to one StorageUnit. Thread-safe unless noted."""

    unit: str

    @abc.abstractmethod
    def write(self, key: str, payload, meta: dict, timeout: float | None = None) -> dict:
        """Store ``payload`` (a C-contiguous bytes-like object) under ``key``.

        Returns the unit's receipt (``offset``, ``generation``).
        """

    @abc.abstractmethod
    def read(self, keys: Sequence[str], dest, timeout: float | None = None) -> list[int]:
        """Read the bytes of ``keys`` back to back into ``dest`` from offset 0.

        ``dest`` is a 1-D uint8 host buffer (numpy array, memoryview) or,
        where the backend supports it, a CUDA buffer (anything with
        ``__cuda_array_interface__``). Returns each key's length in bytes.
        Raises ``RequestTooLargeError`` if ``dest`` is too small.
        """

    @abc.abstractmethod
    def call(self, method: str, timeout: float | None = None, **args) -> Any:
        """Invoke ``ArenaHandler.control(method, args)`` on the unit."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release sockets and registrations. Idempotent."""


class Server(Closeable):
    """The serving side of one arena."""

    @property
    @abc.abstractmethod
    def address(self) -> dict:
        """What a client needs to connect: small, msgpack-able, sent via Ray."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop serving and release registrations. Idempotent."""


class TransportType(abc.ABC):
    """Builds servers and channels of one backend."""

    name: str

    @abc.abstractmethod
    def serve(self, handler: ArenaHandler, *, host: str = "127.0.0.1", port: int = 0,
              token: str, max_frame_bytes: int) -> Server:
        """Start serving ``handler.arena``."""

    @abc.abstractmethod
    def connect(self, address: dict, *, token: str, max_frame_bytes: int,
                timeout: float | None = None) -> Channel:
        """Open a channel to the server at ``address``."""

    @contextlib.contextmanager
    def destination(self, nbytes: int):
        """Lend a host buffer that reads of this transport land in without a copy.

        A context manager yielding a 1-D uint8 numpy array of ``nbytes``.
        Read several units' keys into disjoint slices of it, from several
        threads if need be; do not use it after the ``with`` block. This
        default is plain memory (tcp receives into any buffer); the rdma
        backend lends registered memory from a process-wide pool.
        """
        import numpy as np

        yield np.empty(nbytes, dtype=np.uint8)


def is_device_buffer(buf) -> bool:
    """True for CUDA memory (CuPy arrays, CUDA torch tensors)."""
    return hasattr(buf, "__cuda_array_interface__")


def byte_view(buf, *, writable: bool = False) -> memoryview:
    """Return ``buf`` as a flat, C-contiguous byte memoryview (no copy).

    Raises
    ------
    InvalidInputError
        ``buf`` is not a contiguous buffer, or is read-only when
        ``writable`` is requested.
    """
    try:
        view = memoryview(buf)
    except TypeError:
        raise InvalidInputError(f"expected a bytes-like buffer, got {type(buf).__name__}") from None
    if writable and view.readonly:
        raise InvalidInputError("destination buffer is read-only")
    if view.format == "B" and view.ndim == 1:
        return view
    if view.nbytes == 0:  # cast() rejects shapes with a zero
        return memoryview(b"") if not writable else memoryview(bytearray())
    if not view.c_contiguous:
        raise InvalidInputError("buffer must be C-contiguous")
    return view.cast("B")
