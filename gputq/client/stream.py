"""Micro-batches streamed to one trainer rank: only its slice, prefetched compact, widened when consumed.

:meth:`Reader.stream <gputq.client.reader.Reader.stream>` takes a rank's
data-parallel shard, the trainer's own micro-batch split and the rank's
:class:`~gputq.data.slices.ParallelSlice`, and yields one
:class:`MicroBatch` at a time, in order:

- every read names spans: only the rank's layers and token chunks leave
  the units (see :mod:`gputq.transport.spans`), usually one request per
  unit, a step shared by several samples of a micro-batch read once
  (planned by :mod:`gputq.client.plan`, before anything is read);
- the next ``prefetch`` micro-batches are fetched in the background, into
  reused compact buffers; on the host over tcp each is widened as its
  bytes land instead (see :mod:`gputq.client.landing`), and the next
  micro-batch's reads are sent before this one's replies are received, so
  that each unit works on them meanwhile;
- the micro-batch being consumed is widened to int32 in one output buffer
  per field, reused: its tensors are valid until the next one is requested
  (or, with ``hold``, until it is released);
- with ``release``, a micro-batch's references are dropped once the
  consumer moves past it, so a step whose last use has trained is freed
  while the rest of the shard trains: on a thread of the stream, so that
  the consumer never waits for the units' answer (see
  :mod:`gputq.client.stream_releases`); ``close()`` (and the stream's
  end) waits for every release under way (a lost unit's references are
  left to the rollout's ``release_partition``, named in
  :attr:`MicroBatchStream.unreleased`);
- a failed background fetch raises its typed error when the consumer
  reaches the micro-batch that needed it, never earlier and never as a hang
  (every read is bounded by the read timeout).

Fields with rows of two or more dimensions (R3) follow slime's rules for
routed experts: one pad row per sample, CP zigzag chunks with their pad,
the micro-batch padded to ``tp_size * pad_multiple`` rows, the sequence-
parallel share; pad rows hold ``arange % num_experts``. Other fields
(logprobs) are cut by the logits offsets of the same CP chunks.
"""

from __future__ import annotations

import functools
import threading
from concurrent.futures import CancelledError, Future, wait
from dataclasses import dataclass, field
from typing import Callable, Iterator

from gputq.client.fetch_ways import LandingFetch, StagedFetch, choose_ways
from gputq.client.lease_window import LeaseWindows
from gputq.client.read_context import ReadContext
from gputq.client.replay import LayerRef, LazyReplay
from gputq.client.restores import Restores, drop_fetched, run_into
from gputq.client.shape import SlimeShaper
from gputq.client.stream_buffers import StreamBuffers
from gputq.client.stream_releases import StreamReleases
from gputq.client.widen_shares import WidenShares
from gputq.data.fields import sample_key_of
from gputq.data.slices import ParallelSlice
from gputq.errors import ClosedError, InvalidInputError

__all__ = ["MicroBatch", "MicroBatchStream"]


def _unread(cut_short: bool, failed: BaseException | None, first: int, count: int) -> ClosedError | None:
    """Why micro-batches ``first``.. of ``count`` will not be read, where the consumer did not end the stream:
    the Reader was closed (``cut_short``), or micro-batch ``first`` raised ``failed`` (then the cause)."""
    if not cut_short and failed is None:
        return None
    why = "the Reader was closed" if cut_short else f"micro-batch {first} raised {type(failed).__name__}"
    unread = ClosedError(f"{why}: micro-batches {first}.. of {count} were not read")
    unread.__cause__ = failed
    return unread


def _wind_down(closed: threading.Event, pending: list, dropped, leases, threads_back: Callable[[], None]) -> None:
    """Stop a stream's work: what is queued is cancelled, what runs sees ``closed`` (or finishes its read,
    bounded by its timeout); the fetches of ``dropped``, never restored, give back their leases, then
    ``leases`` (its way: windows, leases taken ahead, pipelines) end, and its threads go back."""
    closed.set()
    for future in pending:
        future.cancel()
    wait(pending)
    for future in dropped:
        drop_fetched(future)
    if leases is not None:
        leases.close()
    threads_back()


