"""Leases, write reservations, their deadlines, and the timer that enforces them.

A *lease* pins the regions of some keys so that a reader can copy them: a
key released meanwhile leaves the key table at once, but its region goes
back to the allocator only when the last lease on it ends. Leases taken by
one-sided readers (rdma, shm), which the unit never sees finish, expire
after ``lease_timeout_s``; a server that holds a lease for its own send
takes one that never expires and always ends it.

A *reservation* is a write in progress: the region a writer is filling.
Its deadline is set by the unit (``reservation_timeout_s``), never taken
from the client, so a stalled or dead writer cannot pin space for good.

Both deadlines are enforced by :class:`ExpiryTimer`, a daemon thread of
the unit, so space comes back even when nothing else happens on the unit.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
import weakref
from typing import Callable

from gputq.unit.keytable import Entry

__all__ = ["LeaseBook", "ExpiryTimer"]

log = logging.getLogger(__name__)

# An idle timer wakes this often to notice that its unit was garbage-collected
# without close(), so a forgotten unit does not leave a thread behind.
_IDLE_WAKE_S = 1.0


class LeaseBook:
    """Live leases, pinned entries, and the deadlines of leases and reservations.

    Not thread-safe: the StorageUnit calls it with its lock held.

    Parameters
    ----------
    lease_timeout_s, reservation_timeout_s : float
        Lifetimes of an expiring lease and of a reservation.
    free : callable
        Returns an entry's region to the allocator.

    Notes
    -----
    Every lease (and every reservation) of a book has the same lifetime, so
    insertion order is deadline order and the deadline maps stay sorted for
    free. Lease ids start at a random point so that an id from a previous
    incarnation of the unit does not name a live lease of this one.
    """

    def __init__(self, lease_timeout_s: float, reservation_timeout_s: float,
                 free: Callable[[Entry], None]):
        self.lease_timeout_s = lease_timeout_s
        self.reservation_timeout_s = reservation_timeout_s
        self._free = free
        self._leases: dict[int, list[Entry]] = {}
        self._lease_deadlines: dict[int, float] = {}
        self._reservation_deadlines: dict[Entry, float] = {}
        self._ids = itertools.count(secrets.randbits(48) + 1)
        self.pending_free_bytes = 0

    @property
    def leases(self) -> int:
        return len(self._leases)

    @property
    def reservations(self) -> int:
        return len(self._reservation_deadlines)

    # -- leases ------------------------------------------------------------------------

    def pin(self, entries: list[Entry], expires: bool, now: float) -> tuple[int, float | None]:
        """Lease ``entries``; return the lease id and its deadline (None: never expires)."""
        for entry in entries:
            entry.leases += 1
        lease_id = next(self._ids)
        self._leases[lease_id] = entries
        if not expires:
            return lease_id, None
        deadline = now + self.lease_timeout_s
        self._lease_deadlines[lease_id] = deadline
        return lease_id, deadline

    def end(self, lease_id: int) -> bool:
        """Unpin a lease; free regions forgotten meanwhile. False: not held (expired or unknown)."""
        entries = self._leases.pop(lease_id, None)
        if entries is None:
            return False
        self._lease_deadlines.pop(lease_id, None)
        for entry in entries:
            entry.leases -= 1
            if entry.leases == 0 and entry.released:
                self.pending_free_bytes -= entry.nbytes
                self._free(entry)
        return True

    def park_or_free(self, entry: Entry) -> None:
        """An entry left the key table: free its region, or park it until its leases end."""
        if entry.leases:
            entry.released = True
            self.pending_free_bytes += entry.nbytes
        else:
            self._free(entry)

    def due_leases(self, now: float) -> list[int]:
        """Ids of expiring leases whose deadline passed, oldest first (still held: end them)."""
        due = []
        for lease_id, deadline in self._lease_deadlines.items():
            if deadline > now:
                break
            due.append(lease_id)
        return due

    # -- reservations --------------------------------------------------------------------

    def reserve(self, entry: Entry, now: float) -> float:
        """Start ``entry``'s reservation clock; return its deadline."""
        deadline = now + self.reservation_timeout_s
        self._reservation_deadlines[entry] = deadline
        return deadline

    def reservation_expired(self, entry: Entry, now: float) -> bool:
        """True when ``entry``'s reservation deadline has passed but the timer has not reaped it yet."""
        deadline = self._reservation_deadlines.get(entry)
        return deadline is not None and deadline <= now

    def unreserve(self, entry: Entry) -> None:
        """The write ended (committed, aborted or forgotten): stop its clock."""
        self._reservation_deadlines.pop(entry, None)

    def due_reservations(self, now: float) -> list[Entry]:
        """Reservations whose deadline passed, oldest first (their clocks stopped)."""
        due = []
        while self._reservation_deadlines:
            entry, deadline = next(iter(self._reservation_deadlines.items()))
            if deadline > now:
                break
            del self._reservation_deadlines[entry]
            due.append(entry)
        return due

    def next_deadline(self) -> float | None:
        """The earliest deadline of any lease or reservation, or None."""
        heads = [next(iter(d.values())) for d in (self._lease_deadlines, self._reservation_deadlines) if d]
        return min(heads) if heads else None


class ExpiryTimer:
    """A daemon thread that runs its unit's expiry at each deadline.

    Parameters
    ----------
    cond : threading.Condition
        A condition on the unit's lock; the timer waits on it and runs
        ``expire`` with the lock held.
    expire : bound method
        ``expire() -> next deadline or None``. Held weakly, so an unclosed
        unit can still be garbage-collected; the thread then ends.
    name : str
        Thread name.
    """

    def __init__(self, cond: threading.Condition, expire: Callable[[], float | None], name: str):
        self._cond = cond
        self._expire = weakref.WeakMethod(expire)
        self._stopped = False
        self._wake_at = float("inf")
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def poke(self, deadline: float) -> None:
        """A new deadline was set (lock held): wake the timer if it sleeps past it."""
        if deadline < self._wake_at:
            self._cond.notify()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop and join the thread (call without the lock). Idempotent."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _run(self) -> None:
        with self._cond:
            while not self._stopped:
                expire = self._expire()
                if expire is None:
                    return  # the unit was garbage-collected
                try:
                    next_at = expire()
                except Exception:  # noqa: BLE001 - the timer must outlive one bad expiry
                    log.exception("%s: expiry failed; retrying", self._thread.name)
                    next_at = None
                del expire
                now = time.monotonic()
                wait = _IDLE_WAKE_S if next_at is None else min(_IDLE_WAKE_S, max(0.0, next_at - now))
                self._wake_at = now + wait
                self._cond.wait(wait)
