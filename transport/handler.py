"""The server side's contract: what a transport server needs from the arena's owner, and allows its peers.

A server lives in the StorageUnit process and serves one arena; it calls
back into an :class:`ArenaHandler` (the StorageUnit) for everything that is
not moving bytes: allocation, commit, leases and control calls. What a
server allows its peers (frame size, deadlines, connections) is one
:class:`ServerLimits` value, and how long a write's payload may take to land
in its reserved region is :func:`write_window` of the handler's reservation
timeout. The client side's interface is :mod:`gputq.transport.base`.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field, fields
from typing import Any, Sequence

import numpy as np

from gputq.errors import InvalidInputError

from .spans import span_regions

__all__ = [
    "MAX_TIMEOUT_S",
    "Region",
    "Lease",
    "ServerLimits",
    "ArenaHandler",
    "check_handler",
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
                                f"subclass gputq.transport.handler.ArenaHandler")
    return handler


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
