"""Micro-batches streamed to one trainer rank: only its slice, prefetched compact, widened when consumed.

:meth:`Reader.stream <gputq.client.reader.Reader.stream>` takes a rank's
data-parallel shard, the trainer's own micro-batch split and the rank's
:class:`~gputq.data.slices.ParallelSlice`, and yields one
:class:`MicroBatch` at a time, in order:

- every read names spans: only the rank's layers and token chunks leave
  the units (see :mod:`gputq.transport.spans`), one request per unit and
  field, a step shared by several samples of a micro-batch read once;
- the next ``prefetch`` micro-batches are fetched in the background, into
  compact buffers (``prefetch`` of them, reused);
- the micro-batch being consumed is widened to int32 in one output buffer
  per field, reused: its tensors are valid until the next one is requested;
- with ``release``, a micro-batch's references are dropped once the
  consumer moves past it, so a step whose last use has trained is freed
  while the rest of the shard trains;
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

import contextlib
import math
import queue
import threading
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Sequence

import numpy as np

from gputq.data.fields import sample_key_of
from gputq.data.refs import FieldRef, Layout, uses_by_unit
from gputq.data.slices import ParallelSlice, blob_spans, expert_pieces, layer_major, logprob_ranges, pad_block
from gputq.errors import ClosedError, InvalidInputError, LayoutError, TransferError
from gputq.kernels import widen_scatter
from gputq.transport.spans import MAX_SPANS

__all__ = ["MicroBatch", "LayerRef", "MicroBatchStream", "plan_stream"]

#: Keys per span request (as whole-key reads).
_REQUEST_KEYS = 4096


@dataclass
class _Request:
    """One read: ``spans`` of ``keys`` of ``unit`` land back to back in staging bytes [start, stop)."""

    unit: str
    incarnation: str
    start: int
    stop: int = 0
    keys: list = field(default_factory=list)
    generations: list = field(default_factory=list)
    spans: list = field(default_factory=list)  # (key index, offset, nbytes)


@dataclass
class _FieldPlan:
    """How one field of one micro-batch is restored from its staging bytes."""

    name: str
    stored: np.dtype
    restored: np.dtype
    width: int  # elements per plan row
    plan: np.ndarray
    fill: float | int
    out_elements: int
    layers: tuple  # stored layers, layer-major fields only
    stored_layers: int = 0
    tokens: int = 0  # rows per layer (layer-major) or in all
    pads: list = field(default_factory=list)  # (token offset, first pad row, stop)
    data: list = field(default_factory=list)  # (token offset, rows): stored rows, for the empty-layer check
    sample_rows: list = field(default_factory=list)  # per sample (offset, rows), token-major fields


@dataclass
class _MicroPlan:
    index: int
    samples: tuple
    requests: list
    nbytes: int
    fields: dict
    layouts: list  # the samples' layouts, for release


def _cut_layout(layout: Layout, start: int, stop: int) -> tuple[list, list]:
    """Target rows ``[start, stop)`` of ``layout``: its pieces ``(ref, source row, row, rows)`` and fill gaps,
    rows counted from ``start``. (``Layout.slice`` without building a checked layout: plans cut thousands.)"""
    pieces, gaps, cursor = [], [], start
    for f in layout.fragments:  # sorted by target row, never overlapping
        lo, hi = max(f.dst_row, start), min(f.dst_row + f.rows, stop)
        if lo >= hi:
            if f.dst_row >= stop:
                break
            continue
        if lo > cursor:
            gaps.append((cursor - start, lo - cursor))
        pieces.append((f.ref, f.src_row + lo - f.dst_row, lo - start, hi - lo))
        cursor = hi
    if cursor < stop:
        gaps.append((cursor - start, stop - cursor))
    return pieces, gaps


class _Needs:
    """The stored rows a micro-batch reads of each key of one field, merged, then placed in staging."""

    def __init__(self):
        self.rows: dict[tuple[str, str], list] = {}  # (unit, key) -> [[start, stop], ...]
        self.refs: dict[tuple[str, str], FieldRef] = {}

    def add(self, ref: FieldRef, start: int, stop: int) -> None:
        key = (ref.unit, ref.key)
        self.refs.setdefault(key, ref)
        self.rows.setdefault(key, []).append([start, stop])

    def merged(self) -> dict:
        out = {}
        for key, intervals in self.rows.items():
            intervals.sort()
            runs = [list(intervals[0])]
            for a, b in intervals[1:]:
                if a <= runs[-1][1]:
                    runs[-1][1] = max(runs[-1][1], b)
                else:
                    runs.append([a, b])
            out[key] = runs
        return out


def _place(fields: list, requests: list, max_bytes: int | None) -> tuple[list, int]:
    """Lay a micro-batch's merged rows out in staging, as span requests: one per unit when rows align.

    ``fields`` holds each field's :class:`_Needs` and layers, widest rows
    first. Unit by unit, the unit's fields back to back, so one request
    per unit usually covers them all; a request starts anew where a field's
    rows need padding to start whole (plan rows index each field's compact
    view from byte 0), at a change of the unit's incarnation, and past
    :data:`_REQUEST_KEYS`, :data:`MAX_SPANS` or ``max_bytes``.

    Returns, per field, ``{(unit, key): [(start, stop, plan row of row start
    in the first layer)]}`` (a run's layers follow each other, ``stop -
    start`` rows apart: spans go layer after layer, merged or not), and
    the staging size.
    """
    placed: list[dict] = [{} for _ in fields]
    by_unit: dict[tuple[str, str], list] = {}
    for f, (needs, layers) in enumerate(fields):
        for (unit, key), runs in sorted(needs.merged().items()):
            ref = needs.refs[(unit, key)]
            by_unit.setdefault((unit, ref.incarnation), []).append((f, key, ref, runs, layers))
    cursor = 0
    for (unit, incarnation), entries in sorted(by_unit.items()):
        current = None
        for f, key, ref, runs, layers in entries:
            item = np.dtype(ref.dtype).itemsize
            major = layer_major(ref.row_shape)
            row_bytes = (math.prod(ref.row_shape[1:]) if major else max(1, math.prod(ref.row_shape))) * item
            align = row_bytes * 16 // math.gcd(row_bytes, 16)
            spans_of_key = [(start, stop, offset, nbytes) for start, stop in runs
                            for offset, nbytes in blob_spans(ref.rows, ref.row_shape, item, start, stop,
                                                             layers if major else None)]
            nbytes_key = sum(span[3] for span in spans_of_key)
            if current is None or cursor % row_bytes or len(current.keys) >= _REQUEST_KEYS \
                    or len(current.spans) + len(spans_of_key) > MAX_SPANS \
                    or (max_bytes is not None and current.keys and cursor + nbytes_key - current.start > max_bytes):
                cursor = -(-cursor // align) * align
                current = _Request(unit, incarnation, cursor, cursor)
                requests.append(current)
            index = len(current.keys)
            current.keys.append(key)
            current.generations.append(ref.generation)
            first_rows = {}
            for start, stop, offset, nbytes in spans_of_key:
                current.spans.append((index, offset, nbytes))
                first_rows.setdefault(start, cursor // row_bytes)
                cursor += nbytes
            current.stop = cursor
            placed[f][(unit, key)] = [(start, stop, first_rows[start]) for start, stop in runs]
    return placed, cursor


def _source_row(placed: dict, ref: FieldRef, row: int) -> tuple[int, int]:
    """The plan row of stored ``row`` of ``ref`` in the first layer read, and the rows between layers."""
    for start, stop, first in placed[(ref.unit, ref.key)]:
        if start <= row < stop:
            return first + row - start, stop - start
    raise AssertionError("a fragment outside the rows placed for it")  # _Needs holds every fragment's rows


def _field_spec(name: str, layouts: Sequence[Layout]) -> tuple[np.dtype, tuple, np.dtype, float | int]:
    specs = {(f.ref.dtype, f.ref.row_shape) for layout in layouts for f in layout.fragments}
    if len(specs) > 1:
        raise LayoutError(f"field {name!r} mixes stored dtypes/row shapes in one micro-batch: {sorted(specs)}")
    fills = {layout.fill for layout in layouts}
    if len(fills) > 1:
        raise LayoutError(f"field {name!r} has several fill values in one micro-batch: {fills}")
    stored, row_shape = specs.pop() if specs else (layouts[0].dtype, layouts[0].row_shape)
    return np.dtype(stored), tuple(row_shape), np.dtype(layouts[0].dtype), fills.pop()


def _expert_field(name: str, layouts: list, positions: list, rank: ParallelSlice, ranges, needs: _Needs):
    """The plan of a layer-major field: layer-major output ``[layers, tokens, ...]``, slime's pads."""
    stored, row_shape, restored, fill = _field_spec(name, layouts)
    where = f"field {name!r} of samples {positions[0]}..{positions[-1]}"
    layers = rank.layer_indices(row_shape[0], where)
    if ranges is None:
        pieces = expert_pieces([layout.rows for layout in layouts], rank)
    else:
        pieces = [(i, a, b) for i, sample_ranges in enumerate(ranges) for a, b in sample_ranges]
    pads = [p for p in pieces if p[0] < 0]
    if pads and rank.num_experts is None:
        raise InvalidInputError(f"{where}: slime's pad rows need ParallelSlice.num_experts")
    tokens = sum(b - a for _, a, b in pieces)
    width = math.prod(row_shape[1:])
    fp = _FieldPlan(name, stored, restored, width, np.zeros((0, 3), np.int64), fill, len(layers) * tokens * width,
                    layers, row_shape[0], tokens)
    frags, gaps = [], []
    offset = 0
    for sample, a, b in pieces:
        if sample < 0:
            fp.pads.append((offset, a, b))
        else:
            pieces, holes = _cut_layout(layouts[sample], a, b)
            for ref, src, dst, rows in pieces:
                needs.add(ref, src, src + rows)
                frags.append((ref, src, offset + dst, rows))
            gaps.extend((offset + g, n) for g, n in holes)
            fp.data.append((offset, b - a))
        offset += b - a
    return fp, frags, gaps


