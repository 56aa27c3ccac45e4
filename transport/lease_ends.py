"""One-sided reads' leases: confirmed by their deadline where it proves them, ended off the read's path.

A one-sided reader (shm, rdma) copies a unit's arena under a lease the unit
grants over the control lane. The lease expires ``expires_in`` seconds
after the unit granted it, and only then (or when its holder ends it) may
the unit reuse its regions. The unit grants it after the reader sent the
request, so the lease is held at least until ``started + expires_in`` on
any clock that runs at the unit's rate, ``started`` being the reader's
clock when it sent the request. Monotonic clocks of two hosts differ in
rate by parts per million, so a read whose copy ended before
``started + expires_in * (1 - CLOCK_RATE_SLACK) - DEADLINE_MARGIN_S`` was
covered by its lease from first to last byte: no confirmation is needed.
Such a lease is ended in the background (:class:`LeaseEnds`), and the read
returns after one control round trip instead of two. A read that finished
later confirms synchronously with ``end_lease``, which answers whether the
lease was still held.

Deferred ends go out on the channel's next ``lease`` request (its ``end``
list) or from one daemon thread per process :data:`SEND_DELAY_S` after the
first of them was deferred, whichever comes first: reads that follow each
other end their leases with no message of their own, and a read wakes that
thread only when nothing of its channel is waiting already. That thread
sends each channel's ends on a short-lived thread of their own, so an end
to a hung unit holds up no other unit's. A closed channel sends what is
left. An end that never arrives (the unit was lost) costs nothing but the
unit's own lease timeout.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Callable

__all__ = ["LeaseEnds", "lease_covered", "expires_in_of", "stated_seconds", "CLOCK_RATE_SLACK", "DEADLINE_MARGIN_S",
           "MAX_IDS_PER_CALL", "SEND_DELAY_S"]

_log = logging.getLogger(__name__)

#: The largest relative rate difference assumed between the reader's and the
#: unit's monotonic clocks: a thousand times what NTP lets two hosts drift.
CLOCK_RATE_SLACK = 1e-3
#: Seconds of the lease's lifetime never relied upon.
DEADLINE_MARGIN_S = 0.05
#: Lease ids one request carries, far below what a server accepts.
MAX_IDS_PER_CALL = 1024
#: Seconds deferred ends wait for a lease request to carry them before the ender thread sends
#: them: the regions stay pinned that much longer, far inside any lease's lifetime.
SEND_DELAY_S = 0.05


def lease_covered(started: float, expires_in: float | None, now: float | None = None) -> bool:
    """True when a lease requested at ``started`` (this process's ``time.monotonic``)
    is provably still held at ``now``, given the unit's ``expires_in``.

    ``None`` for ``expires_in`` (a unit that did not say) is never covered.
    """
    if expires_in is None:
        return False
    now = time.monotonic() if now is None else now
    return now - started < expires_in * (1.0 - CLOCK_RATE_SLACK) - DEADLINE_MARGIN_S


def stated_seconds(value) -> float | None:
    """A lifetime a unit states (a lease's, a reservation's) as seconds, or None when it is not a usable
    one: a positive, finite number (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        return None
    return float(value)


def expires_in_of(reply) -> float | None:
    """The lease lifetime a ``lease`` reply states, or None when it states none usable."""
    return stated_seconds(reply.get("expires_in") if isinstance(reply, dict) else None)


class LeaseEnds:
    """Lease ids of one channel whose end nobody waits for.

    Parameters
    ----------
    send : callable
        ``send(lease_ids)`` ends leases on the unit (an ``end_lease`` call);
        run by the process's ender thread and by :meth:`close`.
    unit : str
        Named in log lines.
    """

    def __init__(self, send: Callable[[list[int]], object], unit: str):
        self._send = send
        self._unit = unit
        self._lock = threading.Lock()
        self._flushing = threading.Lock()
        self._ids: list[int] = []
        self._scheduled = False  # the ender thread will send what is pending
        self._closed = False
        self._dropped = False  # the unit is lost: nothing more is sent, nothing waited for

    def request_lease(self, send: Callable[[dict], dict], args: dict) -> tuple[dict, float]:
        """Send a ``lease`` request with ``send(args)``, carrying the ends still pending.

        Returns the reply and this process's ``time.monotonic()`` from just
        before the request went out: the ``started`` of :func:`lease_covered`.
        """
        ended = self.take()
        if ended:
            args = {**args, "end": ended}
        started = time.monotonic()
        try:
            return send(args), started
        except BaseException:
            self.restore(ended)  # ending twice is harmless; never ending pins space until expiry
            raise

    def defer(self, lease_id: int) -> None:
        """End ``lease_id`` soon, off the caller's path."""
        with self._lock:
            closed = self._closed
            if not closed:
                self._ids.append(int(lease_id))
                wake, self._scheduled = not self._scheduled, True
        if closed:
            self._end([int(lease_id)])
        elif wake:
            _Ender.instance().wake(self)

    def take(self, limit: int = MAX_IDS_PER_CALL) -> list[int]:
        """At most ``limit`` ids still to end, for a request that carries them itself
        (``lease``'s ``end``)."""
        with self._lock:
            ids, self._ids = self._ids[:limit], self._ids[limit:]
        return ids

    def restore(self, ids: list[int]) -> None:
        """Give back ids from :meth:`take` whose request never reached the unit."""
        if ids:
            with self._lock:
                self._ids[:0] = ids
                wake, self._scheduled = not self._scheduled, True
            if wake:
                _Ender.instance().wake(self)

    def send_scheduled(self) -> None:
        """The ender thread's turn: send what is pending (later deferrals schedule anew)."""
        with self._lock:
            self._scheduled = False
        self.flush()

    def flush(self) -> None:
        """End every deferred lease now (blocking), including any the ender thread is sending."""
        with self._flushing:  # close() must not return while the ender's send is in flight
            while True:
                ids = self.take()
                if not ids:
                    return
                self._end(ids)

    def close(self) -> None:
        """Flush, and end later deferrals at once. Idempotent; after :meth:`drop`, returns at once."""
        with self._lock:
            self._closed = True
            dropped = self._dropped
        if not dropped:
            self.flush()

    def drop(self) -> None:
        """The unit is lost: forget the deferred ends unsent (they expire on the unit) and take no more.

        Returns at once, also while the ender thread is sending; later
        deferrals are ended at once (on a closed channel: they fail fast).
        """
        with self._lock:
            self._closed = self._dropped = True
            dropped, self._ids = len(self._ids), []
        if dropped:
            _log.info("unit %s: %d lease ends dropped with the unit (they expire on the unit)", self._unit, dropped)

    def _end(self, ids: list[int]) -> None:
        try:
            self._send(ids)
        except Exception as exc:  # the unit's own lease timeout ends them
            _log.warning("unit %s: could not end %d leases (they expire on the unit): %s",
                         self._unit, len(ids), exc)


class _Ender:
    """The process's daemon thread that schedules deferred lease ends: each due channel's go out on a thread of
    their own."""

    _instance: "_Ender | None" = None
    _instance_lock = threading.Lock()

    def __init__(self):
        self._cond = threading.Condition()
        self._due: "weakref.WeakSet[LeaseEnds]" = weakref.WeakSet()
        self._thread = threading.Thread(target=self._run, name="gputq-lease-ender", daemon=True)
        self._thread.start()

    @classmethod
    def instance(cls) -> "_Ender":
        with cls._instance_lock:
            if cls._instance is None or not cls._instance._thread.is_alive():
                cls._instance = cls()
            return cls._instance

    def wake(self, ends: LeaseEnds) -> None:
        with self._cond:
            self._due.add(ends)
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._due:
                    self._cond.wait()
            time.sleep(SEND_DELAY_S)  # meanwhile a lease request may carry them
            with self._cond:
                due = list(self._due)
                self._due.clear()
            for ends in due:
                # Each channel's send on a thread of its own: one to a hung unit waits out its control
                # timeout, and the leases of every other unit this process reads must not wait behind it.
                threading.Thread(target=ends.send_scheduled, name="gputq-lease-ends", daemon=True).start()
            # Kept while the next are awaited, the last channels' ends would keep those channels alive (a
            # channel dropped unclosed, its connection too) until some other channel's leases end.
            due = ends = None
