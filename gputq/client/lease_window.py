"""In-place reads leased a window of micro-batches at a time: one lease per unit covers several restores.

A stream over same-host arenas (shm) restores each micro-batch straight out
of the mappings, under a lease that keeps the unit from reusing the regions
meanwhile. A lease per micro-batch costs a control round trip and the unit's
handling of it, on the cores the restore shares. Here one lease per unit
(more only where a request limit splits it) covers a window of micro-batches
(:func:`window_bounds`: 2, 4, then :data:`WINDOW_MICRO_BATCHES`). The
windows ahead are placed by a task the stream queues behind each fetch on
the fetch thread, a few micro-batches at a time while that micro-batch is
restored (a fetch places its own window at most), and each is leased in the
background once placed, one window's leases at a time. The first two
micro-batches, fetched before anything is restored, are leased alone as a
read would be: their regions read from the key directories while each unit's
lease is exchanged, by the channels' own helper threads. A micro-batch whose
window's leases are still on their way is restored on the directories'
regions likewise, and confirmed against the window's leases after.

Integrity is the per-read lease's:

- a restore counts only if it ended within the lease's proven lifetime
  (:meth:`~gputq.transport.one_sided.HeldLease.covered`); one that did not
  is leased alone and restored again (``HintMissedError`` inside the
  fetched micro-batch), so no byte read uncovered reaches the consumer;
- a window past :data:`~gputq.transport.one_sided.FRESH_FRACTION` of its
  lifetime when a micro-batch is fetched, a channel reconnected since, or
  a window whose lease failed (a stale key, say) is not used: the
  micro-batch is leased alone, and raises its own error at its own turn.
  Where the window's lease found a unit lost, each of its micro-batches
  that reads that unit raises that error (``UnitTimeoutError`` for a hung
  one), at its own turn;
- a window's leases end once each of its micro-batches was restored,
  dropped, or leased alone, or when the stream closes.
"""

from __future__ import annotations

import contextlib
import threading
from bisect import bisect_right
from concurrent.futures import Future, wait

import numpy as np

from gputq.client.fanout import fan_out
from gputq.client.fetch import Fetched, lease_in_place
from gputq.client.in_place import add_leased
from gputq.client.plan import READ_BATCH_KEY_BYTES, READ_BATCH_KEYS, MicroPlan, SpanRequest
from gputq.client.read_context import ReadContext
from gputq.errors import ClosedError, GputqError, HintMissedError, UnitLostError
from gputq.kernels import MappedSource
from gputq.transport.spans import MAX_SPANS

__all__ = ["LeaseWindows", "window_bounds", "WINDOW_MICRO_BATCHES", "LEASED_ALONE"]

#: Micro-batches one window's leases cover at most: enough that a lease is a small share of their
#: restores, few enough that released steps are not held long past their use.
WINDOW_MICRO_BATCHES = 8
#: Micro-batches one :meth:`LeaseWindows.place_ahead` places at most: a few, so that the fetch queued behind it
#: waits little, yet enough that placement keeps a window ahead of the fetches.
PLACED_AHEAD = 4
#: The first micro-batches, each leased alone: they are fetched before anything is restored, and a
#: window's lease taken then would compete with the first restore, which nothing overlaps.
LEASED_ALONE = 2


def window_bounds(count: int, most: int = WINDOW_MICRO_BATCHES) -> list[tuple[int, int]]:
    """The windows of a stream of ``count`` micro-batches, as ``[first, stop)``: the first
    :data:`LEASED_ALONE` of one micro-batch each (leased alone), then 2, 4, ... ``most``."""
    bounds, first = [], 0
    sizes = [1] * LEASED_ALONE
    while first < count:
        size = sizes.pop(0) if sizes else min(2 * (bounds[-1][1] - bounds[-1][0]), most)
        bounds.append((first, min(count, first + size)))
        first += size
    return bounds


