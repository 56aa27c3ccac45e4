"""A stream's reusable buffers: the compact buffers its reads land in, the output buffers it restores into.

Sized once, for the largest micro-batch, and lent for the stream's life
(host memory, GPU memory with ``device="cuda"``, or the transport's
registered memory where every unit is read over rdma); output buffers a
``hold`` consumer still holds when the stream ends stay lent until it
releases them, so that no later stream restores into them. How many of
each a stream holds depends on how its bytes move (:func:`buffer_counts`),
and it never holds more than ``prefetch + 1`` widened micro-batch slices:

- staged reads (rdma, GPU destinations) land in ``prefetch`` compact
  buffers; on the host (prefetch >= 2) a restore thread widens the next
  micro-batch into a second output buffer while the current one trains,
  and with int32 IDs (compact as large as widened) the stream then keeps
  ``prefetch - 1`` compact buffers;
- read where they lie in same-host arenas (shm), micro-batches need no
  compact buffer: each prefetched one is restored into an output buffer of
  its own, ``prefetch + 1`` in all;
- on the host over tcp each micro-batch is widened as its replies land,
  into one of ``prefetch + 1`` output buffers, and no compact buffer.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import Callable

import numpy as np

from gputq.client.read_context import ReadContext
from gputq.errors import ClosedError

__all__ = ["StreamBuffers", "buffer_counts"]


def _largest_outputs(plans: list) -> dict[str, tuple[int, np.dtype]]:
    """Per field, the most elements one micro-batch restores and their dtype: the output buffers' sizes."""
    largest: dict[str, tuple[int, np.dtype]] = {}
    for plan in plans:
        for fp in plan.fields.values():
            known = largest.get(fp.name, (0, fp.restored))[0]
            largest[fp.name] = (max(known, fp.out_elements), fp.restored)
    return largest


def buffer_counts(prefetch: int, micro_batches: int, staging: int, output_bytes: int, *, landing: bool,
                   in_place: bool, ahead: bool) -> tuple[int, int]:
    """How many output and compact buffers a stream holds, within ``prefetch + 1`` widened slices."""
    outputs = 2 if ahead else 1
    compact = prefetch
    if landing or (in_place and ahead):
        # No compact bytes to hold (they land widened, or are read where they lie): every
        # micro-batch in flight is restored ahead into an output buffer of its own, so the
        # restore never waits for the one the consumer gives back (nor needs waking then).
        outputs, compact = min(prefetch, micro_batches) + 1, 0
    elif in_place:
        compact = 0
    elif ahead:
        # A second output buffer costs compact ones, within (prefetch + 1) slices: with narrow IDs
        # (compact is half the widened bytes or less) it costs none, and a fetch never waits
        # for the restore before it to give its buffer back.
        room = (prefetch + 1 - outputs) * output_bytes
        compact = max(prefetch - 1, min(prefetch, room // staging if staging else prefetch))
    return outputs, min(compact, micro_batches)


class StreamBuffers:
    """The compact and output buffers of one stream, lent from its reader's pool until :meth:`close`.

    Parameters
    ----------
    ctx:
        The reader's context (its buffer pool, its registered memory).
    plans:
        The stream's micro-batch plans (they size the buffers).
    prefetch, units, landing, in_place, ahead:
        The stream's depth, the units it reads, and how its bytes move (see
        :func:`buffer_counts`).
    closed:
        Says whether the stream was closed: a wait for a free buffer then gives up.
    """

    def __init__(self, ctx: ReadContext, plans: list, prefetch: int, units: list, *, landing: bool,
                 in_place: bool, ahead: bool, closed: Callable[[], bool]):
        self._ctx, self._closed = ctx, closed
        self._largest = _largest_outputs(plans)
        self._lent = contextlib.ExitStack()  # the compact buffers
        # Each set of output buffers, by id, with the stack it was lent under: a set the consumer still holds
        # when the stream ends goes back to the reader's pool only once released (see give_back).
        self._sets: dict[int, tuple[dict, contextlib.ExitStack]] = {}
        self._lock, self._ended = threading.Lock(), False
        self.compact: queue.Queue = queue.Queue()
        self.outputs: queue.Queue = queue.Queue()
        staging = max((p.max_nbytes for p in plans), default=0)
        outputs, compact = buffer_counts(prefetch, len(plans), staging, self.output_bytes, landing=landing,
                                         in_place=in_place, ahead=ahead)
        for _ in range(compact):  # registered memory where every unit is read over rdma
            registered = ctx.registered(staging, units, self._lent)
            self.compact.put(ctx.buffers.lend(staging, self._lent) if registered is None else registered)
        for _ in range(outputs):
            self.outputs.put(self.new_outputs())
        #: Bytes held (more only while the consumer keeps micro-batches live).
        self.nbytes = compact * staging + outputs * self.output_bytes

    @property
    def output_bytes(self) -> int:
        """Bytes of one set of output buffers."""
        return sum(n * dtype.itemsize for n, dtype in self._largest.values())

    def new_outputs(self) -> dict:
        """One more set of output buffers, one per field, sized for the largest micro-batch."""
        lent = contextlib.ExitStack()
        outputs = {name: self._ctx.buffers.lend(n * dtype.itemsize, lent).view(dtype)
                   for name, (n, dtype) in self._largest.items()}
        with self._lock:
            self._sets[id(outputs)] = (outputs, lent)
        return outputs

    def give_back(self, outputs: dict) -> None:
        """A set of output buffers the consumer released: for the stream's next micro-batches, or back to the
        reader's pool once the stream ended."""
        with self._lock:
            if not self._ended:
                self.outputs.put(outputs)
                return
            _, lent = self._sets.pop(id(outputs))
        lent.close()

    def spare_outputs(self) -> dict:
        """A free set of output buffers, or a new one when the consumer holds them all (``hold``, replay)."""
        try:
            return self.outputs.get_nowait()
        except queue.Empty:
            return self.new_outputs()

    def take(self, pool: queue.Queue):
        """A free buffer of ``pool``; waits while the consumer holds them all, gives up once closed."""
        while True:
            try:
                return pool.get(timeout=0.05)
            except queue.Empty:
                if self._closed():
                    raise ClosedError("the stream was closed") from None

    def close(self, held=()) -> None:
        """Give every buffer back to the reader's pool but the output sets of ``held``: the consumer still reads
        those (micro-batches of a ``hold`` stream whose backwards run after it ended), and :meth:`give_back`
        returns each once released. Idempotent."""
        kept = {id(outputs) for outputs in held}
        with self._lock:
            if self._ended:
                return
            self._ended = True
            ended = [lent for key, (_, lent) in self._sets.items() if key not in kept]
            self._sets = {key: entry for key, entry in self._sets.items() if key in kept}
        for lent in ended:
            lent.close()
        self._lent.close()
