"""A stream's releases of the micro-batches its consumer is done with, on the stream's release thread.

With ``Reader.stream(..., release=partition)`` each consumed micro-batch's
references are dropped while the consumer reads on: the consumer never
waits for the units' answer. Micro-batches handed over while a release is
under way go together in the next one, one call per unit: where the
release thread falls behind (a training loop that holds the GIL leaves it
little time), it catches up instead of queueing a call per micro-batch.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable, Sequence

from gputq.data.refs import uses_by_unit

__all__ = ["StreamReleases"]


class StreamReleases:
    """The releases of one stream; refers to nothing of the stream, which a step may drop unclosed meanwhile.

    Parameters
    ----------
    release:
        ``release(layouts, indices) -> {unit: reason}``: drops the references
        of the micro-batches ``indices`` (their ``layouts``, together), and
        returns the units it did not release.
    layouts:
        Per micro-batch of the stream, its samples' layouts.
    thread:
        The stream's release thread.
    """

    def __init__(self, release: Callable[[list, list], dict], layouts: Sequence[list], thread: ThreadPoolExecutor):
        self._release, self._layouts, self._thread = release, layouts, thread
        self._lock = threading.Lock()
        self._queued: list[int] = []  # handed over, not yet taken by a release
        self._jobs: list[Future] = []  # releases submitted and not known done
        self._job_queued = False  # a submitted release has not started: it takes what is handed over meanwhile
        #: Micro-batch index -> {unit: reason} for the units of its samples a release did not reach.
        self.unreleased: dict[int, dict] = {}

    def hand_over(self, index: int) -> None:
        """Release micro-batch ``index`` on the release thread, with any others handed over before it starts."""
        with self._lock:
            self._queued.append(index)
            if not self._job_queued:
                self._job_queued = True
                self._jobs = [job for job in self._jobs if not job.done()] + [self._thread.submit(self._run)]

    def now(self, index: int) -> None:
        """Release micro-batch ``index`` on this thread (the stream is closed: nothing would wait for it)."""
        self._drop([index])

    def wait(self) -> None:
        """Wait for every release handed over (each bounded by the control timeout)."""
        with self._lock:
            jobs = list(self._jobs)
        wait(jobs)

    def _run(self) -> None:
        with self._lock:
            indices, self._queued, self._job_queued = self._queued, [], False
        self._drop(indices)

    def _drop(self, indices: list[int]) -> None:
        missed = self._release([layout for i in indices for layout in self._layouts[i]], indices)
        for index in indices if missed else ():
            units = uses_by_unit(self._layouts[index])
            mine = {unit: reason for unit, reason in missed.items() if unit in units}
            if mine:
                self.unreleased[index] = mine
