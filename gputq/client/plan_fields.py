"""The read planner's fields: each field's stored rows, and its widen plan from the compact bytes.

For one field of a micro-batch (or of a whole shard, the one micro-batch
of :func:`~gputq.client.plan.plan_shard`), :func:`expert_field` (R3,
layer-major) and :func:`token_field` (logprobs, row after row) cut the
samples' layouts to the rank's slice: the stored rows each key must give
(:class:`FieldNeeds`, merged over the samples) and the fragments and fill
gaps of the output. Once the planner has placed the rows in staging,
:func:`kernel_plan` turns them into the widen-and-scatter plan of a
:class:`FieldPlan`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from gputq.client.plan_checks import stored_format, versions_differ
from gputq.data.packing import packed_row_bytes
from gputq.data.refs import FieldRef, Layout
from gputq.data.slices import ParallelSlice, expert_pieces, logprob_ranges
from gputq.errors import InvalidInputError, StaleReadError

__all__ = ["FieldPlan", "FieldNeeds", "expert_field", "token_field", "kernel_plan"]


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
    # Per fragment and gap: (plan row of its first layer's first row, -1: fill; plan rows from one layer to
    # the next; target token; rows). The plan is this table once per layer; a token-major restore reads it.
    pieces: np.ndarray = field(default_factory=lambda: np.zeros((0, 4), np.int64))

    @property
    def row_bytes(self) -> int:
        """Staging bytes of one plan row."""
        return self.width * self.stored.itemsize if self.packing is None else packed_row_bytes(*self.packing)


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


class FieldNeeds:
    """The stored rows a micro-batch (``where``) reads of each key of one field, merged, then placed in
    staging; with ``whole``, every row of each key."""

    def __init__(self, where: str, whole: bool = False):
        self.rows: dict[tuple[str, str], list] = {}  # (unit, key) -> [[start, stop], ...]
        self.refs: dict[tuple[str, str], FieldRef] = {}
        self._where, self._whole = where, whole
        self._merged: dict | None = None

    def add(self, ref: FieldRef, start: int, stop: int) -> None:
        """Read rows ``[start, stop)`` of ``ref``; ``StaleReadError`` where it names another version of a key
        already read."""
        key = (ref.unit, ref.key)
        known = self.refs.setdefault(key, ref)
        if known is not ref and ref.generation and not known.generation:
            self.refs[key] = ref  # the unit then checks the version one sample knows
        elif known is not ref and versions_differ(known, ref):
            raise StaleReadError(f"{self._where} references two versions of key {ref.key!r} on unit {ref.unit} "
                                 f"(incarnation {known.incarnation!r} generation {known.generation}, and "
                                 f"{ref.incarnation!r} {ref.generation}); at most one is current")
        self.rows.setdefault(key, []).append([start, stop])
        self._merged = None

    def merged(self) -> dict:
        """Per key, its rows as sorted, disjoint ``[start, stop]`` runs (worked out once: sizing and placing
        both take them)."""
        if self._merged is not None:
            return self._merged
        if self._whole:
            self._merged = {key: [[0, self.refs[key].rows]] for key in self.rows}
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


def _source_row(placed: dict, ref: FieldRef, row: int) -> tuple[int, int]:
    """The plan row of stored ``row`` of ``ref`` in the first layer read, and the rows between layers."""
    for start, stop, first, step in placed[(ref.unit, ref.key)]:
        if start <= row < stop:
            return first + row - start, step
    raise AssertionError("a fragment outside the rows placed for it")  # FieldNeeds holds every fragment's rows


def _field_format(name: str, layouts: Sequence[Layout], where: str):
    """The field's one stored format over the layouts of ``where`` (see ``stored_format``)."""
    return stored_format(name, (f.ref for layout in layouts for f in layout.fragments), layouts, where)


def expert_field(name: str, layouts: list, where: str, rank: ParallelSlice, ranges, needs: FieldNeeds):
    """The plan of a layer-major field of micro-batch ``where``: layer-major output ``[layers, tokens, ...]``,
    slime's pads."""
    form = _field_format(name, layouts, where)
    row_shape = form.row_shape
    where = f"{where}, field {name!r}"
    layers = rank.layer_indices(row_shape[0], where)
    if ranges is None:
        pieces = expert_pieces([layout.rows for layout in layouts], rank)
    else:
        pieces = [(i, a, b) for i, sample_ranges in enumerate(ranges) for a, b in sample_ranges]
    pads = [p for p in pieces if p[0] < 0]
    if pads:
        _check_pad_experts(layouts, rank, where)
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


def _check_pad_experts(layouts: list, rank: ParallelSlice, where: str) -> None:
    """Pad rows hold ``arange % num_experts``: refuse a rank without it, or naming another count than the one
    its IDs were stored for, packed or checked below it (slime's pads would differ from these)."""
    if rank.num_experts is None:
        raise InvalidInputError(f"{where}: slime's pad rows need ParallelSlice.num_experts")
    stored = {f.ref.num_experts or f.ref.id_limit for layout in layouts for f in layout.fragments} - {0}
    if stored and stored != {rank.num_experts}:
        raise InvalidInputError(f"{where}: ParallelSlice.num_experts is {rank.num_experts}, but its IDs were "
                                f"stored for {', '.join(map(str, sorted(stored)))} experts")


def token_field(name: str, layouts: list, positions: list, where: str, rank: ParallelSlice, totals,
                 needs: FieldNeeds):
    """The plan of a row-after-row field (logprobs) of ``where``: each sample's CP-kept rows, back to back."""
    form = _field_format(name, layouts, where)
    width = max(1, math.prod(form.row_shape))
    frags, gaps, offset = [], [], 0
    fp = FieldPlan(name, form.dtype, form.restored, width, np.zeros((0, 3), np.int64), form.fill, 0, (), 0,
                   form.packing)
    for i, layout in enumerate(layouts):
        if rank.cp_size > 1:
            if totals is None or totals[i] is None:
                raise InvalidInputError(f"{where}, sample {positions[i]}: cutting field {name!r} for CP needs the "
                                        f"sample's total length (R3 rows + 1, or total_lengths)")
            if not 0 <= layout.rows <= totals[i]:
                raise InvalidInputError(f"{where}, sample {positions[i]}: field {name!r} has {layout.rows} rows, "
                                        f"more than its {totals[i]} tokens")
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


def kernel_plan(fp: FieldPlan, frags: list, gaps: list, placed: dict) -> tuple[np.ndarray, np.ndarray]:
    """The pieces of a field (see :attr:`FieldPlan.pieces`) and its widen plan: every fragment and gap once per
    layer read (layer-major output)."""
    per_layer = np.empty((len(frags) + len(gaps), 4), dtype=np.int64)
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
    return per_layer, plan.reshape(-1, 3)