def _token_field(name: str, layouts: list, positions: list, rank: ParallelSlice, totals, needs: _Needs):
    """The plan of a row-after-row field (logprobs): each sample's CP-kept rows, back to back."""
    stored, row_shape, restored, fill = _field_spec(name, layouts)
    width = max(1, math.prod(row_shape))
    frags, gaps, offset = [], [], 0
    fp = _FieldPlan(name, stored, restored, width, np.zeros((0, 3), np.int64), fill, 0, (), 0)
    for i, layout in enumerate(layouts):
        if rank.cp_size > 1:
            if totals is None or totals[i] is None:
                raise InvalidInputError(f"sample {positions[i]}: cutting field {name!r} for CP needs the sample's "
                                        f"total length (R3 rows + 1, or total_lengths)")
            if not 0 <= layout.rows <= totals[i]:
                raise InvalidInputError(f"sample {positions[i]}: field {name!r} has {layout.rows} rows, more than "
                                        f"its {totals[i]} tokens")
            ranges = logprob_ranges(totals[i], layout.rows, rank.cp_rank, rank.cp_size)
        else:
            ranges = [(0, layout.rows)]
        first = offset
        for a, b in ranges:
            pieces, holes = _cut_layout(layout, a, b)
            for ref, src, dst, rows in pieces:
                needs.add(ref, src, src + rows)
                frags.append((ref, src, offset + dst, rows))
            gaps.extend((offset + g, n) for g, n in holes)
            offset += b - a
        fp.sample_rows.append((first, offset - first))
    fp.tokens = offset
    fp.out_elements = offset * width
    return fp, frags, gaps


