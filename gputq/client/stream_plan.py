"""Planning a rank's stream: what each micro-batch reads and how it is widened.

:func:`plan_stream` checks a stream's arguments against the shard (every
error names the sample or micro-batch, before anything is read) and sizes
each micro-batch; :meth:`MicroPlan.finish`, just before a micro-batch's
fetch, turns the rank's :class:`~gputq.data.slices.ParallelSlice` into

- the stored rows each key must give, merged over the micro-batch's
  samples (a step two samples share is read once for the micro-batch);
- span requests, one per unit when the fields' rows align: only the
  slice's bytes, layer after layer;
- per field, the widen-and-scatter plan from those compact bytes into a
  layer-major output (``[layers, tokens, ...]``), plus slime's pad rows.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Iterable, Mapping, Sequence

import numpy as np

from gputq.client.shard_plan import READ_BATCH_KEYS, stored_format
from gputq.data.packing import packed_row_bytes
from gputq.data.refs import FieldRef, Layout
from gputq.data.slices import ParallelSlice, blob_spans, expert_pieces, layer_major, logprob_ranges
from gputq.errors import InvalidInputError, LayoutError, TransferError
from gputq.transport.spans import MAX_SPANS

__all__ = ["plan_stream", "MicroPlan", "FieldPlan", "SpanRequest"]


@dataclass
class SpanRequest:
    """One read: ``spans`` of ``keys`` of ``unit`` land back to back in staging bytes [start, stop)."""

    unit: str
    incarnation: str
    start: int
    stop: int = 0
    keys: list = field(default_factory=list)
    generations: list = field(default_factory=list)
    spans: list = field(default_factory=list)  # (key index, offset, nbytes); int64 [m, 3] once planned

    def send(self, pipe, timeout: float | None) -> None:
        """Send this read on ``pipe`` (a :meth:`UnitChannel.pipeline <gputq.client.clients.UnitChannel.pipeline>`
        to its unit); its reply is left queued."""
        pipe.send(self.keys, timeout, generations=self.generations, incarnation=self.incarnation or None,
                  spans=self.spans)

    def read(self, channel, dest, timeout: float | None) -> None:
        """Read this request's spans from ``channel`` (its unit's) into ``dest``, its bytes of staging."""
        self.check_lengths(channel.read(self.keys, dest, timeout=timeout, generations=self.generations,
                                        incarnation=self.incarnation or None, spans=self.spans))

    def check_lengths(self, lengths: list) -> None:
        """Refuse a reply whose lengths do not add up to the request's bytes (``TransferError``)."""
        if sum(lengths) != self.stop - self.start:
            raise TransferError(f"unit {self.unit} returned {sum(lengths)} bytes for {len(self.spans)} spans of "
                                f"{len(self.keys)} keys, expected {self.stop - self.start}", unit=self.unit,
                                keys=self.keys)


@dataclass
class FieldPlan:
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
    packing: tuple | None = None  # (K, bits) of packed IDs: a plan row of K IDs in packed_row_bytes(K, bits)
    tokens: int = 0  # rows per layer (layer-major) or in all
    pads: list = field(default_factory=list)  # (token offset, first pad row, stop)
    data: list = field(default_factory=list)  # (token offset, rows): stored rows, for the empty-layer check
    sample_rows: list = field(default_factory=list)  # per sample (offset, rows), token-major fields

    @property
    def row_bytes(self) -> int:
        """Staging bytes of one plan row."""
        return self.width * self.stored.itemsize if self.packing is None else packed_row_bytes(*self.packing)


