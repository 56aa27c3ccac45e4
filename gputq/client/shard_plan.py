"""Planning a whole-shard fetch: each referenced blob once, laid out in one staging buffer, and its widen plan.

For a shard (the layouts of its samples) :func:`stage_field` deduplicates
each field's referenced blobs (a step shared by many segments is fetched
once) and refuses a shard that names two versions of one key;
:func:`lay_out` places every blob in one compact staging buffer, unit by
unit, each field's blobs on whole rows of that field's dtype view, as a few
:class:`ReadRequest` per unit; :func:`build_plan` is one field's
widen-and-scatter plan over the shard.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from gputq.data.packing import packed_row_bytes
from gputq.data.refs import FieldRef, Layout
from gputq.data.slices import layer_major
from gputq.errors import LayoutError, StaleReadError, TransferError

__all__ = ["FieldStage", "ReadRequest", "StoredFormat", "stored_format", "stage_field", "lay_out", "build_plan",
           "READ_BATCH_KEYS", "READ_BATCH_KEY_BYTES"]

#: Keys per read request.
READ_BATCH_KEYS = 4096
#: Bytes of key names per read request, well inside one control frame's body.
READ_BATCH_KEY_BYTES = 256 << 10



@dataclass
class FieldStage:
    """One field of a shard: its stored dtype and row shape, its blobs, their staging rows."""

    name: str
    dtype: np.dtype
    row_shape: tuple
    width: int
    refs_by_unit: dict  # unit -> [(key, FieldRef)], sorted by key
    ref_row: dict = field(default_factory=dict)  # (unit, key) -> first row in the staging view
    packing: tuple | None = None  # (K, bits) of packed IDs: a row's last axis in packed_row_bytes(K, bits)
    fill: float | int = 0  # what rows no fragment covers hold
    restored: np.dtype = np.dtype(np.float32)  # the dtype the trainer gets back

    @property
    def row_bytes(self) -> int:
        if self.packing is not None:
            topk, bits = self.packing
            return self.width // topk * packed_row_bytes(topk, bits)
        return self.width * self.dtype.itemsize


@dataclass
class ReadRequest:
    """One read: ``keys`` of ``unit`` land back to back in staging bytes [start, stop).

    ``generations`` (one per key, 0: unknown) and ``incarnation`` ("":
    unknown) come from the references, for the unit to check.
    """

    unit: str
    incarnation: str
    start: int
    stop: int
    keys: list = field(default_factory=list)
    generations: list = field(default_factory=list)
    key_bytes: int = 0

    def read(self, channel, dest, timeout: float | None) -> None:
        """Read this request's keys from ``channel`` (its unit's) into ``dest``, its bytes of staging."""
        lengths = channel.read(self.keys, dest, timeout=timeout, generations=self.generations,
                               incarnation=self.incarnation or None)
        if sum(lengths) != dest.nbytes:
            raise TransferError(f"unit {self.unit} returned {sum(lengths)} bytes for {len(self.keys)} keys, expected "
                                f"{dest.nbytes}", unit=self.unit, keys=self.keys)


def stage_field(name: str, layouts: Sequence[Layout]) -> FieldStage:
    refs: dict[tuple[str, str], FieldRef] = {}
    for layout in layouts:
        for fragment in layout.fragments:  # refs seen twice are the same key: no need to dedupe first
            ref = fragment.ref
            known = refs.setdefault((ref.unit, ref.key), ref)
            if known is not ref and _versions_differ(known, ref):
                raise StaleReadError(f"the shard references two versions of key {ref.key!r} on unit "
                                     f"{ref.unit} (incarnation {known.incarnation!r} generation "
                                     f"{known.generation}, and {ref.incarnation!r} {ref.generation}); "
                                     f"at most one is current")
    form = stored_format(name, refs.values(), layouts, "shard")
    width = int(np.prod(form.row_shape, dtype=np.int64)) if form.row_shape else 1
    by_unit: dict[str, list] = {}
    for (unit, key), ref in sorted(refs.items()):
        by_unit.setdefault(unit, []).append((key, ref))
    return FieldStage(name, form.dtype, form.row_shape, width, by_unit, packing=form.packing, fill=form.fill,
                      restored=form.restored)


@dataclass(frozen=True)
class StoredFormat:
    """How one field of a shard or micro-batch is stored and restored: one format for all its blobs."""

    dtype: np.dtype
    row_shape: tuple
    packing: tuple | None  # (K, bits) of packed IDs
    restored: np.dtype
    fill: float | int


def stored_format(name: str, refs: Iterable[FieldRef], layouts: Sequence[Layout], where: str) -> StoredFormat:
    """The one stored format of field ``name`` over ``refs`` (its blobs) and ``layouts`` (its samples).

    Raises ``LayoutError`` naming ``where`` (a shard, a micro-batch) when its
    blobs mix dtypes, row shapes or packings, or its layouts fill values.
    """
    specs = {(ref.dtype, tuple(ref.row_shape), ref.packing) for ref in refs}
    if len(specs) > 1:
        raise LayoutError(f"field {name!r} mixes stored dtypes/row shapes in one {where}: {sorted(map(str, specs))}")
    fills = {layout.fill for layout in layouts}
    if len(fills) > 1:
        raise LayoutError(f"field {name!r} has several fill values in one {where}: {fills}")
    # A field whose samples are all fill rows still has a dtype and row shape: its layouts'.
    dtype, row_shape, packing = specs.pop() if specs else (layouts[0].dtype, tuple(layouts[0].row_shape), None)
    return StoredFormat(np.dtype(dtype), tuple(row_shape), packing, np.dtype(layouts[0].dtype), fills.pop())


def _versions_differ(a: FieldRef, b: FieldRef) -> bool:
    """True when two references to one key name different known generations or incarnations."""
    return bool(a.generation and b.generation and a.generation != b.generation) or \
        bool(a.incarnation and b.incarnation and a.incarnation != b.incarnation)


def lay_out(stages: Sequence[FieldStage], max_bytes: int | None = None) -> tuple[list[ReadRequest], int]:
    """Place every blob of a shard in one staging buffer; return the reads and its size.

    Unit by unit, the unit's fields back to back, so one request per unit
    covers them all. Each field's staging view indexes rows from byte 0, so
    its blobs must start at multiples of its row size: fields go widest row
    first (then a narrower row size usually divides the cursor). A new
    request starts where padding is still needed, where the references
    name another incarnation of the unit (the unit checks one per read),
    and before a request would pass :data:`READ_BATCH_KEYS` keys,
    :data:`READ_BATCH_KEY_BYTES` of key names or ``max_bytes`` of payload
    (the transport's frame limit; a single larger key goes alone).
    """
    order = sorted(stages, key=lambda stage: (-stage.row_bytes, stage.name))
    groups = sorted({(unit, ref.incarnation) for stage in stages
                     for unit, refs in stage.refs_by_unit.items() for _, ref in refs})
    requests: list[ReadRequest] = []
    cursor = 0
    for unit, incarnation in groups:
        current = None
        for stage in order:
            row_bytes = stage.row_bytes
            for key, ref in stage.refs_by_unit.get(unit, ()):
                if ref.incarnation != incarnation:
                    continue
                aligned = -(-cursor // row_bytes) * row_bytes
                nbytes, key_bytes = ref.rows * row_bytes, len(key.encode()) + 8
                if current is None or aligned != cursor or len(current.keys) >= READ_BATCH_KEYS \
                        or current.key_bytes + key_bytes > READ_BATCH_KEY_BYTES \
                        or (max_bytes is not None and current.keys and
                            cursor + nbytes - current.start > max_bytes):
                    current = ReadRequest(unit, incarnation, aligned, aligned)
                    requests.append(current)
                    cursor = aligned
                stage.ref_row[(unit, key)] = cursor // row_bytes
                current.keys.append(key)
                current.generations.append(ref.generation)
                current.key_bytes += key_bytes
                cursor += nbytes
                current.stop = cursor
    return requests, -(-cursor // 16) * 16  # whole rows of every dtype view


def build_plan(stage: FieldStage, layouts: Sequence[Layout]) -> tuple[np.ndarray, list[int], int]:
    """The widen-and-scatter plan of one field over a shard.

    Returns the ``[n, 3]`` int64 plan (source row, target row, rows; source
    -1 marks fill rows), each sample's first target row, and the total rows.
    For a layer-major field (see :mod:`gputq.data.slices`) plan rows are one
    layer of one token (``row_shape[1:]``) and the target is layer-major
    too, ``[L, total, ...]``: one plan row per fragment and layer.
    """
    offsets: list[int] = []
    base = 0
    for layout in layouts:
        offsets.append(base)
        base += layout.rows
    layers = stage.row_shape[0] if layer_major(stage.row_shape) else 1
    plan: list[tuple[int, int, int]] = []
    for layout, first in zip(layouts, offsets):
        covered = []
        for frag in layout.fragments:
            blob = stage.ref_row[(frag.ref.unit, frag.ref.key)] * layers  # in plan rows
            for layer in range(layers):
                plan.append((blob + layer * frag.ref.rows + frag.src_row, layer * base + first + frag.dst_row,
                             frag.rows))
            covered.append((frag.dst_row, frag.rows))
        gaps, cursor = [], 0
        for start, rows in sorted(covered):
            if start > cursor:
                gaps.append((cursor, start - cursor))
            cursor = start + rows
        if cursor < layout.rows:
            gaps.append((cursor, layout.rows - cursor))
        plan.extend((-1, layer * base + first + start, rows) for layer in range(layers) for start, rows in gaps)
    array = np.asarray(plan, dtype=np.int64).reshape(-1, 3)
    return array, offsets, base