def plan_stream(shard: Sequence[Mapping[str, Layout]], micro_batches: Sequence[Sequence[int]], rank: ParallelSlice,
                *, total_lengths: Sequence[int] | None = None, token_ranges=None, fields=None,
                max_bytes: int | None = None) -> list[_MicroPlan]:
    """Check a stream's arguments and plan every micro-batch; raises ``InvalidInputError`` naming the sample."""
    if not isinstance(rank, ParallelSlice):
        raise InvalidInputError(f"rank must be a ParallelSlice, got {type(rank).__name__}")
    seen: dict[int, int] = {}
    batches = []
    for m, batch in enumerate(micro_batches):
        batch = list(batch)
        if not batch:
            raise InvalidInputError(f"micro-batch {m} is empty")
        for i in batch:
            if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)) or not 0 <= i < len(shard):
                raise InvalidInputError(f"micro-batch {m} names sample {i!r}; the shard has {len(shard)} samples")
            if int(i) in seen:
                raise InvalidInputError(f"sample {i} is in micro-batches {seen[int(i)]} and {m}: micro-batches must "
                                        f"partition the shard")
            seen[int(i)] = m
        batches.append([int(i) for i in batch])
    missing = sorted(set(range(len(shard))) - set(seen))
    if missing:
        raise InvalidInputError(f"samples {missing[:8]} are in no micro-batch: micro-batches must partition the shard")
    if total_lengths is not None and len(total_lengths) != len(shard):
        raise InvalidInputError(f"{len(total_lengths)} total lengths for {len(shard)} samples")
    if token_ranges is not None and len(token_ranges) != len(shard):
        raise InvalidInputError(f"{len(token_ranges)} token range lists for {len(shard)} samples")
    plans = []
    for m, batch in enumerate(batches):
        names = sorted({name for i in batch for name in shard[i]} if fields is None else set(fields))
        requests: list[_Request] = []
        planned = {}
        work = []
        totals = [None] * len(batch)
        for name in names:
            if any(name not in shard[i] for i in batch):
                raise LayoutError(f"field {name!r} is missing from some samples of micro-batch {m}")
        for j, i in enumerate(batch):
            expert_rows = [shard[i][n].rows for n in names if layer_major(shard[i][n].row_shape)]
            if total_lengths is not None:
                totals[j] = int(total_lengths[i])
                if expert_rows and expert_rows[0] != totals[j] - 1:
                    raise InvalidInputError(f"sample {i}: R3 has {expert_rows[0]} rows, expected len(tokens) - 1 = "
                                            f"{totals[j] - 1}")
            elif expert_rows:
                totals[j] = expert_rows[0] + 1
        # Widest rows first: a narrower field's requests then rarely need padding to start aligned.
        for name in sorted(names, key=lambda n: -len(shard[batch[0]][n].row_shape)):
            layouts = [shard[i][name] for i in batch]
            needs = _Needs()
            if layer_major(layouts[0].row_shape):
                ranges = None
                if token_ranges is not None:
                    ranges = [_checked_ranges(token_ranges[i], shard[i][name].rows, i) for i in batch]
                fp, frags, gaps = _expert_field(name, layouts, batch, rank, ranges, needs)
            else:
                fp, frags, gaps = _token_field(name, layouts, batch, rank, totals, needs)
            work.append((fp, frags, gaps, needs))
            planned[name] = fp
        placed, cursor = _place([(needs, fp.layers) for fp, _, _, needs in work], requests, max_bytes)
        for (fp, frags, gaps, _), where in zip(work, placed):
            fp.plan = _kernel_plan(fp, frags, gaps, where)
        plans.append(_MicroPlan(m, tuple(batch), requests, -(-cursor // 16) * 16, planned, [shard[i] for i in batch]))
    return plans


def _checked_ranges(ranges, rows: int, sample: int) -> list:
    out = []
    for r in ranges:
        a, b = (int(v) for v in r)
        if not 0 <= a < b <= rows:
            raise InvalidInputError(f"sample {sample}: token range [{a}, {b}) is outside its {rows} rows")
        out.append((a, b))
    return out


def _kernel_plan(fp: _FieldPlan, frags: list, gaps: list, placed: dict) -> np.ndarray:
    """The widen plan of a field: every fragment and gap once per layer read (layer-major output)."""
    per_layer = np.empty((len(frags) + len(gaps), 4), dtype=np.int64)  # src, src step per layer, dst, rows
    for i, (ref, src, dst, n) in enumerate(frags):
        per_layer[i] = (*_source_row(placed, ref, src), dst, n)
    for i, (g, n) in enumerate(gaps, len(frags)):
        per_layer[i] = (-1, 0, g, n)
    layers = np.arange(max(1, len(fp.layers)), dtype=np.int64)[:, None]
    plan = np.empty((len(layers), len(per_layer), 3), dtype=np.int64)
    fill = per_layer[:, 0] < 0
    plan[:, :, 0] = np.where(fill, -1, per_layer[:, 0] + layers * per_layer[:, 1])
    plan[:, :, 1] = per_layer[:, 2] + layers * fp.tokens
    plan[:, :, 2] = per_layer[:, 3]
    return plan.reshape(-1, 3)


class LayerRef:
    """One layer of one micro-batch for slime's ``RoutingReplay.record``, restored when first replayed.

    From :meth:`MicroBatchStream.replay_handles`. Materialising the first
    layer of a micro-batch widens the whole micro-batch (its compact bytes
    were prefetched in order); once every layer was materialised for the
    stream's ``release_after`` direction, the micro-batch is released.
    """

    def __init__(self, stream: "MicroBatchStream", index: int, position: int):
        self._stream, self.index, self.position = stream, index, position

    def materialize_for_routing_replay(self, direction: str):
        """The layer's int32 ``[tokens, topk]`` tensor for the ``"forward"`` or ``"backward"`` replay."""
        if direction not in ("forward", "backward"):
            raise InvalidInputError(f"direction must be 'forward' or 'backward', got {direction!r}")
        return self._stream._materialize(self.index, self.position, direction)


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
        """Hand the micro-batch's buffers back to the stream (its tensors are then invalid) and, with
        the stream's ``release`` partition, drop its references. Idempotent.

        A stream made with ``hold=True`` releases nothing itself: call this
        once the micro-batch's last use (its backward) is done.
        """
        if self._stream is not None:
            self._stream._finish(self)


class MicroBatchStream:
    """The iterator :meth:`Reader.stream` returns; also a context manager (``close`` stops prefetching).

    A fetch thread reads micro-batches ahead, in order, into ``prefetch``
    compact buffers. Iterating yields them restored; by default each is
    released when the next is asked for, so one output buffer is reused.
    On the host (``device="cpu"``, prefetch >= 2) a restore thread also
    widens the next micro-batch while the current one trains, into a second
    output buffer, since there the widen is CPU work that would otherwise
    add to every step; it then keeps ``prefetch - 1`` compact buffers.
    Either way the stream holds at most ``prefetch + 1`` micro-batch slices.

    With ``hold=True`` the consumer releases each micro-batch itself
    (:meth:`MicroBatch.release`, after its backward in a pipeline schedule
    that runs several forwards first): live micro-batches then each hold an
    output buffer. :meth:`replay_handles` gives slime's lazy handles instead
    of iteration.
    """

    def __init__(self, reader, plans: list, prefetch: int, release: str | None, rank: ParallelSlice, *,
                 hold: bool = False):
        self._reader, self._plans, self._depth, self._release = reader, plans, prefetch, release
        self._rank, self._hold = rank, hold
        self._ahead = reader._device == "cpu" and prefetch >= 2 and not hold
        self._compact: queue.Queue = queue.Queue()
        self._outputs: queue.Queue = queue.Queue()
        self._fetches: dict[int, Future] = {}
        self._restores: dict[int, Future] = {}
        self._fetcher, self._restorer = reader._stream_threads()
        self._live: dict[int, tuple] = {}  # index -> (micro-batch, its output buffers)
        self._uses: dict[int, int] = {}
        self._lazy: str | None = None
        self._retiring: MicroBatch | None = None  # consumed for good; its buffers go at the next call
        self._lock = threading.RLock()
        self._next = 0
        self._submitted = 0
        self._closed = False
        self.released: list[int] = []
        self._largest: dict[str, tuple[int, np.dtype]] = {}
        for p in plans:
            for fp in p.fields.values():
                known = self._largest.get(fp.name, (0, fp.restored))[0]
                self._largest[fp.name] = (max(known, fp.out_elements), fp.restored)
        staging = max((p.nbytes for p in plans), default=0)
        self._lent = contextlib.ExitStack()
        compact = min(prefetch - 1 if self._ahead else prefetch, len(plans))
        outputs = 2 if self._ahead else 1
        for _ in range(compact):
            self._compact.put(reader._stream_staging(staging, plans, self._lent))
        for _ in range(outputs):
            self._outputs.put(self._new_outputs())
        #: Bytes of the buffers the stream holds (more only while ``hold`` keeps micro-batches live).
        self.buffer_bytes = compact * staging + outputs * self._output_bytes
        while self._submitted < min(prefetch, len(plans)):
            self._submit()

    @property
    def slice_bytes(self) -> int:
        """Bytes the stream's reads name: exactly what its micro-batches move out of the units."""
        return sum(r.stop - r.start for plan in self._plans for r in plan.requests)

    @property
    def _output_bytes(self) -> int:
        return sum(n * dtype.itemsize for n, dtype in self._largest.values())

    def _new_outputs(self) -> dict:
        """Output buffers sized once for the largest micro-batch, reused after."""
        return {name: self._reader._lend(n * dtype.itemsize, self._lent).view(dtype)
                for name, (n, dtype) in self._largest.items()}

    # -- background stages -------------------------------------------------------------
    def _submit(self) -> None:
        plan = self._plans[self._submitted]
        fetch = self._fetches[plan.index] = self._fetcher.submit(self._fetch, plan)
        if self._ahead:
            self._restores[plan.index] = self._restorer.submit(self._restore_ahead, plan, fetch)
        self._submitted += 1

    def _take(self, pool: queue.Queue):
        """A free buffer of ``pool``; waits while the consumer holds them all, gives up once closed."""
        while True:
            try:
                return pool.get(timeout=0.05)
            except queue.Empty:
                if self._closed:
                    raise ClosedError("the stream was closed") from None

    def _fetch(self, plan: _MicroPlan):
        buffer = self._take(self._compact)
        try:
            staging = buffer[:plan.nbytes]
            per_unit: dict[str, list] = {}
            for r in plan.requests:
                per_unit.setdefault(r.unit, []).append(r)
            groups = list(per_unit.values())
            jobs = [self._reader._pool.submit(self._read_group, group, staging) for group in groups[1:]]
            try:
                if groups:
                    self._read_group(groups[0], staging)
            finally:
                wait(jobs)
            for job in jobs:
                job.result()
        except BaseException:
            self._compact.put(buffer)
            raise
        return buffer

    def _restore_ahead(self, plan: _MicroPlan, fetch: Future):
        buffer = fetch.result()
        try:
            outputs = self._take(self._outputs)
            try:
                return self._restore(plan, buffer[:plan.nbytes], outputs), outputs
            except BaseException:
                self._outputs.put(outputs)
                raise
        finally:
            self._compact.put(buffer)

    def _read_group(self, requests: list, staging) -> None:
        config = self._reader._config
        for r in requests:
            dest = staging[r.start:r.stop]
            channel = self._reader._clients.channel(r.unit)
            spans = np.asarray(r.spans, dtype=np.int64).reshape(-1, 3)
            lengths = channel.read(r.keys, dest, timeout=config.read_timeout_s, generations=r.generations,
                                   incarnation=r.incarnation or None, spans=spans)
            if sum(lengths) != r.stop - r.start:
                raise TransferError(f"unit {r.unit} returned {sum(lengths)} bytes for {len(spans)} spans of "
                                    f"{len(r.keys)} keys, expected {r.stop - r.start}", unit=r.unit, keys=r.keys)

    # -- consuming ---------------------------------------------------------------------
    def __iter__(self) -> Iterator[MicroBatch]:
        return self

    def __next__(self) -> MicroBatch:
        if self._lazy is not None:
            raise InvalidInputError("a stream whose replay_handles were taken is not iterated")
        with self._lock:
            if self._closed:
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
        try:
            if self._ahead:
                batch, outputs = self._restores.pop(plan.index).result()
                self._fetches.pop(plan.index)
            else:
                buffer = self._fetches.pop(plan.index).result()
                try:
                    outputs = self._outputs.get_nowait() if not self._outputs.empty() else self._new_outputs()
                    try:
                        batch = self._restore(plan, buffer[:plan.nbytes], outputs)
                    except BaseException:
                        self._outputs.put(outputs)
                        raise
                finally:
                    self._compact.put(buffer)
        except BaseException:
            self.close()
            raise
        self._live[plan.index] = (batch, outputs)
        self._next += 1
        if self._submitted < len(self._plans):
            self._submit()
        return batch

    def _finish(self, batch: MicroBatch) -> None:
        with self._lock:
            live = self._live.pop(batch.index, None)
            if live is None:
                return
            self._outputs.put(live[1])
            if self._release is not None:
                self._release_references(self._plans[batch.index])

    def replay_handles(self, release_after: str = "backward") -> list[list[LayerRef]]:
        """Per micro-batch, one lazy handle per layer, for slime's ``RoutingReplay.record``.

        Record them all up front (as slime's ``fill_routing_replay`` does);
        training then materialises each layer as its router replays it. A
        micro-batch is restored when its first layer is materialised (in
        micro-batch order; prefetch keeps the next ones coming) and released
        once every layer was materialised for ``release_after``:
        ``"backward"`` for a training pass, ``"forward"`` for a forward-only
        one (log probs). Live micro-batches are those between their first
        forward and last backward: a pipeline schedule's in-flight ones.
        """
        if release_after not in ("forward", "backward"):
            raise InvalidInputError(f"release_after must be 'forward' or 'backward', got {release_after!r}")
        with self._lock:
            if self._next or self._lazy is not None:
                raise InvalidInputError("replay_handles are taken once, before any micro-batch is consumed")
            self._lazy = release_after
        return [[LayerRef(self, plan.index, j) for j in range(len(self._layers_of(plan)))] for plan in self._plans]

    @staticmethod
    def _layers_of(plan: _MicroPlan) -> tuple:
        return next((fp.layers for fp in plan.fields.values() if fp.layers), ())

    def _materialize(self, index: int, position: int, direction: str):
        with self._lock:
            retiring, self._retiring = self._retiring, None
            if retiring is not None and retiring.index != index:
                self._finish(retiring)  # the tensor handed out last is used by now
            elif retiring is not None:
                self._retiring = retiring
            live = self._live.get(index)
            if live is None:
                if self._closed:
                    raise ClosedError("the stream was closed")
                if index != self._next:
                    state = "was released" if index < self._next else f"comes after micro-batch {self._next}"
                    raise InvalidInputError(f"micro-batch {index} {state}: micro-batches are replayed in order")
                batch = self._advance()
                self._uses[index] = 0
            else:
                batch = live[0]
            tensor = batch.routed_experts[position]
            if direction == self._lazy:
                self._uses[index] += 1
                if self._uses.get(index) == len(batch.routed_experts):
                    # Released at the next call: the restore thread must not refill a buffer whose
                    # tensor the caller is still reading.
                    del self._uses[index]
                    self._retiring = batch
            return tensor

    def _restore(self, plan: _MicroPlan, staging, outputs: dict) -> MicroBatch:
        fields, experts, layers = {}, [], ()
        to_output = self._reader._to_output
        for name, fp in plan.fields.items():
            out = outputs[name][:fp.out_elements]
            rows = staging.nbytes // (fp.width * fp.stored.itemsize)
            compact = staging[:rows * fp.width * fp.stored.itemsize].view(fp.stored)
            widen_scatter(compact, fp.plan, fp.width, out, fill=fp.fill, validate=False)
            if fp.layers:
                shaped = out.reshape(len(fp.layers), fp.tokens, fp.width)
                self._pad(fp, shaped)
                self._check_layers(fp, shaped, plan)
                fields[name] = to_output(shaped)
                experts, layers = [to_output(shaped[j]) for j in range(len(fp.layers))], fp.layers
            else:
                fields[name] = [to_output(out[a * fp.width:(a + n) * fp.width]) for a, n in fp.sample_rows]
        if self._reader._device != "cpu":
            self._reader._synchronize()
        return MicroBatch(plan.index, plan.samples, layers, experts, {sample_key_of(n): v for n, v in fields.items()},
                          self)

    def _pad(self, fp: _FieldPlan, shaped) -> None:
        for offset, start, stop in fp.pads:
            block = pad_block(start, stop, fp.layers, fp.stored_layers, fp.width, self._rank.num_experts)
            if self._reader._device == "cpu":
                shaped[:, offset:offset + stop - start] = block
            else:
                import torch

                torch.from_dlpack(shaped[:, offset:offset + stop - start]).copy_(torch.from_numpy(block))

    def _check_layers(self, fp: _FieldPlan, shaped, plan: _MicroPlan) -> None:
        """slime refuses to replay a MoE layer whose captured routes are all zero (top-k > 1)."""
        if fp.width < 2 or not fp.data:
            return
        on_host = self._reader._device == "cpu"
        for j, layer in enumerate(fp.layers):
            for offset, rows in fp.data:
                part = shaped[j, offset:offset + rows]
                if bool(part.any() if on_host else self._reader._to_output(part).any()):
                    break
            else:
                raise LayoutError(f"micro-batch {plan.index} (samples {list(plan.samples)}): R3 of layer {layer} is "
                                  f"all zero for every stored token; refusing to replay expert 0 everywhere")

    def _release_references(self, plan: _MicroPlan) -> None:
        if plan.index in self.released:
            return
        self.released.append(plan.index)
        # The micro-batch's index in the id: two micro-batches with the same uses are two releases.
        release_id = self._reader._default_release_id(uses_by_unit(plan.layouts), self._release) + f"/mb{plan.index}"
        self._reader.release(plan.layouts, self._release, release_id=release_id)

    def close(self) -> None:
        """Stop prefetching and wait for the work in flight. Idempotent; the buffers go."""
        if self._closed:
            return
        retiring, self._retiring = self._retiring, None
        if retiring is not None:
            self._finish(retiring)  # it was consumed: its references go
        self._closed = True
        pending = [*self._restores.values(), *self._fetches.values()]
        for future in pending:
            future.cancel()
        wait(pending)  # work under way sees the stream closed, or finishes its read (bounded by its timeout)
        self._fetches.clear()
        self._restores.clear()
        self._lent.close()

    def __enter__(self) -> "MicroBatchStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