@dataclass
class MicroPlan:
    """One micro-batch: its shard positions, its reads (``nbytes`` of staging) and each field's plan.

    :func:`plan_stream` checks every micro-batch and sizes it (``units``,
    ``slice_bytes``, ``max_nbytes``); where its bytes go in staging (the
    requests, ``nbytes``, each field's widen plan) is worked out by
    :meth:`finish`, which the stream calls just before the micro-batch's
    fetch: planning a whole shard up front would delay its first
    micro-batch by the planning of all the others.
    """

    index: int
    samples: tuple
    fields: dict
    layouts: list  # the samples' layouts, for release
    units: tuple  # the units its reads go to
    slice_bytes: int  # what its reads move, exactly
    max_nbytes: int  # the staging it can need at most (the slice and each request's alignment)
    requests: list | None = None
    nbytes: int = 0
    _pending: tuple | None = field(default=None, repr=False)

    def finish(self) -> "MicroPlan":
        """Lay the micro-batch's reads out in staging and build its widen plans (once; returns it)."""
        if self._pending is not None:
            work, max_bytes = self._pending
            requests: list[SpanRequest] = []
            placed, cursor = _place([(needs, fp.layers) for fp, _, _, needs in work], requests, max_bytes)
            for (fp, frags, gaps, _), where in zip(work, placed):
                fp.plan = _kernel_plan(fp, frags, gaps, where)
            for request in requests:  # as every read of every pass sends them
                request.spans = np.asarray(request.spans, dtype=np.int64).reshape(-1, 3)
            self.requests, self.nbytes, self._pending = requests, -(-cursor // 16) * 16, None
        return self


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
        self._merged: dict | None = None

    def add(self, ref: FieldRef, start: int, stop: int) -> None:
        key = (ref.unit, ref.key)
        self.refs.setdefault(key, ref)
        self.rows.setdefault(key, []).append([start, stop])
        self._merged = None

    def merged(self) -> dict:
        """Per key, its rows as sorted, disjoint ``[start, stop]`` runs (worked out once: sizing and placing
        both take them)."""
        if self._merged is not None:
            return self._merged
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
        self._merged = out
        return out


def _place(fields: list, requests: list, max_bytes: int | None) -> tuple[list, int]:
    """Lay a micro-batch's merged rows out in staging, as span requests: one per unit when rows align.

    ``fields`` holds each field's :class:`_Needs` and layers, widest rows
    first. Unit by unit, the unit's fields back to back, so one request
    per unit usually covers them all; a request starts anew where a field's
    rows need padding to start whole (plan rows index each field's compact
    view from byte 0), at a change of the unit's incarnation, and past
    :data:`~gputq.client.shard_plan.READ_BATCH_KEYS`, :data:`MAX_SPANS` or ``max_bytes``.

    Returns, per field, ``{(unit, key): [(start, stop, plan row of row start
    in the first layer, plan rows from one layer to the next)]}`` (spans go
    layer after layer, each layer's runs back to back, merged or not), and
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
            item, major, row_bytes, align = _row_geometry(ref.dtype, ref.stored_shape)
            spans_of_key = blob_spans(ref.rows, ref.stored_shape, item, runs, layers if major else None)
            nbytes_key = sum(span[1] for span in spans_of_key)
            if current is None or cursor % row_bytes or len(current.keys) >= READ_BATCH_KEYS \
                    or len(current.spans) + len(spans_of_key) > MAX_SPANS \
                    or (max_bytes is not None and current.keys and cursor + nbytes_key - current.start > max_bytes):
                cursor = -(-cursor // align) * align
                current = SpanRequest(unit, incarnation, cursor, cursor)
                requests.append(current)
            index = len(current.keys)
            current.keys.append(key)
            current.generations.append(ref.generation)
            # Each layer holds the key's runs back to back: a run's first layer starts where the
            # runs before it end, and its next layers follow a whole layer of runs apart.
            lengths = [stop - start for start, stop in runs]
            first, step = cursor // row_bytes, sum(lengths)
            placed[f][(unit, key)] = [(start, stop, first + before, step)
                                      for (start, stop), before in zip(runs, accumulate(lengths, initial=0))]
            current.spans.extend((index, offset, nbytes) for offset, nbytes in spans_of_key)
            cursor += nbytes_key
            current.stop = cursor
    return placed, cursor


@functools.lru_cache(maxsize=64)
def _row_geometry(dtype: str, row_shape: tuple) -> tuple[int, bool, int, int]:
    """Item size, layer-major or not, bytes of one plan row, and the alignment a request starts on."""
    item = np.dtype(dtype).itemsize
    major = layer_major(row_shape)
    row_bytes = (math.prod(row_shape[1:]) if major else math.prod(row_shape)) * item
    return item, major, row_bytes, row_bytes * 16 // math.gcd(row_bytes, 16)


def _source_row(placed: dict, ref: FieldRef, row: int) -> tuple[int, int]:
    """The plan row of stored ``row`` of ``ref`` in the first layer read, and the rows between layers."""
    for start, stop, first, step in placed[(ref.unit, ref.key)]:
        if start <= row < stop:
            return first + row - start, step
    raise AssertionError("a fragment outside the rows placed for it")  # _Needs holds every fragment's rows


def _field_format(name: str, layouts: Sequence[Layout]):
    """The field's one stored format over the micro-batch's layouts (see ``stored_format``)."""
    return stored_format(name, (f.ref for layout in layouts for f in layout.fragments), layouts, "micro-batch")


def _expert_field(name: str, layouts: list, m: int, rank: ParallelSlice, ranges, needs: _Needs):
    """The plan of a layer-major field of micro-batch ``m``: layer-major output ``[layers, tokens, ...]``,
    slime's pads."""
    form = _field_format(name, layouts)
    row_shape = form.row_shape
    where = f"micro-batch {m}, field {name!r}"
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
    fp = FieldPlan(name, form.dtype, form.restored, width, np.zeros((0, 3), np.int64), form.fill,
                   len(layers) * tokens * width, layers, row_shape[0], form.packing, tokens)
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


def _token_field(name: str, layouts: list, positions: list, m: int, rank: ParallelSlice, totals, needs: _Needs):
    """The plan of a row-after-row field (logprobs): each sample's CP-kept rows, back to back."""
    form = _field_format(name, layouts)
    width = max(1, math.prod(form.row_shape))
    frags, gaps, offset = [], [], 0
    fp = FieldPlan(name, form.dtype, form.restored, width, np.zeros((0, 3), np.int64), form.fill, 0, (), 0,
                   form.packing)
    for i, layout in enumerate(layouts):
        if rank.cp_size > 1:
            if totals is None or totals[i] is None:
                raise InvalidInputError(f"micro-batch {m}, sample {positions[i]}: cutting field {name!r} for CP needs the sample's "
                                        f"total length (R3 rows + 1, or total_lengths)")
            if not 0 <= layout.rows <= totals[i]:
                raise InvalidInputError(f"micro-batch {m}, sample {positions[i]}: field {name!r} has {layout.rows} rows, more than "
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
                max_bytes: int | None = None) -> list[MicroPlan]:
    """Check a stream's arguments and size every micro-batch; raises ``InvalidInputError`` naming the sample.

    Every check runs here, before anything is read; :meth:`MicroPlan.finish`
    only places what was checked.
    """
    if not isinstance(rank, ParallelSlice):
        raise InvalidInputError(f"rank must be a ParallelSlice, got {type(rank).__name__}")
    batches = _checked_batches(micro_batches, len(shard))
    if total_lengths is not None:
        total_lengths = _checked_lengths(total_lengths, len(shard))
    if token_ranges is not None and len(token_ranges) != len(shard):
        raise InvalidInputError(f"{len(token_ranges)} token range lists for {len(shard)} samples")
    if token_ranges is not None and rank.allgather_cp and rank.cp_size > 1:
        raise InvalidInputError("token_ranges replace the CP rule: give them with a ParallelSlice without "
                                "allgather_cp, not both")
    return [_plan_micro_batch(shard, m, batch, rank, total_lengths, token_ranges, fields, max_bytes)
            for m, batch in enumerate(batches)]


def _checked_batches(micro_batches, samples: int) -> list[list[int]]:
    """The micro-batch split as lists of shard positions that partition the shard's ``samples``."""
    if isinstance(micro_batches, (str, bytes)) or not isinstance(micro_batches, Iterable):
        raise InvalidInputError(f"micro_batches must be a list of lists of shard positions, got "
                                f"{type(micro_batches).__name__}")
    seen: dict[int, int] = {}
    batches = []
    for m, batch in enumerate(micro_batches):
        if isinstance(batch, (str, bytes)) or not isinstance(batch, Iterable):
            raise InvalidInputError(f"micro-batch {m} must be a list of shard positions, got {type(batch).__name__}")
        batch = list(batch)
        if not batch:
            raise InvalidInputError(f"micro-batch {m} is empty")
        for i in batch:
            if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)) or not 0 <= i < samples:
                raise InvalidInputError(f"micro-batch {m} names sample {i!r}; the shard has {samples} samples")
            if int(i) in seen:
                raise InvalidInputError(f"sample {i} is in micro-batches {seen[int(i)]} and {m}: micro-batches must "
                                        f"partition the shard")
            seen[int(i)] = m
        batches.append([int(i) for i in batch])
    missing = sorted(set(range(samples)) - set(seen))
    if missing:
        raise InvalidInputError(f"samples {missing[:8]} are in no micro-batch: micro-batches must partition the shard")
    return batches


