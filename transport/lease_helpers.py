"""The helper threads of a same-host channel that exchange its leases while its reads copy."""

from __future__ import annotations

import queue
import threading

from gputq.errors import ClosedError
from gputq.transport import arena_copies

__all__ = ["LeaseHelpers", "Exchange"]


class Exchange:
    """The outcome of one job of :class:`LeaseHelpers`."""

    __slots__ = ("done", "value", "error")

    def __init__(self):
        self.done = threading.Lock()
        self.done.acquire()  # released once the job ran
        self.value = self.error = None

    def result(self):
        """Wait for the job; its return value, or its exception raised here."""
        with self.done:
            pass
        if self.error is not None:
            raise self.error
        return self.value


class LeaseHelpers:
    """Threads of one channel running its lease exchanges while the reads copy.

    Every read hands one over, so handing over must be cheap: a queue put and
    a lock, about half what a ``ThreadPoolExecutor.submit`` (a future, its
    condition, the idle-thread semaphore) costs in the caches a copy has
    just swept. A thread starts when a job finds none idle, up to
    ``threads``. Its job done (the reply handed to the read), a thread takes
    pieces of the large copies under way (:func:`arena_copies.help_copies`)
    before it waits for the next: on a box with few cores the core it ran
    on is the one free at that point of a read.
    """

    def __init__(self, threads: int, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads, self._name = threads, name
        self._started = self._idle = 0
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn, *args) -> Exchange:
        exchange = Exchange()
        with self._lock:  # no job may follow the stop marks of close()
            if self._closed:
                raise ClosedError(f"{self._name}: the channel is closed")
            if self._idle:
                self._idle -= 1  # that thread's job: the next one finds it busy
            elif self._started < self._threads:
                threading.Thread(target=self._run, name=f"{self._name}-{self._started}", daemon=True).start()
                self._started += 1
            self._jobs.put((fn, args, exchange))
        return exchange

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, args, exchange = job
            try:
                exchange.value = fn(*args)
            except BaseException as exc:  # handed to the waiting read
                exchange.error = exc
            finally:
                exchange.done.release()
            # The job refers to its channel: kept while the next is awaited, it would keep a channel dropped
            # unclosed alive, and so these threads (the channel's finalizer closes them).
            job = fn = args = exchange = None
            # Free now, while the read's copy (if large) likely still runs: take pieces of it.
            arena_copies.help_copies()
            with self._lock:
                self._idle += 1

    def close(self) -> None:
        """Let the threads end once the jobs handed over are done. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for _ in range(self._started):
                self._jobs.put(None)