class _Lease:
    """One lease request of a window being built: a unit's keys (each once) and the spans of its reads."""

    def __init__(self, unit: str, incarnation: str):
        self.unit, self.incarnation = unit, incarnation
        self.keys: list = []
        self.generations: list = []
        self.spans: list = []
        self.rows = self.key_bytes = 0
        self._index: dict = {}  # (key, generation) -> its index in keys

    def fits(self, request: SpanRequest) -> bool:
        """Whether ``request`` can join without passing a request's limits (keys, key bytes, spans)."""
        return (len(self.keys) + len(request.keys) <= READ_BATCH_KEYS
                and self.key_bytes + request.key_bytes <= READ_BATCH_KEY_BYTES
                and self.rows + len(request.spans) <= MAX_SPANS)

    def add(self, request: SpanRequest) -> slice:
        """Join ``request``'s keys and spans; returns the lease's rows that are its spans' regions."""
        remap = np.empty(len(request.keys), dtype=np.int64)
        for i, (key, generation) in enumerate(zip(request.keys, request.generations)):
            index = self._index.get((key, generation))
            if index is None:
                index = self._index[(key, generation)] = len(self.keys)
                self.keys.append(key)
                self.generations.append(generation)
                self.key_bytes += len(key.encode()) + 8
            remap[i] = index
        spans = np.array(request.spans, dtype=np.int64, copy=True)
        spans[:, 0] = remap[spans[:, 0]]
        self.spans.append(spans)
        rows = slice(self.rows, self.rows + len(spans))
        self.rows += len(spans)
        return rows

    def take(self, context: ReadContext):
        """Lease it on its unit's channel (a :class:`~gputq.transport.one_sided.HeldLease`)."""
        return context.channel(self.unit).lease_ahead(self.keys, context.read_timeout_s,
                                                      generations=self.generations,
                                                      incarnation=self.incarnation or None,
                                                      spans=np.concatenate(self.spans))


class _Window:
    """The leases of micro-batches ``[first, stop)``: per micro-batch, (request, lease, the lease's rows)."""

    def __init__(self, first: int, stop: int):
        self.first, self.stop = first, stop
        self.shares: dict[int, list] = {}
        self.leases: list = []  # (its _Lease, the held lease once taken)
        self.unsettled = set(range(first, stop))
        self.future: Future = Future()