def _sample_totals(shard, m: int, batch: list, names: list, total_lengths) -> list:
    """Each sample's ``len(tokens)``: given, and then checked against R3's rows, or R3's rows + 1."""
    for name in names:
        if any(name not in shard[i] for i in batch):
            raise LayoutError(f"field {name!r} is missing from some samples of micro-batch {m}")
    totals = [None] * len(batch)
    for j, i in enumerate(batch):
        expert_rows = [shard[i][n].rows for n in names if layer_major(shard[i][n].row_shape)]
        if total_lengths is not None:
            totals[j] = total_lengths[i]
            if expert_rows and expert_rows[0] != totals[j] - 1:
                raise InvalidInputError(f"sample {i}: R3 has {expert_rows[0]} rows, expected len(tokens) - 1 = "
                                        f"{totals[j] - 1}")
        elif expert_rows:
            totals[j] = expert_rows[0] + 1
    return totals


def _plan_micro_batch(shard, m: int, batch: list, rank: ParallelSlice, total_lengths, token_ranges, fields,
                      max_bytes) -> MicroPlan:
    """Micro-batch ``m``'s fields checked and sized; their placement waits for :meth:`MicroPlan.finish`."""
    names = sorted({name for i in batch for name in shard[i]} if fields is None else set(fields))
    totals = _sample_totals(shard, m, batch, names, total_lengths)
    planned, work = {}, []
    # Widest rows first: a narrower field's requests then rarely need padding to start aligned.
    for name in sorted(names, key=lambda n: -len(shard[batch[0]][n].row_shape)):
        layouts = [shard[i][name] for i in batch]
        needs = _Needs()
        if layer_major(layouts[0].row_shape):
            ranges = None
            if token_ranges is not None:
                ranges = [_checked_ranges(token_ranges[i], shard[i][name].rows, i) for i in batch]
            fp, frags, gaps = _expert_field(name, layouts, m, rank, ranges, needs)
        else:
            fp, frags, gaps = _token_field(name, layouts, batch, m, rank, totals, needs)
        work.append((fp, frags, gaps, needs))
        planned[name] = fp
    units, slice_bytes, bound = _extent([(needs, fp.layers) for fp, _, _, needs in work])
    return MicroPlan(m, tuple(batch), planned, [shard[i] for i in batch], units, slice_bytes, bound,
                     _pending=(work, max_bytes))


