"""The read planner: what each micro-batch, or a whole shard, reads and how it is widened.

One planner serves both reads. :func:`plan_stream` checks a stream's
arguments against the shard (every error names the sample or micro-batch,
before anything is read) and sizes each micro-batch; :func:`plan_shard`
plans a whole-shard fetch as the stream's special case: one micro-batch
holding every sample, all layers, whole rows, each referenced key read
whole (a key read, no spans). :meth:`MicroPlan.finish`, just before a
micro-batch's fetch, turns the rank's :class:`~gputq.data.slices.ParallelSlice` into

- the stored rows each key must give, merged over the micro-batch's
  samples (a step two samples share is read once; two versions of one key
  are refused);
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
from typing import Mapping, Sequence

import numpy as np

from gputq.client.plan_checks import checked_batches, checked_lengths, checked_ranges, sample_totals
from gputq.client.plan_fields import FieldNeeds, expert_field, kernel_plan, token_field
from gputq.data.refs import Layout
from gputq.data.slices import ParallelSlice, blob_spans, layer_major
from gputq.errors import InvalidInputError, TransferError
from gputq.transport.spans import MAX_SPANS

__all__ = ["plan_stream", "plan_shard", "MicroPlan", "SpanRequest", "READ_BATCH_KEYS",
           "READ_BATCH_KEY_BYTES"]

#: Keys per read request.
READ_BATCH_KEYS = 4096
#: Bytes of key names per read request, well inside one control frame's body.
READ_BATCH_KEY_BYTES = 256 << 10


@dataclass
class SpanRequest:
    """One read: ``spans`` of ``keys`` of ``unit`` land back to back in staging bytes [start, stop).

    ``spans`` is None for a read of whole keys (a whole shard's).
    ``generations`` (one per key, 0: unknown) and ``incarnation`` ("":
    unknown) come from the references, for the unit to check.
    """

    unit: str
    incarnation: str
    start: int
    stop: int = 0
    keys: list = field(default_factory=list)
    generations: list = field(default_factory=list)
    spans: list | None = field(default_factory=list)  # (key index, offset, nbytes); int64 [m, 3] once planned
    key_bytes: int = 0  # of key names

    def send(self, pipe, timeout: float | None) -> None:
        """Send this read on ``pipe`` (a :meth:`UnitChannel.pipeline <gputq.client.unit_channel.UnitChannel.pipeline>`
        to its unit); its reply is left queued."""
        pipe.send(self.keys, timeout, generations=self.generations, incarnation=self.incarnation or None,
                  spans=self.spans)

    def read(self, channel, dest, timeout: float | None, held=None) -> None:
        """Read this request's spans (or keys) from ``channel`` (its unit's) into ``dest``, its bytes of staging;
        under ``held``, its lease taken ahead (:meth:`lease_ahead`), where there is one."""
        if held is not None:
            self.check_lengths(channel.read_leased(held, dest, timeout))
            return
        self.check_lengths(channel.read(self.keys, dest, timeout=timeout, generations=self.generations,
                                        incarnation=self.incarnation or None, spans=self.spans))

    def lease_ahead(self, channel, timeout: float | None):
        """Lease this request's reads on ``channel`` (its unit's, one that reads one-sided) now, for :meth:`read`."""
        return channel.lease_ahead(self.keys, timeout, generations=self.generations,
                                   incarnation=self.incarnation or None, spans=self.spans)

    def check_lengths(self, lengths: list) -> None:
        """Refuse a reply whose lengths do not add up to the request's bytes (``TransferError``)."""
        if sum(lengths) != self.stop - self.start:
            spans = "" if self.spans is None else f"{len(self.spans)} spans of "
            raise TransferError(f"unit {self.unit} returned {sum(lengths)} bytes for {spans}{len(self.keys)} keys, "
                                f"expected {self.stop - self.start}", unit=self.unit, keys=self.keys)


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
    whole: bool = False  # whole keys read (a whole shard), not spans
    _pending: tuple | None = field(default=None, repr=False)

    def finish(self) -> "MicroPlan":
        """Lay the micro-batch's reads out in staging and build its widen plans (once; returns it)."""
        if self._pending is not None:
            work, max_bytes = self._pending
            requests: list[SpanRequest] = []
            placed, cursor = _place([(needs, fp.layers) for fp, _, _, needs in work], requests, max_bytes,
                                    self.whole)
            for (fp, frags, gaps, _), where in zip(work, placed):
                fp.pieces, fp.plan = kernel_plan(fp, frags, gaps, where)
            for request in requests:  # as every read of every pass sends them
                request.spans = None if self.whole else np.asarray(request.spans, dtype=np.int64).reshape(-1, 3)
            self.requests, self.nbytes, self._pending = requests, -(-cursor // 16) * 16, None
        return self


def _place(fields: list, requests: list, max_bytes: int | None, whole: bool) -> tuple[list, int]:
    """Lay a micro-batch's merged rows out in staging, as span requests: one per unit when rows align.

    ``fields`` holds each field's :class:`FieldNeeds` and layers, widest rows
    first. Unit by unit, the unit's fields back to back, so one request
    per unit usually covers them all; a request starts anew where a field's
    rows need padding to start whole (plan rows index each field's compact
    view from byte 0), at a change of the unit's incarnation (the unit checks
    one per read), and past :data:`READ_BATCH_KEYS`,
    :data:`READ_BATCH_KEY_BYTES`, :data:`MAX_SPANS` (unless ``whole``: whole
    keys are read by name) or ``max_bytes`` of payload (the transport's
    frame limit; a single larger key goes alone).

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
            spans_of_key = [] if whole else \
                blob_spans(ref.rows, ref.stored_shape, item, runs, layers if major else None)
            nbytes_key = ref.nbytes if whole else sum(span[1] for span in spans_of_key)
            key_bytes = len(key.encode()) + 8
            if current is None or cursor % row_bytes or len(current.keys) >= READ_BATCH_KEYS \
                    or current.key_bytes + key_bytes > READ_BATCH_KEY_BYTES \
                    or len(current.spans) + len(spans_of_key) > MAX_SPANS \
                    or (max_bytes is not None and current.keys and cursor + nbytes_key - current.start > max_bytes):
                cursor = -(-cursor // align) * align
                current = SpanRequest(unit, incarnation, cursor, cursor)
                requests.append(current)
            index = len(current.keys)
            current.keys.append(key)
            current.generations.append(ref.generation)
            current.key_bytes += key_bytes
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


def plan_stream(shard: Sequence[Mapping[str, Layout]], micro_batches: Sequence[Sequence[int]], rank: ParallelSlice,
                *, total_lengths: Sequence[int] | None = None, token_ranges=None, fields=None,
                max_bytes: int | None = None) -> list[MicroPlan]:
    """Check a stream's arguments and size every micro-batch; raises ``InvalidInputError`` naming the sample.

    Every check runs here, before anything is read; :meth:`MicroPlan.finish`
    only places what was checked.
    """
    if not isinstance(rank, ParallelSlice):
        raise InvalidInputError(f"rank must be a ParallelSlice, got {type(rank).__name__}")
    batches = checked_batches(micro_batches, len(shard))
    if total_lengths is not None:
        total_lengths = checked_lengths(total_lengths, len(shard))
    if token_ranges is not None and len(token_ranges) != len(shard):
        raise InvalidInputError(f"{len(token_ranges)} token range lists for {len(shard)} samples")
    if token_ranges is not None and rank.allgather_cp and rank.cp_size > 1:
        raise InvalidInputError("token_ranges replace the CP rule: give them with a ParallelSlice without "
                                "allgather_cp, not both")
    return [_plan_micro_batch(shard, m, f"micro-batch {m}", batch, rank, total_lengths, token_ranges, fields,
                              max_bytes) for m, batch in enumerate(batches)]


def plan_shard(shard: Sequence[Mapping[str, Layout]], max_bytes: int | None = None) -> MicroPlan:
    """A whole-shard fetch, placed: one micro-batch of every sample (in order), every field, all layers,
    whole rows; each referenced key read whole, once.

    Raises ``LayoutError`` where a field is missing from some samples or
    mixes stored formats, ``StaleReadError`` where the shard names two
    versions of one key.
    """
    names = sorted({name for sample in shard for name in sample})
    plan = _plan_micro_batch(shard, 0, "the shard", list(range(len(shard))), ParallelSlice(), None, None, names,
                             max_bytes, whole=True)
    return plan.finish()


def _plan_micro_batch(shard, m: int, where: str, batch: list, rank: ParallelSlice, total_lengths, token_ranges,
                      fields, max_bytes, *, whole: bool = False) -> MicroPlan:
    """Micro-batch ``m`` (``where``, in errors)'s fields checked and sized; their placement waits for
    :meth:`MicroPlan.finish`."""
    names = sorted({name for i in batch for name in shard[i]} if fields is None else set(fields))
    totals = sample_totals(shard, where, batch, names, total_lengths)
    planned, work = {}, []
    # Widest rows first: a narrower field's requests then rarely need padding to start aligned.
    for name in sorted(names, key=lambda n: -len(shard[batch[0]][n].row_shape)):
        layouts = [shard[i][name] for i in batch]
        needs = FieldNeeds(where, whole)
        if layer_major(layouts[0].row_shape):
            ranges = None
            if whole:  # every stored row, no pad rows
                ranges = [[(0, layout.rows)] for layout in layouts]
            elif token_ranges is not None:
                ranges = [checked_ranges(token_ranges[i], shard[i][name].rows, i) for i in batch]
            fp, frags, gaps = expert_field(name, layouts, where, rank, ranges, needs)
        else:
            fp, frags, gaps = token_field(name, layouts, batch, where, rank, totals, needs)
        work.append((fp, frags, gaps, needs))
        planned[name] = fp
    units, slice_bytes, bound = _extent([(needs, fp.layers) for fp, _, _, needs in work])
    return MicroPlan(m, tuple(batch), planned, [shard[i] for i in batch], units, slice_bytes, bound, whole=whole,
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
