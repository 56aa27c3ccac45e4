"""The fetch stage's parts, one for each way of moving a micro-batch's bytes (the ways a stream calls are
:mod:`gputq.client.fetch_ways`; the whole-shard fetch reads by :func:`read_requests` too).

- **Staged** (:func:`read_staged`): each unit's span requests read into a
  compact buffer, units in parallel: rdma (into registered memory) and GPU
  destinations. Over rdma the next micro-batch's leases are taken while
  this one's bytes move (:class:`LeasesAhead`): its READs then pay no round
  trip first.
- **Landed** (:class:`ReadsAhead` with :func:`~gputq.client.landing.land_replies`):
  over tcp on the host, reads are sent ahead of their replies on one
  pipeline per unit, and each reply is widened as it lands.
- **In place** (:func:`lease_in_place`): same-host arenas (shm) are leased
  and read where they lie, by the restore itself.

Each gets what it needs through the reader's
:class:`~gputq.client.read_context.ReadContext`.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, wait

from gputq.client.in_place import add_leased
from gputq.client.read_context import ReadContext
from gputq.client.plan import MicroPlan
from gputq.errors import GputqError, HintMissedError, LeaseExpiredError, UnitLostError
from gputq.kernels import MappedSource
from gputq.transport.tcp_connection import SOCKET_BUFFER_BYTES

__all__ = ["read_staged", "read_requests", "ReadsAhead", "LeasesAhead", "lease_in_place", "fits_socket_buffers",
           "Fetched"]


def read_staged(context: ReadContext, plan: MicroPlan, staging, held: list | None = None) -> None:
    """Read ``plan``'s span requests into ``staging`` (see :func:`read_requests`)."""
    read_requests(context, plan.requests, staging, held)


def read_requests(context: ReadContext, requests: list, staging, held: list | None = None) -> None:
    """Read ``requests`` into their bytes of ``staging``: each unit's in sequence, units in parallel (parallel
    streams from one unit only contend for its cores), the largest unit's on this thread.

    Each request (a :class:`~gputq.client.plan.SpanRequest`) reads itself from its unit's channel, under
    its lease in ``held`` (one per request, or None) where one was taken ahead.
    """
    per_unit: dict[str, list] = {}
    for r, lease in zip(requests, held or [None] * len(requests)):
        per_unit.setdefault(r.unit, []).append((r, lease))
    groups = sorted(per_unit.values(), key=lambda group: sum(r.stop - r.start for r, _ in group))
    jobs = [context.pool.submit(_read_group, context, group, staging) for group in groups[:-1]]
    try:
        if groups:
            _read_group(context, groups[-1], staging)
    finally:
        wait(jobs)  # no read may still be writing into staging when this returns
    for job in jobs:
        job.result()


def _read_group(context: ReadContext, requests: list, staging) -> None:
    for i, (r, lease) in enumerate(requests):
        try:
            r.read(context.channel(r.unit), staging[r.start:r.stop], context.read_timeout_s, lease)
        except BaseException:
            for later, held in requests[i + 1:]:  # leased ahead, now never read: ended, not left pinned
                if held is not None:
                    with contextlib.suppress(GputqError):
                        context.channel(later.unit).drop_lease(held)
            raise


def fits_socket_buffers(plan: MicroPlan) -> bool:
    """Whether each unit's replies to ``plan`` fit in the socket buffers (the unit's send then never waits)."""
    per_unit: dict[str, int] = {}
    for r in plan.requests:
        per_unit[r.unit] = per_unit.get(r.unit, 0) + r.stop - r.start
    return max(per_unit.values(), default=0) <= SOCKET_BUFFER_BYTES


class ReadsAhead:
    """A stream's read pipelines (one connection per unit) and which of its reads went out ahead."""

    def __init__(self, context: ReadContext):
        self._ctx = context
        self._pipes: dict = {}  # unit -> its read pipeline
        self._sent: set = set()  # (micro-batch, request) sent ahead of its fetch

    def pipe(self, unit: str):
        """The read pipeline to ``unit``, opened on first use."""
        pipe = self._pipes.get(unit)
        if pipe is None:
            pipe = self._pipes[unit] = self._ctx.channel(unit).pipeline()
        return pipe

    def send(self, plan: MicroPlan) -> None:
        """Send the reads of ``plan`` not sent ahead; a failure raises (the micro-batch's own fetch)."""
        for k, r in enumerate(plan.requests):
            if (plan.index, k) not in self._sent:
                r.send(self.pipe(r.unit), self._ctx.read_timeout_s)

    def send_ahead(self, plan: MicroPlan) -> None:
        """Send ``plan``'s reads now; one that fails is left to its own fetch, which raises it there.

        A failed send drops its unit's connection with every read in flight
        on it: none of ``plan``'s reads to that unit counts as sent then.
        """
        for k, r in enumerate(plan.requests):
            try:
                r.send(self.pipe(r.unit), self._ctx.read_timeout_s)
            except GputqError:
                self._sent.difference_update((plan.index, j) for j, q in enumerate(plan.requests) if q.unit == r.unit)
                return
            self._sent.add((plan.index, k))

    def close(self) -> None:
        """Close every pipeline: replies still queued go with their connections. Idempotent."""
        pipes, self._pipes = self._pipes, {}
        for pipe in pipes.values():
            pipe.close()


