"""References to stored blobs and layouts composed from them, without data.

A :class:`FieldRef` addresses one stored blob. A :class:`Fragment` copies a
row range of a ref into a row range of a target tensor. A :class:`Layout` is
the recipe for one target tensor: its rows, its fill (for rows no fragment
covers) and its fragments. Segments are built by composing layouts
(:meth:`Layout.concat`, :meth:`Layout.slice`, :meth:`Layout.shift`), which
never touches payload bytes.

All three are frozen and serialise to plain dicts carrying a ``schema``
version; a reader rejects versions it does not know. Version 2 added the
unit's incarnation and the key's generation to every reference, so a
reference to a unit that restarted, or to a key that was released and
written again, is refused instead of reading someone else's bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from gputq.data.packing import MAX_BITS, bits_for, packed_shape
from gputq.errors import InvalidInputError, LayoutError

__all__ = ["SCHEMA_VERSION", "GENERATION_LIMIT", "FieldRef", "Fragment", "Layout", "check_fill", "read_record",
           "uses_by_unit", "checked_shard"]

SCHEMA_VERSION = 2
#: Writers choose generations in [1, 2**63); 0 means "unknown: don't check".
GENERATION_LIMIT = 1 << 63
# Why an older record cannot be read, by schema version.
_RETIRED = {1: "version 1 references carry no unit incarnation or key generation, so a stale one "
               "could read another key's bytes; store the data again with this gputq"}


def read_record(data: Mapping[str, Any], kind: str, schema: int, keys: Sequence[str],
                retired: Mapping[int, str] | None = None, optional: Sequence[str] = ()) -> Mapping[str, Any]:
    """Check a serialised record's schema version and keys; return it.

    Raises ``InvalidInputError`` for a non-mapping, an unknown schema version
    (with the reason from ``retired`` for a version this gputq no longer
    reads), missing keys or unexpected keys (a record from a different
    version). ``optional`` keys may be there or not.
    """
    if not isinstance(data, Mapping):
        raise InvalidInputError(f"{kind} record must be a mapping, got {type(data).__name__}")
    if not all(isinstance(k, str) for k in data):
        raise InvalidInputError(f"{kind} record keys must be strings, got {list(data)[:8]!r}")
    version = data.get("schema")
    if type(version) is not int or version != schema:  # True == 1, but is no version
        reason = (retired or {}).get(version) if type(version) is int else None
        raise InvalidInputError(f"{kind} record has schema version {version!r}; this gputq reads {schema}"
                                + (f": {reason}" if reason else ""))
    missing = [k for k in keys if k not in data]
    if missing:
        raise InvalidInputError(f"{kind} record is missing {missing}; got keys {sorted(data)}")
    extra = sorted(set(data) - set(keys) - set(optional) - {"schema"})
    if extra:
        raise InvalidInputError(f"{kind} record has unexpected keys {extra}")
    return data


def _nonneg_int(kind: str, name: str, value: Any, error: type = LayoutError) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) \
            or not 0 <= value < GENERATION_LIMIT:
        raise error(f"{kind}.{name} must be a non-negative int below 2**63, got {value!r}")
    return int(value)


def _row_shape(kind: str, value: Any, error: type) -> tuple[int, ...]:
    if isinstance(value, (tuple, list)) and len(value) <= 32:
        shape = []
        for d in value:
            if not isinstance(d, (int, np.integer)) or isinstance(d, (bool, np.bool_)) or not 0 < d < 1 << 31:
                break
            shape.append(int(d))
        else:
            return tuple(shape)
    raise error(f"{kind}.row_shape must be a list of positive ints, got {value!r}")


def _numeric_dtype(kind: str, value: Any, error: type) -> tuple[np.dtype, str]:
    """``value`` as a native integer or float dtype, and its name; else ``error``."""
    known = _DTYPES.get(value) if isinstance(value, str) else None
    if known is not None:
        return known
    # Only names and dtype objects: np.dtype() also builds record and object dtypes from lists and dicts.
    if isinstance(value, (str, np.dtype)) or (isinstance(value, type) and issubclass(value, np.generic)):
        try:
            dtype = np.dtype(value)
        except (TypeError, ValueError, SyntaxError):
            dtype = None
        if dtype is not None and dtype.kind in "iuf" and dtype.isnative:
            known = (dtype, dtype.name)  # .name is computed in Python, slowly: refs are made per put
            if isinstance(value, str) and len(_DTYPES) < 256:
                _DTYPES[value] = known
            return known
    raise error(f"{kind}.dtype must name a native integer or float numpy dtype, got {value!r}")


_DTYPES: dict[str, tuple[np.dtype, str]] = {}


def check_fill(fill: Any, dtype: np.dtype, where: str, error: type) -> float | int:
    """``fill`` as the Python number a ``dtype`` tensor holds exactly; else ``error`` naming ``where``."""
    if isinstance(fill, (bool, np.bool_)) or not isinstance(fill, (int, float, np.integer, np.floating)):
        raise error(f"{where}: fill must be a number, got {fill!r}")
    if dtype.kind == "f":
        return float(fill)
    if isinstance(fill, (float, np.floating)) and not float(fill).is_integer():
        raise error(f"{where}: fill {fill!r} is not an integer for dtype {dtype}")
    info = np.iinfo(dtype)
    if not info.min <= int(fill) <= info.max:
        raise error(f"{where}: fill {fill!r} does not fit {dtype}")
    return int(fill)


@dataclass(frozen=True)
class FieldRef:
    """The address of one stored blob.

    Parameters
    ----------
    key:
        Storage key, unique within its unit.
    field:
        Field name of the payload.
    unit:
        Name of the StorageUnit holding it.
    rows:
        Number of token rows stored.
    dtype:
        Stored numpy dtype name.
    row_shape:
        Shape of one row (``()`` for scalars).
    partition:
        Rollout the key belongs to.
    incarnation:
        The unit's incarnation when the key was written (``""``: unknown).
        A unit that restarted has a new one and refuses the reference.
    generation:
        The key's generation, chosen by the writer (``0``: unknown). A key
        released and written again has another one, so the unit refuses
        the old reference instead of returning the new bytes.
    num_experts:
        ``0``: rows are ``row_shape`` elements of ``dtype``. Else the blob
        holds expert IDs packed for ``num_experts`` experts (``dtype``
        uint8): each row's last axis in ``packed_row_bytes`` bytes (see
        :mod:`gputq.data.packing`); :attr:`stored_shape` is its shape.
    id_limit:
        ``0``: unknown. Else whole-byte expert IDs, each checked below it
        when put (the model's experts: :attr:`FieldSpec.id_limit
        <gputq.data.fields.FieldSpec.id_limit>`).
    """

    key: str
    field: str
    unit: str
    rows: int
    dtype: str
    row_shape: tuple[int, ...]
    partition: str
    incarnation: str = ""
    generation: int = 0
    num_experts: int = 0
    id_limit: int = 0

    def __post_init__(self) -> None:
        for name in ("key", "field", "unit", "partition", "incarnation"):
            if not isinstance(getattr(self, name), str):
                raise InvalidInputError(f"FieldRef.{name} must be a str, got {getattr(self, name)!r}")
        object.__setattr__(self, "rows", _nonneg_int("FieldRef", "rows", self.rows))
        object.__setattr__(self, "generation",
                           _nonneg_int("FieldRef", "generation", self.generation, InvalidInputError))
        object.__setattr__(self, "row_shape", _row_shape("FieldRef", self.row_shape, InvalidInputError))
        object.__setattr__(self, "dtype", _numeric_dtype("FieldRef", self.dtype, InvalidInputError)[1])
        object.__setattr__(self, "num_experts",
                           _nonneg_int("FieldRef", "num_experts", self.num_experts, InvalidInputError))
        if self.num_experts:
            if self.dtype != "uint8" or not self.row_shape or self.num_experts > 1 << MAX_BITS:
                raise InvalidInputError(f"FieldRef {self.key!r}: packed IDs are uint8 rows of at least one axis, "
                                        f"for at most {1 << MAX_BITS} experts; got {self.dtype}{self.row_shape} "
                                        f"for {self.num_experts}")
        object.__setattr__(self, "id_limit", _nonneg_int("FieldRef", "id_limit", self.id_limit, InvalidInputError))
        if self.id_limit and (self.num_experts or np.dtype(self.dtype).kind not in "iu"):
            raise InvalidInputError(f"FieldRef {self.key!r}: id_limit bounds whole-byte integer IDs, not "
                                    f"{'packed ones' if self.num_experts else self.dtype}")

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The shape of one stored row in :attr:`dtype` (``row_shape``, or its packed bytes)."""
        return packed_shape(self.row_shape, self.num_experts) if self.num_experts else self.row_shape

    @property
    def packing(self) -> tuple[int, int] | None:
        """``(K, bits)`` of packed IDs (K per row's last axis), else None."""
        return (self.row_shape[-1], bits_for(self.num_experts)) if self.num_experts else None

    @property
    def row_nbytes(self) -> int:
        """Stored bytes of one row."""
        return math.prod(self.stored_shape) * np.dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        """Stored bytes of the whole blob."""
        return self.rows * self.row_nbytes

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict with ``"schema": 2``."""
        record = {"schema": SCHEMA_VERSION, "key": self.key, "field": self.field, "unit": self.unit,
                  "rows": self.rows, "dtype": self.dtype, "row_shape": list(self.row_shape),
                  "partition": self.partition, "incarnation": self.incarnation, "generation": self.generation}
        if self.num_experts:  # only packed refs carry it: whole-dtype records are as they were
            record["num_experts"] = self.num_experts
        if self.id_limit:  # likewise: records of refs without it are as they were
            record["id_limit"] = self.id_limit
        return record

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FieldRef:
        """Inverse of :meth:`to_dict`; raises ``InvalidInputError`` on a bad record.

        Schema 1 records (without incarnation and generation) are refused.
        """
        rec = read_record(data, "FieldRef", SCHEMA_VERSION,
                          ("key", "field", "unit", "rows", "dtype", "row_shape", "partition",
                           "incarnation", "generation"), _RETIRED, optional=("num_experts", "id_limit"))
        return cls(rec["key"], rec["field"], rec["unit"], rec["rows"], rec["dtype"], rec["row_shape"],
                   rec["partition"], rec["incarnation"], rec["generation"], rec.get("num_experts", 0),
                   rec.get("id_limit", 0))


@dataclass(frozen=True)
class Fragment:
    """Copy ``rows`` rows of ``ref`` from ``src_row`` to target row ``dst_row``."""

    ref: FieldRef
    src_row: int
    dst_row: int
    rows: int

    def __post_init__(self) -> None:
        if not isinstance(self.ref, FieldRef):
            raise LayoutError(f"Fragment.ref must be a FieldRef, got {type(self.ref).__name__}")
        for name in ("src_row", "dst_row", "rows"):
            object.__setattr__(self, name, _nonneg_int("Fragment", name, getattr(self, name)))
        if self.rows == 0:
            raise LayoutError("Fragment.rows must be positive")
        if self.src_row + self.rows > self.ref.rows:
            raise LayoutError(f"fragment rows [{self.src_row}, {self.src_row + self.rows}) are outside "
                              f"ref {self.ref.key!r} ({self.ref.rows} rows)")

    @property
    def dst_end(self) -> int:
        """One past the last target row."""
        return self.dst_row + self.rows


@dataclass(frozen=True)
class Layout:
    """The recipe for one target tensor ``[rows, *row_shape]`` of ``dtype``.

    Fragments are kept sorted by target row and never overlap; rows no
    fragment covers hold ``fill``. Construction validates everything and
    raises :class:`~gputq.errors.LayoutError`.

    Parameters
    ----------
    field:
        Field name; every fragment's ref must be of this field.
    rows:
        Target rows.
    fill:
        Value of uncovered rows.
    fragments:
        The copies that make up the target.
    dtype:
        Restored dtype; every ref's stored dtype must widen to it safely.
    row_shape:
        Shape of one row; every ref must share it.
    """

    field: str
    rows: int
    fill: float | int
    fragments: tuple[Fragment, ...]
    dtype: str
    row_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.field, str):
            raise LayoutError(f"Layout.field must be a str, got {self.field!r}")
        object.__setattr__(self, "rows", _nonneg_int("Layout", "rows", self.rows))
        object.__setattr__(self, "row_shape", _row_shape("Layout", self.row_shape, LayoutError))
        restored, name = _numeric_dtype("Layout", self.dtype, LayoutError)
        object.__setattr__(self, "dtype", name)
        object.__setattr__(self, "fill", check_fill(self.fill, restored, "Layout", LayoutError))
        if not isinstance(self.fragments, (tuple, list)) or \
                not all(isinstance(frag, Fragment) for frag in self.fragments):
            raise LayoutError(f"Layout.fragments must be a tuple of Fragments, got {self.fragments!r:.200}")
        frags = tuple(sorted(self.fragments, key=lambda f: f.dst_row))
        object.__setattr__(self, "fragments", frags)
        checked: set[tuple[str, tuple[int, ...]]] = set()
        end = 0
        for frag in frags:
            ref = frag.ref
            if ref.field != self.field or ref.row_shape != self.row_shape:
                raise LayoutError(f"layout of field {self.field!r} rows {self.row_shape} got a fragment of "
                                  f"ref {ref.key!r} (field {ref.field!r}, rows {ref.row_shape})")
            if (ref.dtype, ref.row_shape) not in checked:
                if not np.can_cast(ref.dtype, restored, "safe"):
                    raise LayoutError(f"ref {ref.key!r} dtype {ref.dtype} does not widen safely to {restored}")
                checked.add((ref.dtype, ref.row_shape))
            if frag.dst_row < end:
                raise LayoutError(f"fragments overlap at target row {frag.dst_row} in layout of {self.field!r}")
            end = frag.dst_end
        if end > self.rows:
            raise LayoutError(f"fragment ends at target row {end}, past the layout's {self.rows} rows")

    # -- construction ----------------------------------------------------
    @classmethod
    def empty(cls, field: str, rows: int, *, fill: float | int, dtype: str,
              row_shape: tuple[int, ...]) -> Layout:
        """A layout of ``rows`` fill rows and no fragments."""
        return cls(field, rows, fill, (), dtype, tuple(row_shape))

    @classmethod
    def from_ref(cls, ref: FieldRef, *, fill: float | int = 0, dtype: str | None = None) -> Layout:
        """The whole of ``ref`` as one fragment.

        ``dtype`` defaults to the widened form of the stored dtype: int32 for
        integer IDs, float32 for floats (the built-in restoration rule).
        """
        if dtype is None:
            dtype = "int32" if np.dtype(ref.dtype).kind in "iu" else "float32"
        frags = (Fragment(ref, 0, 0, ref.rows),) if ref.rows else ()
        return cls(ref.field, ref.rows, fill, frags, dtype, ref.row_shape)

    @staticmethod
    def concat(layouts: Iterable[Layout]) -> Layout:
        """Stack ``layouts`` along rows; each one's targets shift past the previous ones.

        All must share field, dtype, row shape and fill.
        """
        layouts = list(layouts)
        if not layouts:
            raise LayoutError("Layout.concat needs at least one layout")
        first = layouts[0]
        frags: list[Fragment] = []
        offset = 0
        for layout in layouts:
            if (layout.field, layout.dtype, layout.row_shape, layout.fill) != \
                    (first.field, first.dtype, first.row_shape, first.fill):
                raise LayoutError(f"cannot concat layouts of different field/dtype/row shape/fill: "
                                  f"{first.describe()} vs {layout.describe()}")
            frags.extend(Fragment(f.ref, f.src_row, f.dst_row + offset, f.rows) for f in layout.fragments)
            offset += layout.rows
        return Layout(first.field, offset, first.fill, tuple(frags), first.dtype, first.row_shape)

    def slice(self, start: int, stop: int) -> Layout:
        """Target rows ``[start, stop)`` as a layout of ``stop - start`` rows."""
        if not 0 <= start <= stop <= self.rows:
            raise LayoutError(f"slice [{start}, {stop}) is outside the layout's {self.rows} rows")
        frags = []
        for f in self.fragments:
            lo, hi = max(f.dst_row, start), min(f.dst_end, stop)
            if lo < hi:
                frags.append(Fragment(f.ref, f.src_row + lo - f.dst_row, lo - start, hi - lo))
        return Layout(self.field, stop - start, self.fill, tuple(frags), self.dtype, self.row_shape)

    def shift(self, offset: int, total_rows: int) -> Layout:
        """Place this layout at row ``offset`` of a ``total_rows`` target (the rest is fill)."""
        if offset < 0 or offset + self.rows > total_rows:
            raise LayoutError(f"cannot place {self.rows} rows at offset {offset} of a {total_rows}-row target")
        frags = tuple(Fragment(f.ref, f.src_row, f.dst_row + offset, f.rows) for f in self.fragments)
        return Layout(self.field, total_rows, self.fill, frags, self.dtype, self.row_shape)

    # -- inspection ------------------------------------------------------
    def refs(self) -> list[FieldRef]:
        """The distinct refs this layout reads, in first-use (target row) order."""
        return list(dict.fromkeys(f.ref for f in self.fragments))

    @property
    def covered_rows(self) -> int:
        """Target rows filled from stored data (the rest are fill)."""
        return sum(f.rows for f in self.fragments)

    @property
    def nbytes(self) -> int:
        """Restored bytes of the target tensor."""
        return self.rows * math.prod(self.row_shape) * np.dtype(self.dtype).itemsize

    def describe(self) -> str:
        """A one-line summary for error messages."""
        return (f"Layout({self.field!r}, rows={self.rows}, dtype={self.dtype}, row_shape={self.row_shape}, "
                f"fill={self.fill}, fragments={len(self.fragments)})")

    # -- serialisation ---------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict; each ref is written once and fragments point at it by index."""
        index: dict[FieldRef, int] = {}
        frags = []
        for f in self.fragments:
            i = index.setdefault(f.ref, len(index))
            frags.append([i, f.src_row, f.dst_row, f.rows])
        return {"schema": SCHEMA_VERSION, "field": self.field, "rows": self.rows, "fill": self.fill,
                "dtype": self.dtype, "row_shape": list(self.row_shape),
                "refs": [ref.to_dict() for ref in index], "fragments": frags}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Layout:
        """Inverse of :meth:`to_dict`; raises ``InvalidInputError`` on a bad record."""
        rec = read_record(data, "Layout", SCHEMA_VERSION,
                          ("field", "rows", "fill", "dtype", "row_shape", "refs", "fragments"), _RETIRED)
        if not isinstance(rec["refs"], list) or not isinstance(rec["fragments"], list):
            raise LayoutError(f"Layout record's refs and fragments must be lists, got "
                              f"{type(rec['refs']).__name__} and {type(rec['fragments']).__name__}")
        refs = [FieldRef.from_dict(r) for r in rec["refs"]]
        frags = []
        for entry in rec["fragments"]:
            if not isinstance(entry, (list, tuple)) or len(entry) != 4 or type(entry[0]) is not int \
                    or not 0 <= entry[0] < len(refs):
                raise LayoutError(f"Layout record has a bad fragment {entry!r:.200} ({len(refs)} refs)")
            frags.append(Fragment(refs[entry[0]], entry[1], entry[2], entry[3]))
        return cls(rec["field"], rec["rows"], rec["fill"], tuple(frags), rec["dtype"], rec["row_shape"])


def uses_by_unit(samples: Iterable[Mapping[str, Layout]]) -> dict[str, list[str]]:
    """Per unit, the stored keys of ``samples``, once per sample that uses each.

    This is the reference count segments hold on their steps: a step shared
    by three segments appears three times.
    """
    uses: dict[str, list[str]] = {}
    for sample in samples:
        for ref in {(ref.unit, ref.key) for layout in sample.values() for ref in layout.refs()}:
            uses.setdefault(ref[0], []).append(ref[1])
    return uses


def checked_shard(shard: Any) -> list[Mapping[str, Layout]]:
    """``shard`` as a list of samples, each a mapping of field name to that field's :class:`Layout`.

    The one check every read entry point runs first: anything else raises
    ``InvalidInputError`` (``LayoutError`` for a layout under another
    field's name) naming the sample and field, before anything is read.
    """
    if isinstance(shard, (str, bytes, Mapping)) or not isinstance(shard, Iterable):
        raise InvalidInputError(f"shard must be a list of samples (mappings of field name to Layout), "
                                f"got {type(shard).__name__}")
    shard = list(shard)
    for i, sample in enumerate(shard):
        if not isinstance(sample, Mapping):
            raise InvalidInputError(f"sample {i} must be a mapping of field name to Layout, got "
                                    f"{type(sample).__name__}")
        for name, layout in sample.items():
            if not isinstance(layout, Layout):
                raise InvalidInputError(f"sample {i} field {name!r}: expected a Layout, got {type(layout).__name__}")
            if layout.field != name:
                raise LayoutError(f"sample {i}: field {name!r} holds a layout of field {layout.field!r}")
    return shard
