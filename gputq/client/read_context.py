"""What the read stages of one trainer rank share: channels, config, device, buffers and threads.

A :class:`~gputq.client.reader.Reader` owns one :class:`ReadContext` and
hands it to every stage it runs (the whole-shard fetch, each
:class:`~gputq.client.stream.MicroBatchStream`, the same-host restores).
A stage reaches the units, the config, the output device and reusable
memory through it alone, never through the Reader's own attributes: what a
stage may touch is what this class declares.

:class:`Buffers` is the one place memory is lent. Streams of later steps
reuse the buffers of earlier ones, and fetches reuse one staging buffer:
fresh pages fault in slowly, during the very receive they should serve.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from gputq.client.clients import UnitClients
from gputq.client.unit_channel import UnitChannel
from gputq.config import GputqConfig
from gputq.errors import ClosedError, InvalidInputError, MissingDependencyError
from gputq.kernels import cuda_available
from gputq.transport import get_transport
from gputq.transport.cuda import require_cupy

__all__ = ["ReadContext", "Buffers", "device_index"]

log = logging.getLogger(__name__)


def _cupy():
    return require_cupy("device='cuda'")


def _torch():
    try:
        import torch
    except ImportError:
        raise MissingDependencyError("device='cuda' returns CUDA torch tensors: pip install torch") from None
    return torch


def device_index(device: str) -> int:
    """The CUDA ordinal of ``"cuda"`` or ``"cuda:N"``."""
    return int(device.split(":", 1)[1]) if ":" in device else 0


class Buffers:
    """Byte buffers on one device: lent to streams and given back, plus one growing staging buffer."""

    def __init__(self, device: str):
        self.device = device
        self._spare: list = []  # buffers given back, for the next streams
        self._lock = threading.Lock()
        self._staging = None
        self._closed = False

    def empty(self, nbytes: int):
        """A new uint8 buffer of ``nbytes`` (numpy, or CuPy on the device)."""
        if self.device == "cpu":
            return np.empty(nbytes, dtype=np.uint8)
        cp = _cupy()
        with cp.cuda.Device(device_index(self.device)):
            return cp.empty(nbytes, dtype=cp.uint8)

    def staging(self, nbytes: int):
        """The one reusable staging buffer, grown geometrically, cut to ``nbytes`` (one user at a time)."""
        if self._staging is None or self._staging.nbytes < nbytes:
            grown = int(1.5 * self._staging.nbytes) if self._staging is not None else 0
            self._staging = self.empty(max(nbytes, grown))
        return self._staging[:nbytes]

    def lend(self, nbytes: int, lent: contextlib.ExitStack):
        """A buffer of at least ``nbytes``, given back when ``lent`` closes.

        Of the smallest spare ones that fit, the one given back last: its
        lines are the likeliest still in the CPU's caches.
        """
        with self._lock:
            fits = [i for i, b in enumerate(self._spare) if b.nbytes >= nbytes]
            buffer = self._spare.pop(min(fits, key=lambda i: (self._spare[i].nbytes, -i))) if fits else None
        if buffer is None:
            buffer = self.empty(nbytes)
        lent.callback(self._give_back, buffer)
        return buffer[:nbytes]

    def _give_back(self, buffer) -> None:
        with self._lock:
            if not self._closed:
                self._spare.append(buffer)

    def close(self) -> None:
        """Drop every spare buffer; buffers still lent are dropped when given back. Idempotent."""
        with self._lock:
            self._closed = True
            self._spare.clear()
            self._staging = None


class ReadContext:
    """The narrow view of a Reader its read stages get.

    Parameters
    ----------
    clients:
        Channels to the units.
    config:
        Read timeout, frame limit, zero-copy threshold.
    device:
        ``"cpu"`` or ``"cuda[:N]"``: where restored fields live.
    """

    def __init__(self, clients: UnitClients, config: GputqConfig, device: str = "cpu"):
        if not (isinstance(device, str) and (device == "cpu" or device.startswith("cuda"))):
            raise InvalidInputError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
        if device != "cpu" and not cuda_available():
            raise InvalidInputError(f"device={device!r}, but no usable CUDA device (CuPy sees none)")
        if device != "cpu":
            _torch()  # here, not at the first restore
        self.clients, self.config, self.device = clients, config, device
        self.buffers = Buffers(device)
        #: Reads of several units at once (a fetch's, a staged micro-batch's).
        self.pool = ThreadPoolExecutor(max(2, len(clients.units) * 2), thread_name_prefix="gputq-reader")
        self._lock = threading.Lock()
        self._streams: weakref.WeakSet = weakref.WeakSet()  # open or not: closing one again is a no-op
        # What streams dropped unclosed left, queued by their finalizers: a SimpleQueue's put is safe where a
        # garbage collection runs them (any thread, inside any lock); the reaper thread does the work.
        self._leftovers: queue.SimpleQueue = queue.SimpleQueue()
        self._reaper: threading.Thread | None = None
        self._reaper_end: weakref.finalize | None = None
        self._idle: list[tuple] = []  # fetch, restore and release threads that closed streams gave back
        #: Set once :meth:`close` began: a stream closed by it tells its consumer so instead of ending.
        self.closed = False

    @property
    def on_host(self) -> bool:
        return self.device == "cpu"

    @property
    def read_timeout_s(self) -> float | None:
        return self.config.read_timeout_s

    def channel(self, unit: str) -> UnitChannel:
        return self.clients.channel(unit)

    def stream_threads(self) -> tuple[ThreadPoolExecutor, ThreadPoolExecutor, ThreadPoolExecutor]:
        """A fetch, a restore and a release thread for one stream alone, until it gives them back
        (:meth:`threads_back`); each starts at its first job.

        Never two streams' at once: a stream whose consumer stopped without
        closing it (a step raised out of its loop) may have work waiting for
        buffers the consumer holds, and that must not hold up the reader's
        next stream. A stream takes those that a closed one gave back, so
        that a stream a step starts no threads.
        """
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return (ThreadPoolExecutor(1, thread_name_prefix="gputq-prefetch"),
                ThreadPoolExecutor(1, thread_name_prefix="gputq-restore"),
                ThreadPoolExecutor(1, thread_name_prefix="gputq-release"))

    def threads_back(self, threads: tuple) -> None:
        """A closed stream's threads, with no work of it left, for the next stream; stopped once the reader
        is closing."""
        with self._lock:
            if not self.closed:
                self._idle.append(threads)
                return
        for thread in threads:
            thread.shutdown(wait=True)

    def track(self, stream, leftovers: Callable[[], None]) -> weakref.finalize:
        """Close ``stream`` (anything with ``close()``) before the threads it runs on stop; ``ClosedError``
        once they are stopping.

        Should the stream be dropped unclosed (a training step raised out of
        its loop), ``leftovers`` (which must not refer to it) runs on the
        reaper thread once it is garbage: what it holds on the units then
        goes at once, not a lease timeout later. Returns that finalizer, for
        the stream's ``close`` to detach.
        """
        with self._lock:
            if self.closed:
                raise ClosedError("Reader is closed")
            self._streams.add(stream)
            if self._reaper is None:
                self._reaper = threading.Thread(target=_reap, args=(self._leftovers,), name="gputq-reaper",
                                                daemon=True)
                self._reaper.start()
                # A reader dropped unclosed: its reaper ends once it ran what is queued before.
                self._reaper_end = weakref.finalize(self, self._leftovers.put, None)
        reaped = weakref.finalize(stream, self._leftovers.put, leftovers)
        reaped.atexit = False  # at exit the units' lease timeout does it: the reaper may be gone
        return reaped

    def registered(self, nbytes: int, units, lent: contextlib.ExitStack):
        """Memory the units' transport registered for its one-sided reads (they then land with no copy),
        lent until ``lent`` closes, when every unit of ``units`` is read over one such transport into
        host memory; else None."""
        names = {self.clients.transport_of(u)[0] for u in units}
        if not (self.on_host and len(names) == 1):
            return None
        transport = get_transport(names.pop())
        return lent.enter_context(transport.destination(nbytes)) if transport.registered_destinations else None

    def synchronize(self) -> None:
        """Wait for the restore's device work: before tensors are returned and leases end."""
        cp = _cupy()
        with cp.cuda.Device(device_index(self.device)):  # the kernels ran on that device's stream
            cp.cuda.get_current_stream().synchronize()

    def to_output(self, array):
        """``array`` as the caller gets it: numpy on the host, a CUDA torch tensor on the device."""
        if self.on_host:
            return array
        return _torch().from_dlpack(array)

    def close(self) -> None:
        """Close the streams, stop the read threads (the streams' too) and drop the buffers. Idempotent; the
        clients stay open.

        Streams go first: their work in flight still runs on the read threads, and a lease they are taking
        ends only once it is answered there.
        """
        with self._lock:
            self.closed = True
            streams = list(self._streams)
        for stream in streams:
            stream.close()
        with self._lock:
            reaper, self._reaper = self._reaper, None
        if reaper is not None:  # what dropped streams left runs first: it may wait for work on the pool
            self._reaper_end()
            reaper.join()
        with self._lock:
            idle, self._idle = self._idle, []
        for thread in (t for threads in idle for t in threads):
            thread.shutdown(wait=True)
        self.pool.shutdown(wait=True)
        self.buffers.close()


def _reap(leftovers: queue.SimpleQueue) -> None:
    """The reaper thread: run what streams dropped unclosed left (see :meth:`ReadContext.track`), until None."""
    while (job := leftovers.get()) is not None:
        try:
            job()
        except Exception:  # noqa: BLE001 - an unended lease costs the unit's lease timeout only
            log.warning("ending the leases of a stream dropped unclosed failed", exc_info=True)
        # A job refers to its reader's context (to give its stream's threads back): kept while the next is
        # awaited, it would keep a reader dropped unclosed, and so this thread and the reader's, alive for ever.
        job = None
