"""The read planner's checks: a stream's arguments, and each field's one stored format.

Every check runs while planning, before anything is read, and names what
it refuses (the sample, the micro-batch or the shard):
:func:`checked_batches` (the trainer's micro-batch split partitions the
shard), :func:`checked_lengths` and :func:`sample_totals` (each sample's
``len(tokens)`` against its R3 rows), :func:`checked_ranges` (explicit
token ranges), :func:`stored_format` (one dtype, row shape, packing and
fill per field) and :func:`versions_differ` (two versions of one key).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from gputq.data.refs import FieldRef, Layout
from gputq.data.slices import layer_major
from gputq.errors import InvalidInputError, LayoutError

__all__ = ["StoredFormat", "stored_format", "versions_differ", "checked_batches", "checked_lengths",
           "checked_ranges", "sample_totals"]


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
        raise LayoutError(f"field {name!r} mixes stored formats in {where}: "
                          f"{', '.join(sorted(_described(*spec) for spec in specs))}; read them apart")
    fills = {layout.fill for layout in layouts}
    if len(fills) > 1:
        raise LayoutError(f"field {name!r} has several fill values in {where}: {sorted(fills)}")
    # A field whose samples are all fill rows still has a dtype and row shape: its layouts'.
    dtype, row_shape, packing = specs.pop() if specs else (layouts[0].dtype, tuple(layouts[0].row_shape), None)
    return StoredFormat(np.dtype(dtype), tuple(row_shape), packing, np.dtype(layouts[0].dtype), fills.pop())


def _described(dtype, row_shape: tuple, packing: tuple | None) -> str:
    """A stored format as a person reads it: ``uint8[6, 4]``, ``packed[6, 4] (7 bits an ID)``."""
    if packing is not None:
        return f"packed{list(row_shape)} ({packing[1]} bits an ID)"
    return f"{np.dtype(dtype)}{list(row_shape)}"


def versions_differ(a: FieldRef, b: FieldRef) -> bool:
    """True when two references to one key name different known generations or incarnations."""
    return bool(a.generation and b.generation and a.generation != b.generation) or \
        bool(a.incarnation and b.incarnation and a.incarnation != b.incarnation)


def checked_batches(micro_batches, samples: int) -> list[list[int]]:
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


def checked_lengths(total_lengths, samples: int) -> list[int]:
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


def checked_ranges(ranges, rows: int, sample: int) -> list:
    """A sample's explicit token ranges, each inside its ``rows``."""
    out = []
    for r in ranges:
        a, b = (int(v) for v in r)
        if not 0 <= a < b <= rows:
            raise InvalidInputError(f"sample {sample}: token range [{a}, {b}) is outside its {rows} rows")
        out.append((a, b))
    return out


def sample_totals(shard, where: str, batch: list, names: list, total_lengths) -> list:
    """Each sample's ``len(tokens)``: given, and then checked against R3's rows, or R3's rows + 1.

    Raises ``LayoutError`` naming ``where`` when a field is missing from some of ``batch``'s samples.
    """
    for name in names:
        if any(name not in shard[i] for i in batch):
            raise LayoutError(f"field {name!r} is missing from some samples of {where}")
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
