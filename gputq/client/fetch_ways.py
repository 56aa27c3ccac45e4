"""A stream's ways of fetching a micro-batch: one class each, called as ``way(plan)`` on the fetch thread.

- :class:`~gputq.client.lease_window.LeaseWindows`: same-host arenas (shm)
  on the host. The spans are leased where they lie, one lease per unit for
  a window of micro-batches, and the restore reads them there: no staging
  copy.
- :class:`StagedFetch`: each unit's span requests read into a compact
  buffer (rdma into registered memory, GPU destinations, and packed IDs
  over tcp, which unpack whole rows). Over rdma the next micro-batch's leases are
  taken while this one's bytes move.
- :class:`LandingFetch`: over tcp on the host, the reads go out ahead of
  their replies on one pipeline per unit and each reply is widened as it
  lands: the fetch returns the micro-batch restored.

:func:`choose_ways` picks among them. Each gets what it needs through the
reader's :class:`~gputq.client.read_context.ReadContext` and the stream's
:class:`~gputq.client.stream_buffers.StreamBuffers`; ``close`` ends what it
holds (pipelines, leases taken ahead).
"""

from __future__ import annotations

from typing import Callable

from gputq.client.fetch import Fetched, LeasesAhead, ReadsAhead, fits_socket_buffers, read_staged
from gputq.client.in_place import mapped_here
from gputq.client.landing import land_replies
from gputq.client.plan import MicroPlan
from gputq.client.read_context import ReadContext
from gputq.client.stream_buffers import StreamBuffers

__all__ = ["choose_ways", "StagedFetch", "LandingFetch"]


def choose_ways(context: ReadContext, units: list, prefetch: int, hold: bool, packed: bool
                ) -> tuple[bool, bool, bool]:
    """How a stream's bytes move: (read in place, landed as they arrive, restored ahead on a second thread).

    Packed IDs are never landed: they unpack whole rows, which a chunk as it
    lands does not hand over (read in place, each row lies in one region).
    """
    on_host = context.on_host and bool(units)
    in_place = on_host and all(mapped_here(context.channel(unit), False) for unit in units)
    landing = on_host and not packed and not in_place and all(context.channel(unit).pipelines_reads
                                                              for unit in units)
    return in_place, landing, context.on_host and prefetch >= 2 and not hold and not landing


class StagedFetch:
    """Read a micro-batch's span requests into a compact buffer, leasing the next one's ahead where the
    channels can (one-sided reads)."""

    def __init__(self, context: ReadContext, plans: list, buffers: StreamBuffers, units: list,
                 closed: Callable[[], bool]):
        self._ctx, self._plans, self._buffers, self._closed = context, plans, buffers, closed
        ahead = bool(units) and all(context.channel(unit).leases_ahead for unit in units)
        self._leases = LeasesAhead(context) if ahead else None

    def __call__(self, plan: MicroPlan) -> Fetched:
        plan.finish()
        buffer = self._buffers.take(self._buffers.compact)
        held = None
        if self._leases is not None:
            held = self._leases.take(plan)
            if plan.index + 1 < len(self._plans) and not self._closed():
                self._leases.request(self._plans[plan.index + 1].finish())
        try:
            read_staged(self._ctx, plan, buffer[:plan.nbytes], held)
        except BaseException:
            self._buffers.compact.put(buffer)
            raise
        return Fetched(buffer=buffer, pool=self._buffers.compact)

    def close(self) -> None:
        """End the leases taken ahead for fetches that will not run. Idempotent."""
        if self._leases is not None:
            self._leases.close()


class LandingFetch:
    """Send a micro-batch's reads (and the next one's) and widen each reply as it lands:
    ``(its shaped parts, its output buffers)``, the parts ``shape(plan, outputs)``.

    The next micro-batch's reads go out too if its fetch is queued behind
    this one (``queued()`` counts the fetches queued) or its replies fit
    the socket buffers: a unit never waits on a reader that stopped reading
    (see :class:`~gputq.client.fetch.ReadsAhead`).
    """

    def __init__(self, context: ReadContext, plans: list, buffers: StreamBuffers, shape: Callable,
                 queued: Callable[[], int], closed: Callable[[], bool]):
        self._ctx, self._plans, self._buffers, self._shape = context, plans, buffers, shape
        self._queued, self._closed = queued, closed
        self._reads = ReadsAhead(context)  # one read pipeline per unit

    def __call__(self, plan: MicroPlan) -> tuple:
        plan.finish()
        self._reads.send(plan)
        if plan.index + 1 < len(self._plans) and not self._closed():
            ahead = self._plans[plan.index + 1].finish()
            if plan.index + 1 < self._queued() or fits_socket_buffers(ahead):
                self._reads.send_ahead(ahead)
        outputs = self._buffers.spare_outputs()  # a failure ends the stream, whose close takes them back
        land_replies(plan, outputs, self._reads.pipe, self._ctx.read_timeout_s)
        return self._shape(plan, outputs), outputs

    def close(self) -> None:
        """Close the pipelines: replies still queued go with their connections. Idempotent."""
        self._reads.close()
