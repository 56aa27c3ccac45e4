"""Fan-out over units: one call per unit in parallel, and totals that name the units not reached.

Writers, readers, lifecycle operations and the controller all spread their
per-unit calls with :func:`fan_out`, so one slow or lost unit delays only
its own entry and the others' work is done; :func:`tally` then totals the
counts and raises :class:`~gputq.errors.PartialFailureError` naming the
units that were not reached.

Threads. Every fan-out of the process shares one set of worker threads,
started on first use and kept idle between calls (a controller's heartbeat
fans out every second: it must not start and join threads each time). At
most :data:`FANOUT_THREADS` run at once. The caller takes part: it runs the
first entry itself, and any entry no thread has taken once it is done. So
a fan-out never waits for a thread to come free, and neither a task that
fans out itself nor many threads fanning out at once can deadlock the
pool, whatever its bound: every entry a caller waits for is either running
in some thread or run by the caller itself. Past the bound, the entries no
thread took run one after another in the caller: only then can a slow
unit delay another's entry. A forked child starts its own threads.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Any, Callable, Iterable, Mapping

from gputq.errors import GputqError, PartialFailureError, UnitLostError

__all__ = ["fan_out", "failures", "tally", "FANOUT_THREADS"]

#: Worker threads fan-outs share at most. One per unit call in flight at once: a controller's
#: heartbeat, a release and an invariant check over 64 units are 192. Threads start only
#: when every started one is busy, so the bound costs nothing until that many calls wait
#: on units at once; past it the callers run the rest of their entries themselves.
FANOUT_THREADS = 256


class _Entry:
    """One unit's call of a fan-out, run exactly once: by a worker thread or by the caller."""

    def __init__(self, unit: str, task: Callable[[str], Any]):
        self.unit = unit
        self._task = task
        self._lock = threading.Lock()
        self._taken = False
        self._done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None  # anything but a GputqError, raised by fan_out

    def run(self, before_done: Callable[[], None] | None = None) -> bool:
        """Run the task unless another thread took it; False when it did.

        ``before_done`` runs after the task, just before the entry is marked done.
        """
        with self._lock:
            if self._taken:
                return False
            self._taken = True
        try:
            self.result = self._task(self.unit)
        except GputqError as exc:
            self.result = exc
        except BaseException as exc:  # raised in the caller's thread once every entry is done
            self.error = exc
        finally:
            if before_done is not None:
                before_done()
            self._done.set()
        return True

    def wait(self) -> None:
        self._done.wait()


class _Workers:
    """Daemon threads that run fan-out entries, started on demand up to ``limit`` and kept idle after.

    A thread is back on the idle list before the entry it ran is marked
    done, so a caller that fans out again at once reuses it instead of
    starting another.
    """

    def __init__(self, limit: int):
        self._limit = limit
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue] = []  # the inboxes of idle threads, most recent last
        self.threads: list[threading.Thread] = []

    def offer(self, entry: _Entry) -> bool:
        """Hand ``entry`` to an idle thread or a new one; False when ``limit`` threads are busy."""
        with self._lock:
            if self._idle:
                inbox = self._idle.pop()  # the most recently used: its stack is still warm
            elif len(self.threads) < self._limit:
                inbox = queue.SimpleQueue()
                thread = threading.Thread(target=self._work, args=(inbox,), daemon=True,
                                          name=f"gputq-fanout-{len(self.threads)}")
                thread.start()
                self.threads.append(thread)
            else:
                return False
        inbox.put(entry)
        return True

    def _work(self, inbox: queue.SimpleQueue) -> None:
        while True:
            entry = inbox.get()
            if not entry.run(before_done=lambda: self._park(inbox)):
                self._park(inbox)  # the caller had taken the entry: nothing ran here
            # Its task refers to the caller's objects (its clients): kept while the next is awaited, it would
            # keep them alive, clients dropped unclosed with their connections, until this thread's next entry.
            entry = None

    def _park(self, inbox: queue.SimpleQueue) -> None:
        with self._lock:
            self._idle.append(inbox)


_workers: _Workers | None = None
_workers_lock = threading.Lock()


def _shared_workers() -> _Workers:
    """The process's fan-out threads, created on first use."""
    global _workers
    with _workers_lock:
        if _workers is None:
            _workers = _Workers(FANOUT_THREADS)
        return _workers


def _forget_workers_in_child() -> None:
    # A forked child has none of its parent's threads, but their idle list would take
    # entries that nobody runs. The child starts its own on its first fan-out.
    global _workers, _workers_lock
    _workers, _workers_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_workers_in_child)


def fan_out(units: Iterable[str], task: Callable[[str], Any]) -> dict[str, Any]:
    """``task(unit)`` for every unit in parallel -> its result, or the GputqError it raised.

    One slow or lost unit delays only its own entry; nothing else waits for
    it (up to :data:`FANOUT_THREADS` calls in flight in the process; see the
    module's note). ``task`` may fan out itself. Returns once every entry is
    done.

    Raises
    ------
    BaseException
        The first error other than a GputqError that a task raised (in the
        order of ``units``), once every entry is done.
    """
    entries = [_Entry(unit, task) for unit in units]
    if not entries:
        return {}
    workers = _shared_workers() if len(entries) > 1 else None
    for entry in entries[1:]:
        workers.offer(entry)  # a refused one is run below, by this thread
    for entry in entries:
        entry.run()  # a no-op for the entries a thread took
    for entry in entries:
        entry.wait()
    for entry in entries:
        if entry.error is not None:
            raise entry.error
    return {entry.unit: entry.result for entry in entries}


def failures(done: Mapping[str, Any]) -> dict[str, str]:
    """The units of a :func:`fan_out` whose task raised -> the error, as text."""
    return {unit: str(r) for unit, r in done.items() if isinstance(r, BaseException)}


def tally(done: Mapping[str, Any], what: str, count: str, *, answers_raise: bool = True) -> dict:
    """Total a :func:`fan_out` of counting calls; raise for the units it did not reach.

    Call it once the fan-out is over: every reachable unit has then done
    its part, whatever the others did.

    Parameters
    ----------
    done : dict
        What :func:`fan_out` returned: unit -> an int, or the error its call raised.
    what : str
        The operation, for the error message (``"release of partition 'r0'"``).
    count : str
        Name of the total in the result (``"freed"``, ``"moved"``).
    answers_raise : bool, optional
        Raise an error a unit answered with (anything but
        :class:`UnitLostError`): the unit is there, the caller's keys or
        partition are wrong. False counts every failure as unreachable.

    Returns
    -------
    dict
        ``{count: total over the units that answered, "unreachable": {}}``.

    Raises
    ------
    PartialFailureError
        Some units were not reached; ``.result`` is ``{count: total,
        "unreachable": {unit: reason}}`` and the message names the units.
    """
    if answers_raise:
        for unit in sorted(done):
            if isinstance(done[unit], BaseException) and not isinstance(done[unit], UnitLostError):
                raise done[unit]
    unreachable = failures(done)
    total = sum(int(r) for r in done.values() if not isinstance(r, BaseException))
    result = {count: total, "unreachable": unreachable}
    if unreachable:
        shown = "; ".join(f"{unit}: {reason}" for unit, reason in sorted(unreachable.items()))
        raise PartialFailureError(f"{what}: {total} keys {count} on {len(done) - len(unreachable)} units; "
                                  f"unreachable: {shown}", result)
    return result
