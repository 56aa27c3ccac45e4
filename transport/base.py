"""The transport interface: what every backend implements.

A *client* side is a :class:`Channel` to one unit; a *server* side
(:class:`Server`) lives in the StorageUnit process, serves one arena and
calls back into its :class:`~gputq.transport.handler.ArenaHandler`
(:mod:`gputq.transport.handler`: that contract and the server's limits). A
:class:`TransportType` builds both, in the manner of Ray's channel type
objects. The small helpers every backend shares (byte views, key lists in
errors, read arguments, rate-limited logging) live here too.

Timeouts (seconds, ``None`` means wait forever):

- a write's timeout covers waiting for arena space (back-pressure) and the
  transfer; on expiry the write is aborted and nothing is kept;
- a read's timeout covers lease, transfer and completion; on expiry the
  lease is dropped and :class:`~gputq.errors.GputqTimeoutError` raised;
- a control call's timeout covers the round trip.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import threading
import time
from typing import Any, Sequence

from gputq.errors import InvalidInputError, MissingDependencyError

from .handler import ArenaHandler, ServerLimits
from .spans import SPAN_WIRE_BYTES, spans_to_wire

__all__ = [
    "Closeable",
    "Channel",
    "Server",
    "TransportType",
    "is_device_buffer",
    "byte_view",
    "LogLimiter",
    "describe_keys",
    "read_args",
]


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
    """A client connection to one StorageUnit. Thread-safe unless noted.

    ``unit`` and ``incarnation`` come from the unit's HELLO reply.

    Optional capabilities are declared here with what a backend without
    them answers; a backend that has one overrides it:

    - reads sent ahead of their replies, received chunk by chunk as they
      land (tcp): :attr:`pipelines_reads`, :meth:`pipeline`;
    - the unit's arena mapped here for zero-copy reads (shm):
      :attr:`mapping`, :meth:`mapped_source`, :meth:`mapped_lease` (under a
      lease from :meth:`lease_ahead`), :meth:`directory_lent` (the key
      directory's hint), :meth:`device_mappable`, and the
      counters :attr:`reads_ahead` and :attr:`hint_misses`;
    - leases taken before the copy (shm, rdma): :meth:`lease_ahead`,
      :meth:`drop_lease`; and reads under them (rdma): :attr:`leases_ahead`,
      :meth:`read_leased`, and the counter :attr:`leased_ahead`;
    - :attr:`fallback_reason`: why a channel reads another way than asked.
    """

    unit: str
    incarnation: str
    #: The unit's arena mapped into this process, or None.
    mapping = None
    #: Why this channel reads over another transport than the one asked for, or None.
    fallback_reason: str | None = None
    #: Reads copied from the unit's key directory ahead of their lease.
    reads_ahead: int = 0
    #: Such reads whose lease named other regions (copied again).
    hint_misses: int = 0
    #: Reads that copied under a lease taken ahead of them (:meth:`lease_ahead`), paying no round trip.
    leased_ahead: int = 0

    @property
    def pipelines_reads(self) -> bool:
        """Whether :meth:`pipeline` is available."""
        return False

    def pipeline(self):
        """Reads sent ahead of their replies on one connection
        (see :class:`~gputq.transport.tcp_pipeline.ReadPipeline`)."""
        raise MissingDependencyError(f"unit {self.unit}: {type(self).__name__} sends no reads ahead")

    def mapped_source(self, keys: Sequence[str], timeout: float | None = None, **kwargs):
        """Lease ``keys`` and lend their bytes where they lie in the mapped arena (a context manager)."""
        raise MissingDependencyError(f"unit {self.unit}: {type(self).__name__} maps no arena for zero-copy reads")

    def directory_lent(self, keys: Sequence[str], generations: Sequence[int], spans=None):
        """The regions the unit's key directory names for ``keys`` where they lie in the mapped arena, a hint
        (a context manager yielding host addresses and lengths, or None)."""
        raise MissingDependencyError(f"unit {self.unit}: {type(self).__name__} maps no arena for zero-copy reads")

    def mapped_lease(self, held):
        """The regions of a lease from :meth:`lease_ahead` where they lie in the mapped arena (a context
        manager yielding host addresses and lengths)."""
        raise MissingDependencyError(f"unit {self.unit}: {type(self).__name__} maps no arena for zero-copy reads")

    def device_mappable(self) -> bool:
        """Whether the mapped arena is also registered with CUDA, for the kernel to read in place."""
        return False

    @property
    def leases_ahead(self) -> bool:
        """Whether :meth:`read_leased` reads under a lease from :meth:`lease_ahead`."""
        return False

    def lease_ahead(self, keys: Sequence[str], timeout: float | None = None, **kwargs):
        """Lease what :meth:`read` of ``keys`` (same keyword arguments) would copy, now, for a later
        :meth:`read_leased`; the unit's checks and errors are the read's."""
        raise MissingDependencyError(f"unit {self.unit}: {type(self).__name__} takes no lease ahead of a read")

    def read_leased(self, held, dest, timeout: float | None = None) -> list[int]:
        """:meth:`read` what the lease ``held`` (from :meth:`lease_ahead`) names, under it."""
        raise MissingDependencyError(f"unit {self.unit}: {type(self).__name__} takes no lease ahead of a read")

    def drop_lease(self, held) -> None:
        """End a lease from :meth:`lease_ahead` that no read will use."""
        raise MissingDependencyError(f"unit {self.unit}: {type(self).__name__} takes no lease ahead of a read")

    @abc.abstractmethod
    def write(self, key: str, payload, meta: dict, timeout: float | None = None) -> dict:
        """Store ``payload`` (a C-contiguous bytes-like object) under ``key``.

        Returns the unit's receipt (``offset``, ``generation``).
        """

    def write_many(self, items: Sequence[tuple], timeout: float | None = None) -> list:
        """Store several ``(key, payload, meta)`` items: each one's receipt, or the error the unit answered
        for it (an exception instance), in order.

        A transport failure raises, and then any of the items may be stored
        or not. A backend that sends them in one request (tcp) overrides
        this; the default writes them one by one, each error raised.
        """
        return [self.write(key, payload, meta, timeout) for key, payload, meta in items]

    @abc.abstractmethod
    def read(self, keys: Sequence[str], dest, timeout: float | None = None, *,
             generations: Sequence[int] | None = None, incarnation: str | None = None,
             spans=None) -> list[int]:
        """Read the bytes of ``keys`` back to back into ``dest`` from offset 0.

        With ``spans`` (int64 ``[m, 3]`` of (key index, offset, nbytes), see
        :mod:`gputq.transport.spans`) only those byte ranges of the keys'
        blobs are read, back to back in row order, and each span's length
        is returned instead of each key's: only they leave the unit.

        ``dest`` is a 1-D uint8 host buffer (numpy array, memoryview) or,
        where the backend supports it, a CUDA buffer (anything with
        ``__cuda_array_interface__``). Returns each key's length in bytes.
        ``generations`` (one per key; 0 or None: unchecked) and
        ``incarnation`` are those of the caller's references: a key rewritten
        since, or a unit restarted since, raises ``StaleReadError``, and then
        ``dest`` holds garbage. Raises ``RequestTooLargeError`` if ``dest``
        is too small.
        """

    @abc.abstractmethod
    def call(self, method: str, timeout: float | None = None, **args) -> Any:
        """Invoke ``ArenaHandler.control(method, args)`` on the unit."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release sockets and registrations. Idempotent."""

    def abandon(self) -> None:
        """Close a channel whose unit is lost, sending it nothing and waiting on it for nothing.

        :meth:`close` may first tell a live unit what it can free (a
        one-sided reader's deferred lease ends); a unit that stopped
        answering would hold that for a whole control timeout, on top of the
        read's own. What a lost unit is not told expires there by itself.
        Idempotent; the default is :meth:`close`.
        """
        self.close()


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
    #: Whether :meth:`destination` lends memory the backend registered for its one-sided reads, which
    #: then land with no copy (a reader stages in it instead of its own buffer).
    registered_destinations: bool = False

    @abc.abstractmethod
    def serve(self, handler: ArenaHandler, *, host: str = "127.0.0.1", port: int = 0, token: str,
              limits: ServerLimits = ServerLimits()) -> Server:
        """Start serving ``handler.arena``.

        Parameters
        ----------
        handler : ArenaHandler
            The arena's owner (checked with :func:`check_handler`).
        host, port : str, int
            Where to listen; port 0 picks a free one (see :attr:`Server.address`).
        token : str
            The shared secret of the handshake.
        limits : ServerLimits, optional
            Frame size, deadlines and connection cap; the defaults when omitted.
        """

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


class LogLimiter:
    """Logs one warning per ``interval_s`` and counts the ones it held back.

    For events a hostile or broken peer can cause at will (failed
    handshakes, a failing progress loop): each is worth knowing about,
    a thousand identical lines are not.
    """

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0):
        self._logger = logger
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._next = 0.0
        self.suppressed = 0

    def warning(self, msg: str, *args) -> bool:
        """Log ``msg % args`` unless one was logged within the interval; True when logged."""
        now = time.monotonic()
        with self._lock:
            if now < self._next:
                self.suppressed += 1
                return False
            held, self.suppressed = self.suppressed, 0
            self._next = now + self._interval_s
        if held:
            msg += " (%d similar messages suppressed)"
            args = (*args, held)
        self._logger.warning(msg, *args)
        return True


def describe_keys(keys: Sequence[str]) -> str:
    """The first few of ``keys`` and their count, for error messages."""
    keys = list(keys)
    shown = ", ".join(repr(k) for k in keys[:4])
    return f"[{shown}{', ...' if len(keys) > 4 else ''}] ({len(keys)} keys)"


def read_args(keys: Sequence[str], generations=None, incarnation: str | None = None,
              spans=None) -> tuple[dict, int | None]:
    """The arguments of a read or lease request (``keys``, and those given of ``generations``,
    ``incarnation`` and ``spans`` in wire form), and how many spans it names (None: one region per key)."""
    keys = list(keys)
    args: dict = {"keys": keys}
    if generations is not None:
        if len(generations) != len(keys):
            raise InvalidInputError(f"{len(generations)} generations for {len(keys)} keys")
        args["generations"] = [None if g is None else int(g) for g in generations]
    if incarnation is not None:
        args["incarnation"] = incarnation
    if spans is None:
        return args, None
    args["spans"] = spans_to_wire(spans, len(keys))
    return args, len(args["spans"]) // SPAN_WIRE_BYTES