def _extent(fields: list) -> tuple[tuple, int, int]:
    """A micro-batch's units, the bytes its spans name, and the most staging :func:`_place` can lay them in.

    ``fields`` as for :func:`_place`. Placement only pads: each request
    starts on its field's alignment (one request per key at most), and
    staging ends on 16 bytes.
    """
    units, nbytes, keys, align = set(), 0, 0, 16
    for needs, layers in fields:
        for (unit, key), runs in needs.merged().items():
            ref = needs.refs[(unit, key)]
            _, major, row_bytes, key_align = _row_geometry(ref.dtype, ref.stored_shape)
            per_row = row_bytes * ((len(layers) if layers else ref.row_shape[0]) if major else 1)
            units.add(unit)
            nbytes += sum(stop - start for start, stop in runs) * per_row
            keys += 1
            align = max(align, key_align)
    return tuple(sorted(units)), nbytes, nbytes + keys * align + 16


def _checked_lengths(total_lengths, samples: int) -> list[int]:
    """Each sample's ``len(tokens)``: an int >= 1 (a float is refused, not cut)."""
    if isinstance(total_lengths, (str, bytes)) or not isinstance(total_lengths, Iterable):
        raise InvalidInputError(f"total_lengths must be a list of ints, got {type(total_lengths).__name__}")
    lengths = list(total_lengths)
    if len(lengths) != samples:
        raise InvalidInputError(f"{len(lengths)} total lengths for {samples} samples")
    for i, n in enumerate(lengths):
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 1:
            raise InvalidInputError(f"sample {i}: total length must be an int >= 1, got {n!r}")
    return [int(n) for n in lengths]


def _checked_ranges(ranges, rows: int, sample: int) -> list:
    out = []
    for r in ranges:
        a, b = (int(v) for v in r)
        if not 0 <= a < b <= rows:
            raise InvalidInputError(f"sample {sample}: token range [{a}, {b}) is outside its {rows} rows")
        out.append((a, b))
    return out


def _kernel_plan(fp: FieldPlan, frags: list, gaps: list, placed: dict) -> np.ndarray:
    """The widen plan of a field: every fragment and gap once per layer read (layer-major output)."""
    per_layer = np.empty((len(frags) + len(gaps), 4), dtype=np.int64)  # src, src step per layer, dst, rows
    for i, (ref, src, dst, n) in enumerate(frags):
        per_layer[i] = (*_source_row(placed, ref, src), dst, n)
    for i, (g, n) in enumerate(gaps, len(frags)):
        per_layer[i] = (-1, 0, g, n)
    # Fragment after fragment, each in every layer: a fragment's rows then follow each other at
    # constant steps, which a host restore copies as one strided block (kernels.reference).
    layers = np.arange(max(1, len(fp.layers)), dtype=np.int64)[None, :]
    plan = np.empty((len(per_layer), layers.shape[1], 3), dtype=np.int64)
    fill = (per_layer[:, 0] < 0)[:, None]
    plan[:, :, 0] = np.where(fill, -1, per_layer[:, :1] + layers * per_layer[:, 1:2])
    plan[:, :, 1] = per_layer[:, 2:3] + layers * fp.tokens
    plan[:, :, 2] = per_layer[:, 3:4]
    return plan.reshape(-1, 3)