class LeasesAhead:
    """A stream's leases taken ahead of their reads (one-sided reads: rdma), by micro-batch.

    :meth:`request` leases a micro-batch's reads on the reader's threads
    while the fetch thread READs the one before; :meth:`take` hands them to
    its fetch. A lease that failed is left to the read, which leases again
    and raises there, in its own micro-batch, but for one that found its
    unit lost: its error is the micro-batch's (``UnitTimeoutError`` for a
    hung unit, not "is lost" again). One never read is ended by
    :meth:`close`.
    """

    def __init__(self, context: ReadContext):
        self._ctx = context
        self._held: dict[int, list[tuple[str, Future]]] = {}  # micro-batch -> (unit, its lease) per request

    def request(self, plan: MicroPlan) -> None:
        """Lease ``plan``'s reads in the background (placed: :meth:`MicroPlan.finish` ran)."""
        if plan.index not in self._held:
            self._held[plan.index] = [(r.unit, self._ctx.pool.submit(r.lease_ahead, self._ctx.channel(r.unit),
                                                                     self._ctx.read_timeout_s))
                                      for r in plan.requests]

    def take(self, plan: MicroPlan) -> list | None:
        """``plan``'s leases, one per request (None where its lease failed), or None if none was requested."""
        leases = self._held.pop(plan.index, None)
        if leases is None:
            return None
        wait([future for _, future in leases])
        lost = next((f.exception() for _, f in leases if isinstance(f.exception(), UnitLostError)), None)
        if lost is not None:
            self._drop(leases)
            raise lost
        return [None if future.exception() is not None else future.result() for _, future in leases]

    def close(self) -> None:
        """End the leases no read took. Idempotent."""
        held, self._held = self._held, {}
        for leases in held.values():
            wait([future for _, future in leases])
            self._drop(leases)

    def _drop(self, leases: list) -> None:
        for unit, future in leases:
            if future.exception() is None:
                with contextlib.suppress(GputqError):  # an unended lease costs the unit's timeout only
                    self._ctx.channel(unit).drop_lease(future.result())


def lease_in_place(context: ReadContext, plan: MicroPlan, *, ahead: bool = False
                   ) -> tuple[MappedSource, contextlib.ExitStack]:
    """Lease the micro-batch's spans where they lie in the mapped arenas; the restore reads them there.

    Its leases are confirmed when the returned stack closes, after the
    restore (an expired one raises ``StaleReadError`` then): one pass over
    the compact bytes, no copy. With ``ahead``, the regions are the ones the
    units' key directories name, returned at once while the leases are
    requested; a lease that names others raises ``HintMissedError`` when the
    stack closes (lease again without ``ahead`` and restore again).
    """
    leases = contextlib.ExitStack()
    try:
        starts, addresses, lengths = [], [], []
        for r in plan.requests:
            regions = leases.enter_context(context.channel(r.unit).mapped_source(
                r.keys, context.read_timeout_s, generations=r.generations, incarnation=r.incarnation or None,
                device=False, ahead=ahead, spans=r.spans)).tolist()
            add_leased(r, regions, starts, addresses, lengths)
        return MappedSource(starts, addresses, lengths, plan.nbytes), leases
    except BaseException:
        leases.close()
        raise


class Fetched:
    """A micro-batch's bytes once fetched: staged in a compact buffer of ``pool``, or leased where they lie (shm).

    Exactly one of :meth:`restore` and :meth:`drop` is called: the buffer
    then goes back to its pool, or the leases end.
    """

    def __init__(self, *, buffer=None, pool=None, in_place: tuple | None = None, again=None):
        self._buffer, self._pool, self._in_place, self._again = buffer, pool, in_place, again

    def restore(self, restore, nbytes: int):
        """``restore(source)`` over the micro-batch's ``nbytes``; then the buffer goes back, or the leases end
        (confirmed: the restore read the mappings under them).

        In place, where ``again`` is given (a stream's micro-batch), a lease
        taken ahead that named other regions than the key directories', or
        one that expired before the restore ended (its consumer came later
        than the lease's lifetime), is taken again by ``again()`` and the
        restore runs again, under the new lease: only what it read reaches
        the consumer.
        """
        if self._in_place is not None:
            source, leases = self._in_place
            try:
                with leases:
                    return restore(source)
            except (HintMissedError, LeaseExpiredError):
                if self._again is None:
                    raise
            source, leases = self._again()
            with leases:
                return restore(source)
        try:
            return restore(self._buffer[:nbytes])
        finally:
            self._pool.put(self._buffer)

    def drop(self) -> None:
        """Give back what a fetch that will not be restored holds: its compact buffer, or its leases (unread)."""
        if self._in_place is None:
            self._pool.put(self._buffer)
            return
        with contextlib.suppress(Exception):  # an unread lease that expires costs nothing
            self._in_place[1].close()