class LeaseWindows:
    """A stream's in-place fetches, leased a window at a time (see the module docstring).

    Called as ``windows(plan)`` on the stream's fetch thread, in order;
    returns the micro-batch's :class:`~gputq.client.fetch.Fetched`, whose
    restore confirms the micro-batch and settles its share of the window.
    """

    def __init__(self, context: ReadContext, plans: list):
        self._ctx, self._plans = context, plans
        self._windows = [_Window(first, stop) for first, stop in window_bounds(len(plans))]
        self._firsts = [w.first for w in self._windows]
        self._placed = self._started = 0  # windows placed, and whose leases were requested
        # The micro-batches before this one are placed (those leased alone place themselves when fetched).
        self._finished = self._windows[LEASED_ALONE].first if len(self._windows) > LEASED_ALONE else len(plans)
        for window in self._windows[:LEASED_ALONE]:  # leased alone: the fastest start
            window.future.set_running_or_notify_cancel()
            window.future.set_result(None)
            self._placed = self._started = self._placed + 1
        self._lock, self._closed = threading.Lock(), False

    def __call__(self, plan: MicroPlan) -> Fetched:
        number = bisect_right(self._firsts, plan.index) - 1
        window = self._windows[number]
        again = lambda: lease_in_place(self._ctx, plan)  # noqa: E731
        if number < LEASED_ALONE:  # its lease exchanged by the channels' own helpers, its regions read meanwhile
            return Fetched(in_place=lease_in_place(self._ctx, plan.finish(), ahead=True), again=again)
        self._start_until(number + 1)  # placed and leased by an earlier place_ahead, unless it failed
        if not window.future.done():
            hinted = self._hinted(window, plan)
            if hinted is not None:
                return Fetched(in_place=hinted, again=again)
        failed = _outcome(window)
        try:
            _raise_own(failed, plan)
        except GputqError:
            self._settle(window, plan.index)
            raise
        if failed is None and all(held.fresh() for _, held, _ in window.shares.get(plan.index, ())):
            try:
                return Fetched(in_place=self._in_window(window, plan), again=again)
            except GputqError:  # a channel reconnected since, or a lost unit: leased alone, its own error
                pass
        self._settle(window, plan.index)
        return Fetched(in_place=lease_in_place(self._ctx, plan, ahead=True), again=again)  # leased alone

    def place_ahead(self, plan: MicroPlan) -> None:
        """Place up to :data:`PLACED_AHEAD` micro-batches of the windows through the one after the next
        micro-batch's, and lease the next window whose turn it is. The stream queues it on the fetch thread
        behind each micro-batch's fetch, so that it runs while that one is restored (the widen leaves the
        GIL), never before a fetch returns: a fetch places its own window at most. Nothing behind the
        fetches leased alone: the first restore and its leases go first."""
        if bisect_right(self._firsts, plan.index) - 1 >= LEASED_ALONE:  # plan's window, past those leased alone
            self._start_until(bisect_right(self._firsts, plan.index + 1) + 1, PLACED_AHEAD)

    def _start_until(self, count: int, most: int | None = None) -> None:
        """Place the micro-batches of the windows before ``count`` not placed yet (``most`` of them at most;
        here, on the fetch thread, the one that places every micro-batch), and lease the next window whose
        turn it is."""
        stop = self._windows[min(count, len(self._windows)) - 1].stop
        if most is not None:
            stop = min(stop, self._finished + most)
        while self._finished < stop and not self._closed:
            self._plans[self._finished].finish()
            self._finished += 1
            if self._finished == self._windows[self._placed].stop:
                with self._lock:
                    self._placed += 1
        self._lease_next()

    def _lease_next(self) -> None:
        """Lease the next placed window in the background once the one before it is answered: one window's
        leases in flight at a time, so the answer a restore waits for has the unit to itself."""
        with self._lock:
            if self._closed or self._started >= self._placed or \
                    (self._started and not self._windows[self._started - 1].future.done()):
                return
            window = self._windows[self._started]
            self._started += 1
        self._ctx.pool.submit(self._lease, window)

    def _lease(self, window: _Window) -> None:
        """Lease the window's requests, unit by unit, into ``window.future``."""
        if not window.future.set_running_or_notify_cancel():
            return
        try:
            building: dict[tuple, _Lease] = {}
            placed = []
            for index in range(window.first, window.stop):
                for request in self._plans[index].requests:
                    lease = building.get((request.unit, request.incarnation))
                    if lease is None or not lease.fits(request):
                        lease = building[(request.unit, request.incarnation)] = _Lease(request.unit,
                                                                                        request.incarnation)
                        window.leases.append((lease, None))
                    placed.append((index, request, lease, lease.add(request)))
            self._take(window)
            held = dict(window.leases)
            for index, request, lease, rows in placed:
                window.shares.setdefault(index, []).append((request, held[lease], rows))
            window.future.set_result(None)
        except BaseException as exc:
            self._end(window)
            window.future.set_exception(exc)
        self._lease_next()

    def _take(self, window: _Window) -> None:
        """Take the window's leases in parallel (each is a round trip to its unit), the first on this thread;
        every one taken is kept in ``window.leases`` (to be ended), and the first failure raised.

        Spread by :func:`~gputq.client.fanout.fan_out`, whose caller runs
        what no thread took, not on the reader's pool: this runs on that
        pool, and streams leasing at once could fill it with windows each
        waiting for its other leases queued behind them.
        """
        leases = [lease for lease, _ in window.leases]

        def take(i: int):
            try:
                return leases[i].take(self._ctx)
            except BaseException as exc:  # raised once every lease taken is kept
                return exc
        taken = fan_out(range(len(leases)), take)
        for i, held in taken.items():
            if not isinstance(held, BaseException):
                window.leases[i] = (leases[i], held)
        failed = [held for held in taken.values() if isinstance(held, BaseException)]
        if failed:
            raise failed[0]

    def _hinted(self, window: _Window, plan: MicroPlan) -> tuple[MappedSource, contextlib.ExitStack] | None:
        """``plan``'s regions as the units' key directories name them, while the window's leases are on their
        way: the source, and the stack whose close confirms them against the leases; None where a
        directory names them not all."""
        try:
            with contextlib.ExitStack() as held:
                starts, addresses, lengths, hints = [], [], [], []
                for request in plan.requests:
                    lent = held.enter_context(self._ctx.channel(request.unit).directory_lent(
                        request.keys, request.generations, request.spans))
                    if lent is None:
                        return None
                    add_leased(request, lent.tolist(), starts, addresses, lengths)
                    hints.append(lent)
                stack = held.pop_all()
        except GputqError:  # a lost unit, a torn entry: the window's leases say
            return None
        stack.callback(self._settle, window, plan.index)
        stack.push(lambda kind, *_: self._confirmed(kind, window, plan, hints))
        return MappedSource(starts, addresses, lengths, plan.nbytes), stack

    def _confirmed(self, kind, window: _Window, plan: MicroPlan, hints: list) -> bool:
        """After a restore on the directories' regions (``kind``: its error's type, or None): its window's
        leases must name the same regions and have covered it, else ``HintMissedError`` (lease it alone
        and restore again), also in place of the restore's error (a hint may name any bytes, misaligned
        ones too); a unit the window's lease found lost raises its error."""
        if kind is not None and not issubclass(kind, Exception):
            return False
        failed = _outcome(window)
        _raise_own(failed, plan)
        shares = window.shares.get(plan.index, []) if failed is None else None
        if shares is None or not all(held.covered() for _, held, _ in shares) or not self._named(shares, hints):
            raise HintMissedError(f"micro-batch {plan.index} was restored on key directory regions its window's "
                                  f"leases did not confirm; leased alone and restored again")
        return False

    def _named(self, shares: list, hints: list) -> bool:
        """Whether each request's leased regions are the ones its directory named."""
        with contextlib.ExitStack() as stack:
            return all(np.array_equal(lent, hint) for lent, hint in zip(self._lent(stack, shares), hints))

    def _lent(self, stack: contextlib.ExitStack, shares: list) -> list:
        """Each share's leased regions where they lie (host addresses, one lease decoded once), the
        mappings held until ``stack`` closes."""
        by_lease: dict[int, np.ndarray] = {}
        lent = []
        for request, held, rows in shares:
            if id(held) not in by_lease:
                by_lease[id(held)] = stack.enter_context(self._ctx.channel(request.unit).mapped_lease(held))
            lent.append(by_lease[id(held)][rows])
        return lent

    def _in_window(self, window: _Window, plan: MicroPlan) -> tuple[MappedSource, contextlib.ExitStack]:
        """``plan``'s regions where they lie, under the window's leases: the source, and the stack whose
        close checks the restore was covered and settles the micro-batch's share."""
        stack = contextlib.ExitStack()
        stack.callback(self._settle, window, plan.index)
        try:
            starts, addresses, lengths = [], [], []
            shares = window.shares.get(plan.index, [])
            for (request, _, _), lent in zip(shares, self._lent(stack, shares)):
                add_leased(request, lent.tolist(), starts, addresses, lengths)
            helds = [held for _, held, _ in shares]
            stack.push(lambda kind, *_: _covered(kind, helds, plan.index))
            return MappedSource(starts, addresses, lengths, plan.nbytes), stack
        except BaseException:
            stack.close()
            raise

    def _settle(self, window: _Window, index: int) -> None:
        """Micro-batch ``index`` no longer reads under ``window``: its leases end after the last one's."""
        with self._lock:
            window.unsettled.discard(index)
            last = not window.unsettled
        if last:
            self._end(window)

    def _end(self, window: _Window) -> None:
        """End the window's leases (once; a lost unit's need nothing)."""
        with self._lock:
            leases, window.leases = window.leases, []
        for lease, held in leases:
            if held is not None:
                with contextlib.suppress(GputqError):  # an unended lease costs the unit's lease timeout only
                    self._ctx.channel(lease.unit).drop_lease(held)

    def close(self) -> None:
        """End every window's leases: those requested in the background once they are answered. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            started = self._started
        for number, window in enumerate(self._windows):
            # A window not leased yet never will be; one queued is told by its own lease task.
            if window.future.cancel() and number >= started:
                window.future.set_running_or_notify_cancel()
        wait([window.future for window in self._windows])
        for window in self._windows:
            self._end(window)


def _raise_own(failed: BaseException | None, plan: MicroPlan) -> None:
    """Raise what a window's failed lease means for ``plan`` itself: the stream closed, or a unit it reads
    was found lost (its error, ``UnitTimeoutError`` for a hung one, not "is lost" again)."""
    if isinstance(failed, ClosedError) or (isinstance(failed, UnitLostError) and failed.unit in plan.units):
        raise failed


def _outcome(window: _Window) -> BaseException | None:
    """Wait for the window's leases: None once taken, else why not (``ClosedError`` once the stream closed)."""
    wait([window.future])
    if window.future.cancelled():
        return ClosedError("the stream was closed")
    return window.future.exception()


def _covered(kind, helds: list, index: int) -> bool:
    """After micro-batch ``index``'s restore (``kind``: its error's type, or None): raise ``HintMissedError``
    where a lease did not provably cover it (lease it alone and restore again)."""
    if kind is None and not all(held.covered() for held in helds):
        raise HintMissedError(f"micro-batch {index} was restored past its window's proven lease lifetime; "
                              f"leased alone and restored again")
    return False
