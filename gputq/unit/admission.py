"""Write admission: writers waiting for a unit's space, in line, where no write waits for ever.

Waiting writers queue in arrival order. A writer that fits in the free
space may pass the writers ahead of it, so one large write does not block
smaller ones, until the first writer in line has waited ``aging_s``: from
then on nobody passes it, and the space freed goes to it first. A write
still gives up at its own deadline.

The queue holds no lock of its own: every call runs under the unit's lock,
whose condition (``space``) the unit notifies when it frees space or
closes.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable

__all__ = ["WriteQueue"]


@dataclass(eq=False)
class _Waiter:
    """A writer waiting for space, and since when."""

    since: float


class WriteQueue:
    """The unit's writers waiting for space (see the module docstring).

    Parameters
    ----------
    space : threading.Condition
        On the unit's lock; notified whenever space is freed or the unit closes.
    aging_s : float
        How long the first waiting writer may be passed by smaller writes.
    counters : collections.Counter
        The unit's counters: ``waits`` and ``wait_us`` grow by each write that waited.
    """

    def __init__(self, space: threading.Condition, aging_s: float, counters: Counter):
        self._space, self.aging_s, self._counters = space, float(aging_s), counters
        self._waiters: deque[_Waiter] = deque()

    def __len__(self) -> int:
        """Writers waiting now."""
        return len(self._waiters)

    def first_wait_s(self, now: float) -> float:
        """How long the first writer in line has waited at ``now`` (0 with nobody waiting)."""
        return now - self._waiters[0].since if self._waiters else 0.0

    def allocate(self, allocate: Callable[[], int | None], check: Callable[[], None], since: float,
                 deadline: float) -> int | None:
        """``allocate()``'s offset, once the line lets this writer (waiting from ``since``) allocate and it
        fits; None at ``deadline`` (the caller's ``CapacityError``; ``len`` then counts the writers still waiting).

        ``check()`` runs before each try and raises for a writer that must stop
        (a closed unit, a key stored meanwhile). Call with the unit's lock held.
        """
        waiter, now = _Waiter(since), since
        self._waiters.append(waiter)
        try:
            while True:
                check()
                if self._may_allocate(waiter, now):
                    offset = allocate()
                    if offset is not None:
                        return offset
                if now >= deadline:
                    return None
                self._space.wait(deadline - now)
                now = time.monotonic()
        finally:
            if self._waiters[0] is waiter:
                self._space.notify_all()  # the next in line may pass or fit now
            self._waiters.remove(waiter)
            if now > waiter.since:
                self._counters["waits"] += 1
                self._counters["wait_us"] += int((now - waiter.since) * 1e6)

    def _may_allocate(self, waiter: _Waiter, now: float) -> bool:
        head = self._waiters[0]
        return head is waiter or now - head.since < self.aging_s
