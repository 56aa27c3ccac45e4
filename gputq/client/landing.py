"""Widening a micro-batch's bytes as they land: a tcp read's chunks scattered straight into the outputs.

A host restore over tcp that lands a micro-batch's compact bytes in a
staging buffer and widens them afterwards (on a second thread, while the
next micro-batch arrives) passes over memory three times: the receive
writes the compact bytes out, the widen reads them back and writes the
int32. Handing each chunk of the reply to a :class:`LandingWidener` as it
is received (:meth:`ReadPipeline.receive <gputq.transport.tcp_pipeline.ReadPipeline.receive>`,
through :func:`land_replies`) lands it in a buffer that stays in the CPU's
caches and widens it from there: the compact bytes never reach memory,
and while the receiving thread widens, the unit's next bytes queue in the
socket buffers. No second thread, no hand-off between threads.

The chunk is at most :data:`LANDING_CHUNK_BYTES`: larger, a chunk and its
widened int32 (twice its bytes) no longer stay in the core's cache (a
core's L2) while it is widened, and the widen starts
later after each chunk's first byte; smaller, the receiving thread spends
more on the Python and system calls of each chunk, and it is the busiest
thread of a host restore over tcp. A chunk also ends where a run of the
plan of at least a quarter chunk ends (the receive's ``breaks``): a run
(a layer's tokens of one sample) then never shares a chunk with the next
one, and each chunk of it is widened in one copy.
"""

from __future__ import annotations

from bisect import bisect_left

import numpy as np

from gputq.client.plan import MicroPlan
from gputq.client.plan_fields import FieldPlan
from gputq.kernels import widen_scatter

__all__ = ["LANDING_CHUNK_BYTES", "LandingWidener", "land_replies"]

#: Bytes received at a time, at most, before they are widened: small enough to stay in a core's L2 cache.
LANDING_CHUNK_BYTES = 128 << 10

#: Runs at least this long end a chunk where they end (shorter ones share chunks).
_BREAK_RUN_BYTES = LANDING_CHUNK_BYTES // 4


class LandingWidener:
    """Where every compact byte of one micro-batch goes, as sinks for its chunked reads.

    Parameters
    ----------
    fields
        ``(plan, out)`` per field: its :class:`FieldPlan` (source rows
        index the micro-batch's staging bytes from byte 0, in the field's
        stored dtype and width) and its flat output (the restored dtype).
    reads
        ``(start, stop)`` of each read's payload in those staging bytes:
        a sink is made per read, and no plan row is widened across two.
    """

    def __init__(self, fields: list[tuple[FieldPlan, np.ndarray]], reads: list[tuple[int, int]]):
        entries = []
        self._fills = []
        for fp, out in fields:
            row_bytes = fp.width * fp.stored.itemsize
            data = fp.plan[fp.plan[:, 0] >= 0]
            starts = (data[:, 0] * row_bytes).tolist()
            stops = ((data[:, 0] + data[:, 2]) * row_bytes).tolist()
            targets = (data[:, 1] * fp.width).tolist()
            entries.extend((a, b, out, d, fp.stored, fp.stored.itemsize) for a, b, d in zip(starts, stops, targets))
            fills = fp.plan[fp.plan[:, 0] < 0]
            if len(fills):
                self._fills.append((fp, out, fills))
        entries.sort(key=lambda entry: entry[0])
        firsts = [entry[0] for entry in entries]
        self._reads = {(start, stop): _merged(entries[bisect_left(firsts, start):bisect_left(firsts, stop)])
                       for start, stop in reads}

    def fill(self) -> None:
        """Write the fill rows (rows no stored byte covers)."""
        for fp, out, plan in self._fills:
            widen_scatter(np.empty(0, fp.stored), plan, fp.width, out, fill=fp.fill, validate=False)

    def sink(self, start: int, stop: int) -> "_RequestSink":
        """The sink of the read whose payload lands at staging bytes ``[start, stop)`` (one of ``reads``); its
        ``breaks`` are where the receive should end a chunk."""
        return _RequestSink(start, self._reads[(start, stop)])


def _merged(entries: list) -> list:
    """Plan rows whose bytes follow each other both where they land and where they go, as one.

    A rank's CP chunks of one layer land back to back and fill adjacent
    tokens of the layer's output: merged, a chunk of the reply widens in
    one or two copies instead of one per plan row.
    """
    out: list = []
    for entry in entries:
        if out:
            start, stop, dest, target, dtype, item = out[-1]
            if entry[0] == stop and entry[2] is dest and entry[3] == target + (stop - start) // item:
                out[-1] = (start, entry[1], dest, target, dtype, item)
                continue
        out.append(entry)
    return out


class _RequestSink:
    """``sink(offset, chunk)`` of one read: the chunk's bytes widened into each plan row they belong to.

    Chunks come in payload order; a plan row's bytes may span several chunks
    and a chunk several plan rows (kept in ``_active`` until their last byte).
    """

    __slots__ = ("_base", "_entries", "_next", "_active", "breaks")

    def __init__(self, base: int, entries: list):
        self._base, self._entries, self._next, self._active = base, entries, 0, []
        #: Payload offsets where a long run ends (on 16 bytes, as the receive asks), increasing.
        self.breaks = [stop - base for start, stop, *_ in entries
                       if stop - start >= _BREAK_RUN_BYTES and (stop - base) % 16 == 0]

    def __call__(self, offset: int, chunk: np.ndarray) -> None:
        lo = self._base + offset
        hi = lo + chunk.nbytes
        entries, i, active = self._entries, self._next, self._active
        while i < len(entries) and entries[i][0] < hi:
            active.append(entries[i])
            i += 1
        self._next = i
        kept = []
        for entry in active:
            start, stop, out, target, dtype, item = entry
            a, b = max(start, lo), min(stop, hi)
            if a < b:
                at = target + (a - start) // item
                np.copyto(out[at:at + (b - a) // item], chunk[a - lo:b - lo].view(dtype))
            if stop > hi:
                kept.append(entry)
        self._active = kept


def land_replies(plan: MicroPlan, outputs: dict, pipe_of, timeout: float | None) -> None:
    """Receive the replies to a micro-batch's reads, already sent, widening each chunk into ``outputs`` as it lands.

    Parameters
    ----------
    plan
        The micro-batch, finished (:meth:`MicroPlan.finish`).
    outputs
        Per field name, a flat output of the restored dtype holding at least
        the field's ``out_elements``; its fill rows are written too.
    pipe_of
        ``pipe_of(unit)``: the read pipeline the unit's reads were sent on,
        each of its requests in request order.
    timeout
        Seconds each reply may take (the read timeout).
    """
    widener = LandingWidener([(fp, outputs[name][:fp.out_elements]) for name, fp in plan.fields.items()],
                             [(r.start, r.stop) for r in plan.requests])
    widener.fill()
    for r in plan.requests:
        sink = widener.sink(r.start, r.stop)
        r.check_lengths(pipe_of(r.unit).receive(sink, timeout, keys=r.keys, chunk_bytes=LANDING_CHUNK_BYTES,
                                                breaks=sink.breaks))
