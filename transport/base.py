"""The transport interface: what every backend implements.

A *server* side lives in the StorageUnit process and serves one arena; it
calls back into an :class:`ArenaHandler` (the StorageUnit) for everything
that is not moving bytes: allocation, commit, leases and control calls.
What a server allows its peers (frame size, deadlines, connections) is one
:class:`ServerLimits` value. A *client* side is a :class:`Channel` to one
unit. A :class:`TransportType` builds both, in the manner of Ray's channel
type objects.

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
import math
import threading
import time
from dataclasses import dataclass, field, fields
from typing import Any, Sequence

import numpy as np

from gputq.errors import InvalidInputError, MissingDependencyError

from .spans import SPAN_WIRE_BYTES, span_regions, spans_to_wire

__all__ = [
    "MAX_TIMEOUT_S",
    "Region",
    "Lease",
    "ServerLimits",
    "ArenaHandler",
    "check_handler",
    "Closeable",
    "Channel",
    "Server",
    "TransportType",
    "is_device_buffer",
    "byte_view",
    "LogLimiter",
    "describe_keys",
    "read_args",
    "WRITE_WINDOW_SHARE",
    "write_window",
]

#: Share of a handler's ``reservation_timeout_s`` that a write's payload may
#: take to land in its reserved region. The region is freed, and may go to
#: another key, once the reservation expires; the other half is the margin
#: that keeps a late byte of a stalled writer out of it.
WRITE_WINDOW_SHARE = 0.5


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


#: The longest timeout anything accepts, in seconds (a week): sockets, thread waits and deadlines all
#: take it, where an infinite or astronomically long one overflows their clocks.
MAX_TIMEOUT_S = 7 * 24 * 3600.0


@dataclass(frozen=True)
class ServerLimits:
    """What one unit's server allows its peers: the one set of server limits and their defaults.

    Every backend's ``serve`` takes one; :attr:`gputq.config.GputqConfig.server_limits`
    builds it from the settings of the same names, whose defaults are these.

    Attributes
    ----------
    max_frame_bytes : int
        Largest payload of one frame, in bytes (default 4 GiB). A read whose
        bytes exceed it is refused with ``RequestTooLargeError``; a frame
        announcing more is a ``ProtocolError`` and closes the connection.
    send_timeout_s : float
        Seconds the server has to send one reply frame (default 60). A peer
        that stops reading loses its connection, and only then does the
        server's lease on the bytes it was sending end. It also bounds the
        receive of one write payload (see :func:`write_window`).
    max_connections : int
        Connections one server holds at once, handshaking or authenticated
        (default 256). At the cap a new connection replaces the oldest one
        still handshaking; when all are authenticated it is refused with
        ``UnitBusyError``, which clients retry with backoff within their timeout.
    handshake_timeout_s : float
        Seconds a peer has from connecting to a complete, valid HELLO
        (default 5); then its connection is closed.

    Raises
    ------
    InvalidInputError
        A count that is not an int >= 1, or a time that is not a finite
        number > 0; the message names the field.
    """

    max_frame_bytes: int = 4 << 30
    send_timeout_s: float = 60.0
    max_connections: int = 256
    handshake_timeout_s: float = 5.0

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if type(f.default) is int:  # a count; the float defaults are times
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise InvalidInputError(f"{f.name} must be an int >= 1, got {value!r}")
                continue
            # inf would reach socket.settimeout, which refuses it; NaN compares false to everything.
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S):
                raise InvalidInputError(f"{f.name} must be a finite number of seconds in (0, {MAX_TIMEOUT_S:g}], "
                                        f"got {value!r}")
            object.__setattr__(self, f.name, float(value))


class ArenaHandler(abc.ABC):
    """What a transport server needs from the owner of the arena (the StorageUnit).

    Every member below is called by a server; a handler subclasses this
    class and implements them all (one that does not cannot be
    instantiated), and servers refuse anything else (:func:`check_handler`).
    Members a handler has no value for answer ``None``, as documented.
    Errors cross the wire by class name.
    """

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """The unit's name; in errors, addresses and HELLO replies."""

    @property
    @abc.abstractmethod
    def incarnation(self) -> str:
        """Random per handler object, so that a reference made before a restart is stale.

        Servers publish it in addresses and HELLO replies.
        """

    @property
    @abc.abstractmethod
    def arena(self) -> memoryview:
        """The whole arena as one writable, C-contiguous byte view."""

    @property
    @abc.abstractmethod
    def arena_path(self) -> str:
        """The arena's shared-memory file, for readers on the same host."""

    @property
    @abc.abstractmethod
    def directory_file(self) -> dict | None:
        """The key directory (:mod:`gputq.transport.directory`) as ``{"path", "slots"}``, or ``None``.

        Servers hand it to same-host readers with the arena file, and those
        copy before their lease returns.
        """

    @property
    @abc.abstractmethod
    def lease_timeout_s(self) -> float | None:
        """Seconds after which an expiring lease ends; ``None`` when leases never expire.

        Servers tell one-sided readers (``expires_in``), so that a read
        finished well inside it needs no confirmation.
        """

    @property
    @abc.abstractmethod
    def reservation_timeout_s(self) -> float | None:
        """Seconds after which an uncommitted write's reservation is aborted; ``None``: never.

        Servers bound a write's transfer into its region by
        :func:`write_window` of it, so that no byte lands after the region
        may have been reused.
        """

    @abc.abstractmethod
    def begin_write(self, key: str, nbytes: int, meta: dict, timeout: float | None) -> int:
        """Reserve ``nbytes`` for ``key``; return the arena offset.

        Parameters
        ----------
        key : str
        nbytes : int
        meta : dict
            The writer's metadata; ``meta["generation"]`` (an int) names the write.
        timeout : float or None
            Seconds to wait for space (back-pressure); ``None``: the handler's default.

        Raises
        ------
        GputqTimeoutError
            No space within ``timeout`` (the StorageUnit's ``CapacityError``).
        InvalidInputError
            A known key (the unit's ``DuplicateKeyError``), or
            ``RequestTooLargeError`` when ``nbytes`` can never fit.
        """

    @abc.abstractmethod
    def commit_write(self, key: str, generation: int | None = None) -> dict:
        """Make a reserved, fully written key visible; return a receipt.

        Raises
        ------
        GputqError
            (the StorageUnit: ``UnknownKeyError``) for a reservation that
            expired, even one the handler's timer has not reaped yet, and one
            whose generation is not ``generation`` (the write's meta's, when
            it carried one): another write's reservation of the same key.
        """

    @abc.abstractmethod
    def abort_write(self, key: str, generation: int | None = None) -> None:
        """Drop a reservation whose bytes did not all arrive.

        Not another write's: see :meth:`commit_write`.
        """

    @abc.abstractmethod
    def lease(self, keys: Sequence[str], generations: Sequence[int | None] | None = None,
              incarnation: str | None = None, *, expires: bool = True) -> Lease:
        """Pin the regions of ``keys`` (in order).

        Parameters
        ----------
        keys : sequence of str
        generations : sequence of int or None, optional
            One per key, the generation the caller's reference names; 0 or
            ``None`` entries (and ``None`` for all) are not checked.
        incarnation : str, optional
            The handler incarnation the caller's references name; ``None``: unchecked.
        expires : bool, optional
            False: no deadline, for a server that ends the lease itself in
            ``finally``; True: the handler ends it after :attr:`lease_timeout_s`
            (one-sided readers).

        Raises
        ------
        GputqError
            Naming a missing key (the StorageUnit's ``UnknownKeyError``).
        StaleReadError
            ``incarnation`` is not the handler's, or a key's stored
            generation differs from its entry in ``generations``.
        """

    def lease_regions(self, keys: Sequence[str], generations: Sequence[int | None] | None = None,
                      incarnation: str | None = None, *, expires: bool = True,
                      spans: np.ndarray | None = None) -> tuple[int, np.ndarray]:
        """:meth:`lease` as ``(lease_id, int64 [n, 2] of (offset, nbytes))``; what servers call.

        With ``spans`` (checked int64 ``[m, 3]``, see :mod:`gputq.transport.spans`)
        the rows are the ``m`` spans' regions instead of one per key, and a
        span outside its key's blob raises ``InvalidInputError`` with
        nothing leased. This default builds the array from :meth:`lease`; a
        handler may override it to lease many keys without building a
        ``Region`` per key (and to count the bytes the spans name).
        """
        lease = self.lease(keys, generations=generations, incarnation=incarnation, expires=expires)
        regions = np.array([(r.offset, r.nbytes) for r in lease.regions], dtype=np.int64)
        try:
            return lease.lease_id, span_regions(regions.reshape(len(lease.regions), 2), spans, keys, self.name)
        except BaseException:
            self.end_lease(lease.lease_id)
            raise

    @abc.abstractmethod
    def end_lease(self, lease_id: int) -> bool | None:
        """Unpin; regions released meanwhile are freed now. Idempotent.

        Returns
        -------
        bool or None
            True when the lease was still held, False when it had expired or
            is unknown: a one-sided reader then discards what it read.
            ``None`` (a handler whose leases never expire) counts as held.
        """

    @abc.abstractmethod
    def control(self, method: str, args: dict) -> Any:
        """Answer a control call (release, stats, ...); the result is msgpack-able.

        Raises
        ------
        InvalidInputError
            An unknown method or malformed arguments.
        """


def check_handler(handler) -> ArenaHandler:
    """``handler``, checked once by a server before it serves it.

    Raises
    ------
    InvalidInputError
        ``handler`` is not an :class:`ArenaHandler` (duck-typed objects are
        refused: the servers call every member the class declares).
    """
    if not isinstance(handler, ArenaHandler):
        raise InvalidInputError(f"a transport serves an ArenaHandler; {type(handler).__name__} does not "
                                f"subclass gputq.transport.base.ArenaHandler")
    return handler


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


def write_window(reservation_timeout_s: float | None, limit: float | None = None) -> float | None:
    """Seconds a write's payload may take to land in its reserved region.

    The shorter of ``WRITE_WINDOW_SHARE * reservation_timeout_s`` and
    ``limit`` (e.g. a send deadline or the caller's own timeout); ``None``
    for either means no bound from it. Counted from when the reservation
    was granted, it ends strictly before the reservation expires.
    """
    bounds = [float(limit)] if limit is not None else []
    if reservation_timeout_s is not None:
        bounds.append(WRITE_WINDOW_SHARE * float(reservation_timeout_s))
    return min(bounds) if bounds else None