def _leftovers(closed: threading.Event, restores: dict, fetches: dict, in_place: bool, leases,
               threads_back: Callable[[], None]) -> None:
    """What a stream dropped unclosed still holds, ended on its reader's reaper thread once it is garbage (see
    :meth:`ReadContext.track <gputq.client.read_context.ReadContext.track>`): its leases, its threads."""
    _wind_down(closed, [*restores.values(), *fetches.values()], list(fetches.values()) if in_place else (),
               leases, threads_back)


@dataclass
class MicroBatch:
    """One restored micro-batch of a rank's shard (views of buffers the stream reuses).

    Attributes
    ----------
    index:
        Position in the micro-batch split.
    samples:
        The shard positions of its samples.
    layers:
        The stored layers of :attr:`routed_experts`, in order.
    routed_experts:
        One int32 ``[tokens, topk]`` array per layer of :attr:`layers`
        (numpy, or CUDA torch tensors with ``device="cuda"``): the list
        ``RouterReplay.set_replay_data`` takes for the rank's stage. Empty
        when the shard has no R3.
    fields:
        Per restored name (``rollout_routed_experts``, ``rollout_log_probs``):
        the layer-major ``[layers, tokens, ...]`` array, or for row-after-row
        fields a list of per-sample arrays (CP-cut).
    """

    index: int
    samples: tuple
    layers: tuple
    routed_experts: list
    fields: dict
    _stream: "MicroBatchStream | None" = field(default=None, repr=False, compare=False)

    @property
    def log_probs(self) -> list:
        """``rollout_log_probs`` per sample, cut for the rank's CP chunks (empty if not offloaded)."""
        return self.fields.get(sample_key_of("logprobs"), [])

    def release(self) -> None:
        """Hand the micro-batch's buffers back to the stream, or to its reader once the stream ended (its
        tensors are then invalid), and, with the stream's ``release`` partition, drop its references (on
        the stream's release thread while it is open, which ``close()`` waits for; at once after).
        Idempotent.

        A stream made with ``hold=True`` releases nothing itself: call this
        once the micro-batch's last use (its backward) is done.
        """
        if self._stream is not None:
            self._stream._finish(self)


