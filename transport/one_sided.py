"""The lease protocol of one-sided reads, spoken by the shm and rdma channels alike.

A one-sided reader copies a unit's arena itself (from a mapping, or with a
NIXL READ), so the unit must keep the regions it copies from being reused
meanwhile. Over the unit's authenticated control lane:

1. :data:`LEASE` names the keys (or their byte spans) with their
   generations and the unit's incarnation; the unit checks them, pins the
   regions and answers them (``regions``), with the lease's ``lease_id``
   and its lifetime (``expires_in``);
2. the reader copies;
   A reader may take the lease ahead of the copy (:meth:`LeaseProtocol.hold`,
   a :class:`HeldLease`): a stream leases the next micro-batch's reads
   while this one's bytes move, and its copy then costs no round trip;
3. the lease is settled: a copy that ended while the lease's stated
   lifetime proves it held is ended in the background
   (:class:`~gputq.transport.lease_ends.LeaseEnds`); any other asks
   :data:`END_LEASE`, whose answer says whether it was still held. One that
   had expired raises :class:`~gputq.errors.LeaseExpiredError` (a
   ``StaleReadError``) and the read returns nothing: its bytes may be
   another key's.

:class:`LeaseProtocol` is one channel's side of it; the channel keeps what
is its own (where bytes go, how they are copied).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from gputq.errors import ClosedError, InvalidInputError, LeaseExpiredError, ProtocolError
from gputq.transport.base import Channel, describe_keys, read_args
from gputq.transport.lease_ends import LeaseEnds, expires_in_of, lease_covered

__all__ = ["LeaseProtocol", "LeasingChannel", "HeldLease", "LEASE", "END_LEASE", "ARENA_FILE", "END_TIMEOUT_S",
           "FRESH_FRACTION", "leased_regions"]

#: Control methods every unit answers for one-sided readers (the last names its arena file to a
#: reader on its host, which maps it).
LEASE, END_LEASE, ARENA_FILE = "lease", "end_lease", "arena_file"
#: Seconds a lease's end may take when the read's own time is not what bounds it: a confirmation must
#: get through even when the read's timeout is spent (else a good copy would be thrown away).
END_TIMEOUT_S = 10.0
#: The part of a held lease's stated lifetime that may have passed when its copy starts; an older one is
#: ended and taken again (its copy might outlast it, and then return nothing).
FRESH_FRACTION = 0.5


@dataclass
class HeldLease:
    """A lease taken before its copy: what it names, the unit's reply and when it was requested.

    ``request`` holds the read's ``generations``, ``incarnation`` and
    ``spans``; ``owner`` is the channel that took it (another channel, one
    reconnected since, takes its own).
    """

    keys: list
    request: dict
    reply: dict
    started: float
    rows: int | None
    owner: Any = field(default=None, repr=False)

    @property
    def lease_id(self) -> int:
        return int(self.reply["lease_id"])

    def covered(self, now: float | None = None) -> bool:
        """Whether the lease is provably still held (see :func:`~gputq.transport.lease_ends.lease_covered`)."""
        return lease_covered(self.started, expires_in_of(self.reply), now)

    def fresh(self, now: float | None = None) -> bool:
        """Whether at most :data:`FRESH_FRACTION` of the lease's stated lifetime has passed (provably)."""
        expires_in = expires_in_of(self.reply)
        return expires_in is not None and lease_covered(self.started, expires_in * FRESH_FRACTION, now)


class LeaseProtocol:
    """One channel's leases on one unit.

    Parameters
    ----------
    control:
        The unit's control lane: a :class:`~gputq.transport.tcp.TcpChannel`
        (``request`` rebuilds the unit's typed errors; ``call``).
    unit:
        The unit's name, for messages.
    """

    def __init__(self, control, unit: str):
        self._control = control
        self.unit = unit
        #: Lease ids ended off the read's path.
        self.ends = LeaseEnds(self._send_ends, unit)

    def request(self, args: dict, timeout: float | None, keys: Sequence[str]) -> tuple[dict, float]:
        """Lease what ``args`` names (see :func:`~gputq.transport.base.read_args`), carrying the ends
        still pending; returns the reply and the ``started`` of :func:`lease_covered`."""
        return self.ends.request_lease(lambda a: self.ask(a, timeout, keys), args)

    def hold(self, keys: list, request: dict, timeout: float | None, owner) -> HeldLease:
        """Lease ``keys`` with the read's ``request`` (``generations``, ``incarnation``, ``spans``) now, for a
        copy to come; ``owner`` is the channel that copies."""
        args, rows = read_args(keys, request.get("generations"), request.get("incarnation"), request.get("spans"))
        reply, started = self.request(args, timeout, keys)
        return HeldLease(keys, request, reply, started, rows, owner)

    def ask(self, args: dict, timeout: float | None, keys: Sequence[str]) -> dict:
        """The bare :data:`LEASE` request (the caller carries the ends, and restores them on failure)."""
        return self._control.request(LEASE, args, timeout, keys=keys)

    def regions(self, reply: dict, keys: Sequence[str], arena_nbytes: int, rows: int | None = None) -> np.ndarray:
        """The checked ``[n, 2]`` (offset, nbytes) regions of a lease ``reply`` (one per key, or ``rows``),
        each inside the unit's ``arena_nbytes``."""
        return leased_regions(reply["regions"], keys, arena_nbytes, self.unit, rows)

    def settle(self, reply: dict, started: float, keys: Sequence[str], *, ok: bool = True,
               timeout: float | None = END_TIMEOUT_S) -> None:
        """End the lease of ``reply`` once its copy is done (``ok``) or failed.

        A lease its stated lifetime proves held is ended in the background;
        otherwise :data:`END_LEASE` asks (within ``timeout``), and a lease
        that had expired raises ``LeaseExpiredError``. After a failed copy the
        end is a courtesy and its own failure is not raised.
        """
        lease_id = int(reply["lease_id"])
        if ok and lease_covered(started, expires_in_of(reply)):
            self.ends.defer(lease_id)
        elif not self.end(lease_id, quiet=not ok, timeout=timeout):
            raise LeaseExpiredError(
                f"unit {self.unit}: the lease of keys {describe_keys(keys)} expired before the copy finished; "
                f"the bytes read may belong to other keys, nothing is returned")

    def end(self, lease_id: int, *, quiet: bool, timeout: float | None = END_TIMEOUT_S) -> bool:
        """End one lease now; whether the unit still held it. ``quiet``: a failure counts as held
        (the read already failed, and its error is the one to see)."""
        try:
            reply = self._control.call(END_LEASE, timeout=timeout, lease_ids=[int(lease_id)])
        except Exception:
            if quiet:
                return True
            raise
        held = reply.get("held") if isinstance(reply, dict) else None
        return bool(held[0]) if held else False

    def _send_ends(self, lease_ids: list[int]) -> None:
        self._control.call(END_LEASE, timeout=END_TIMEOUT_S, lease_ids=lease_ids)

    def drop(self) -> None:
        """The unit is lost: its pending ends are dropped unsent (see :meth:`LeaseEnds.drop`)."""
        self.ends.drop()

    def close(self) -> None:
        """Send the pending ends (unless dropped). Idempotent."""
        self.ends.close()


class LeasingChannel(Channel):
    """What the channels that read one-sided (shm, rdma) share: a tcp control lane ``_tcp``, their
    :class:`LeaseProtocol` ``_leases`` and a ``_closed`` flag, which a subclass sets in its constructor."""

    #: The backend's name in messages.
    kind = "one-sided"
    _tcp: Any
    _leases: LeaseProtocol
    _closed: bool

    def call(self, method: str, timeout: float | None = None, **args) -> Any:
        self._check_open()
        return self._tcp.call(method, timeout=timeout, **args)

    def lease_ahead(self, keys: Sequence[str], timeout: float | None = None, *,
                    generations: Sequence[int] | None = None, incarnation: str | None = None,
                    spans=None) -> HeldLease:
        """Lease what a read of ``keys`` (same keyword arguments) would copy, now, for a copy to come: over
        rdma :meth:`read_leased`, over shm a restore from the mapping (:meth:`mapped_lease`).

        A stream takes its next reads' leases while this one's bytes move:
        their copies then pay no control round trip. The unit checks
        generations and incarnation now (``StaleReadError``, ``UnknownKeyError``).
        """
        self._check_open()
        keys = list(keys)
        if not keys:
            raise InvalidInputError(f"unit {self.unit}: a lease names at least one key")
        return self._leases.hold(keys, {"generations": generations, "incarnation": incarnation, "spans": spans},
                                 timeout, self)

    def drop_lease(self, held: HeldLease) -> None:
        """End a lease from :meth:`lease_ahead` that no copy will use any more (off the caller's path)."""
        if held.owner is self:
            self._leases.ends.defer(held.lease_id)

    def abandon(self) -> None:
        """The unit is lost: its deferred lease ends are dropped and its control connection closed first,
        so that an end being sent fails now instead of holding :meth:`close` for its timeout."""
        self._leases.drop()
        self._tcp.close()
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{self.kind} channel to {self.unit} is closed")


def leased_regions(raw, keys: Sequence[str], arena_nbytes: int, unit: str, rows: int | None = None) -> np.ndarray:
    """Decode and check the regions of a ``"lease"`` reply before reading them one-sided.

    ``raw`` is little-endian int64 ``[n, 2]`` of (offset, nbytes), one row
    per key, or ``rows`` of them when the lease named that many spans. A
    one-sided reader trusts nothing it did not check: a region outside the
    arena would read (or, mapped, fault on) memory that is not the arena.

    Raises
    ------
    ProtocolError
        Wrong size or type, a negative value, or a region reaching past
        ``arena_nbytes``; names the unit and the keys.
    """
    rows = len(keys) if rows is None else rows
    if not isinstance(raw, (bytes, bytearray)) or len(raw) != 16 * rows:
        raise ProtocolError(f"unit {unit}: lease reply for keys {describe_keys(keys)} is not "
                            f"{rows} (offset, nbytes) pairs")
    regions = np.frombuffer(raw, dtype="<i8").reshape(rows, 2)
    # nbytes > arena - offset, not offset + nbytes > arena: the sum can overflow int64.
    if rows and ((regions < 0).any() or (regions[:, 1] > arena_nbytes - regions[:, 0]).any()):
        raise ProtocolError(f"unit {unit}: leased regions outside its {arena_nbytes}-byte arena for keys "
                            f"{describe_keys(keys)}")
    return regions