class MicroBatchStream:
    """The iterator :meth:`Reader.stream` returns; also a context manager (``close`` stops prefetching).

    A fetch thread reads micro-batches ahead, in order; iterating yields them
    restored, and by default each is released when the next is asked for.
    How the bytes move decides the rest (the ways: :mod:`gputq.client.fetch_ways`
    and, over shm, :mod:`gputq.client.lease_window`; the buffers each way holds:
    :mod:`gputq.client.stream_buffers`): on the host a restore thread widens
    the next micro-batch while the current one trains; read where they lie
    in same-host arenas (shm) micro-batches need no compact buffer; on the
    host over tcp the fetch thread widens each micro-batch as its replies
    land, reading one pipeline per unit (:class:`~gputq.transport.tcp_pipeline.ReadPipeline`).
    With ``hold=True`` the consumer releases each micro-batch itself
    (:meth:`MicroBatch.release`, after its backward in a pipeline schedule
    that runs several forwards first). :meth:`replay_handles` gives slime's
    lazy handles instead of iteration.

    Close it (or use it as a context manager). A stream dropped unclosed (a
    step that raised out of the loop) holds up no other stream: its fetch
    and restore threads are its own until it closes. Once it is garbage its
    leases end and its threads go back; until then what it leased stays
    pinned, at most the units' lease timeout.
    """

    def __init__(self, context: ReadContext, plans: list, prefetch: int, rank: ParallelSlice, *,
                 hold: bool = False, release: Callable[[list, list], dict] | None = None):
        self._ctx, self._plans, self._depth = context, plans, prefetch
        self._rank, self._hold = rank, hold
        units = sorted({unit for plan in plans for unit in plan.units})
        packed = any(fp.packing for plan in plans for fp in plan.fields.values())
        self._in_place, self._landing, self._ahead = choose_ways(context, units, prefetch, hold, packed)
        self._fetches: dict[int, Future] = {}  # index -> its fetch; below, its restore on the restore thread
        self._restores: dict[int, Future] = {}
        # In place: the last placement of windows ahead queued behind a fetch. Those before it ran before a
        # fetch queued after them, which close() waits for, so it is the only one close() must wait for itself.
        self._placing: Future | None = None
        threads = context.stream_threads()
        self._fetcher, restorer, releaser = threads
        self._threads_back = functools.partial(context.threads_back, threads)
        self._live: dict[int, tuple] = {}  # index -> (micro-batch, its output buffers)
        self._lazy: LazyReplay | None = None  # slime's replay handles, once taken
        # Set once closed, and polled by the work under way, which must not refer to the stream (see
        # gputq.client.restores).
        self._lock, self._closed = threading.RLock(), threading.Event()
        # Taken to queue work and to close: nothing is queued once close() has listed what to wait for.
        self._queue_lock = threading.Lock()
        self._cut_short = False  # closed by the Reader's close() before the last micro-batch was consumed
        self._failed: BaseException | None = None  # what a micro-batch raised: the stream ended there
        self._next = self._submitted = 0  # the next micro-batch to consume, and to queue a fetch for
        #: The micro-batches whose release was issued, in order (with ``release``).
        self.released: list[int] = []
        self._releases = None if release is None else \
            StreamReleases(release, [plan.layouts for plan in plans], releaser)
        #: Micro-batch index -> {unit: reason} for the units its release did not reach (lost); complete once closed.
        self.unreleased: dict[int, dict] = {} if self._releases is None else self._releases.unreleased
        self._buffers = StreamBuffers(context, plans, prefetch, units, landing=self._landing, in_place=self._in_place,
                                      ahead=self._ahead, closed=self._closed.is_set)
        #: Bytes of the buffers the stream holds (more only while ``hold`` keeps micro-batches live).
        self.buffer_bytes = self._buffers.nbytes
        shaper = SlimeShaper(context, rank, WidenShares(context.config.restore_threads))
        self._restorer = Restores(shaper, self._buffers, restorer)
        closed = self._closed.is_set
        if self._landing:
            self._way = LandingFetch(context, plans, self._buffers, shaper.shape, lambda: self._submitted, closed)
        elif self._in_place:
            self._way = LeaseWindows(context, plans)
        else:
            self._way = StagedFetch(context, plans, self._buffers, units, closed)
        # A landing way holds no lease (and refers to the stream: its fetches keep it alive, bounded by the
        # read timeout).
        self._reaped = context.track(self, functools.partial(_leftovers, self._closed, self._restores, self._fetches,
                                                             self._in_place, None if self._landing else self._way,
                                                             self._threads_back))
        self._submit_until(prefetch)

    @property
    def output_bytes(self) -> int:
        """Bytes of one micro-batch's output buffers (sized for the largest)."""
        return self._buffers.output_bytes

    @property
    def slice_bytes(self) -> int:
        """Bytes the stream's reads name: exactly what its micro-batches move out of the units."""
        return sum(plan.slice_bytes for plan in self._plans)

    # -- background stages -------------------------------------------------------------
    def _submit_until(self, count: int) -> None:
        """Queue the fetches of the micro-batches before position ``count`` that are not queued yet."""
        with self._queue_lock:
            while not self._closed.is_set() and self._submitted < min(count, len(self._plans)):
                self._submit()

    def _submit(self) -> None:
        plan = self._plans[self._submitted]
        fetch = self._fetches[plan.index] = Future()
        if self._ahead:
            restore = self._restores[plan.index] = Future()
            self._restorer.ahead(plan, fetch, restore)
        try:
            self._fetcher.submit(run_into, fetch, self._way, plan)
            if self._in_place:
                self._placing = self._fetcher.submit(self._way.place_ahead, plan)
        except BaseException as exc:  # its threads are shut down
            if fetch.set_running_or_notify_cancel():
                fetch.set_exception(exc)
            raise
        self._submitted += 1

    # -- consuming ---------------------------------------------------------------------
    def __iter__(self) -> Iterator[MicroBatch]:
        return self

    def __next__(self) -> MicroBatch:
        if self._lazy is not None:
            raise InvalidInputError("a stream whose replay_handles were taken is not iterated")
        with self._lock:
            if self._closed.is_set():
                unread = _unread(self._cut_short, self._failed, self._next, len(self._plans))
                if unread is not None:  # never the end: the rest was not read
                    raise unread
                raise StopIteration
            if self._next > 0 and not self._hold:  # the consumer moved past the last one
                last = self._live.get(self._next - 1)
                if last is not None:
                    self._finish(last[0])
            if self._next >= len(self._plans):
                self.close()
                raise StopIteration
            return self._advance()

    def _advance(self) -> MicroBatch:
        """Restore the next micro-batch (or take the one restored ahead); it is live until released."""
        plan = self._plans[self._next]
        if self._landing and not self._hold and self._lazy is None:
            # The consumer holds no micro-batch now, so one more may land in the buffer it gave back
            # while it waits: its wake-up can lag the landing by milliseconds on a busy host.
            self._submit_until(self._next + self._depth + 1)
        try:
            if self._ahead:
                shaped, outputs = self._restores.pop(plan.index).result()
                self._fetches.pop(plan.index)
            elif self._landing:
                shaped, outputs = self._fetches.pop(plan.index).result()
            else:
                shaped, outputs = self._restorer.restore(plan, self._fetches.pop(plan.index).result(),
                                                         self._buffers.spare_outputs())
        except BaseException as exc:
            self.close()
            if self._cut_short or isinstance(exc, CancelledError):  # closed from another thread meanwhile
                raise ClosedError(f"the {'Reader' if self._cut_short else 'stream'} was closed while micro-batch "
                                  f"{plan.index} was awaited") from exc
            self._failed = exc  # a failure of its own, not a close
            raise
        batch = MicroBatch(plan.index, plan.samples, *shaped, self)
        self._live[plan.index] = (batch, outputs)
        self._next += 1
        self._submit_until(self._next + self._depth)
        return batch

    def _finish(self, batch: MicroBatch) -> None:
        with self._lock:
            live = self._live.pop(batch.index, None)
            if live is None:
                return
            self._buffers.give_back(live[1])
            if self._releases is None:  # else released once: the micro-batch was live
                return
            self.released.append(batch.index)
            with self._queue_lock:
                if not self._closed.is_set():  # close() waits for it
                    self._releases.hand_over(batch.index)
                    return
        self._releases.now(batch.index)  # a held micro-batch released after the stream closed

    def replay_handles(self, release_after: str = "backward") -> list[list[LayerRef]]:
        """Per micro-batch, one lazy handle per layer, for slime's ``RoutingReplay.record``.

        Record them all up front (as slime's ``fill_routing_replay`` does);
        each micro-batch is then restored at its first layer's replay and
        released after its last for ``release_after`` (``"backward"``, or
        ``"forward"`` for a forward-only pass); see :mod:`gputq.client.replay`.
        """
        replay = LazyReplay(release_after, self._lock, lambda index: self._live.get(index, (None,))[0],
                            self._advance_to, self._finish)
        with self._lock:
            if self._next or self._lazy is not None:
                raise InvalidInputError("replay_handles are taken once, before any micro-batch is consumed")
            self._lazy = replay
        layers = [next((len(fp.layers) for fp in plan.fields.values() if fp.layers), 0) for plan in self._plans]
        return replay.handles([(plan.index, count) for plan, count in zip(self._plans, layers)])

    def _advance_to(self, index: int) -> MicroBatch:
        """Restore micro-batch ``index`` for a replay handle: the next in order, else a typed error."""
        if self._closed.is_set():
            raise _unread(self._cut_short, self._failed, self._next, len(self._plans)) or \
                ClosedError("the stream was closed")
        if index != self._next:
            state = "was released" if index < self._next else f"comes after micro-batch {self._next}"
            raise InvalidInputError(f"micro-batch {index} {state}: micro-batches are replayed in order")
        return self._advance()

    def close(self) -> None:
        """Stop prefetching and wait for the work in flight. Idempotent; the buffers go back to the reader, but
        those of micro-batches the consumer still holds (``hold``), each once released.

        The Reader's close() closes its streams first: a consumer then asking
        for a micro-batch not yet consumed gets ``ClosedError``, not the end.
        """
        if self._closed.is_set():
            return
        if self._lazy is not None:
            self._lazy.close()  # the micro-batch replayed last was consumed: its references go
        with self._queue_lock:
            if self._closed.is_set():
                return
            self._closed.set()
            self._reaped.detach()
            self._cut_short = self._ctx.closed and self._next < len(self._plans)
            pending = [*self._restores.values(), *self._fetches.values(), *filter(None, [self._placing])]
        if self._releases is not None:
            self._releases.wait()
        _wind_down(self._closed, pending, list(self._fetches.values()) if self._in_place else (), self._way,
                   self._threads_back)
        self._fetches.clear()
        self._restores.clear()
        with self._lock:  # what the consumer still holds stays its own until released
            self._buffers.close([outputs for _, outputs in self._live.values()])

    def __enter__(self) -> "MicroBatchStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
