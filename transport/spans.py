"""Byte spans of a read: the parts of its keys' blobs that leave the unit.

A read may name, instead of whole keys, *spans*: rows ``(key index, offset,
nbytes)`` of an int64 ``[m, 3]`` array, each a byte range inside one of the
read's keys' blobs. The unit then sends (tcp) or lends (shm, rdma) exactly
those ranges, back to back in row order, and counts exactly those bytes as
read. What a span means (a pipeline stage's layers, a context-parallel
rank's tokens) is the caller's business: the unit only checks that every
span lies inside its key's blob.

On the wire spans travel as the little-endian bytes of that array, under
``"spans"`` in a READ body or a ``"lease"`` call; a request without them
reads whole keys, as before.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from gputq.errors import InvalidInputError

__all__ = ["MAX_SPANS", "SPAN_WIRE_BYTES", "as_spans", "spans_to_wire", "spans_from_wire", "span_regions"]

#: Bytes of one span on the wire: three little-endian int64 (key index, offset, nbytes).
SPAN_WIRE_BYTES = 24
#: Spans per request: a READ body must fit a control frame.
MAX_SPANS = 1 << 15


def as_spans(spans, nkeys: int) -> np.ndarray:
    """``spans`` as a checked int64 ``[m, 3]`` array of (key index, offset, nbytes).

    Raises
    ------
    InvalidInputError
        Not ``[m, 3]`` integers, more than :data:`MAX_SPANS` rows, a key
        index outside ``[0, nkeys)``, or a negative offset or length.
    """
    array = np.asarray(spans)
    if array.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    if array.ndim != 2 or array.shape[1] != 3 or array.dtype.kind not in "iu":
        raise InvalidInputError(f"spans must be integers of shape [m, 3] (key index, offset, nbytes), "
                                f"got {array.dtype} {array.shape}")
    if len(array) > MAX_SPANS:
        raise InvalidInputError(f"{len(array)} spans in one read, more than {MAX_SPANS}; split it")
    array = np.ascontiguousarray(array, dtype=np.int64)
    # Two reductions, not one per check: every read request is checked on both sides.
    lowest, highest = array.min(axis=0).tolist(), int(array[:, 0].max())
    if lowest[0] < 0 or highest >= nkeys:
        raise InvalidInputError(f"a span names key index {highest if highest >= nkeys else lowest[0]}"
                                f"; the read has {nkeys} keys")
    if min(lowest[1:]) < 0:
        row = int(np.flatnonzero((array[:, 1:] < 0).any(axis=1))[0])
        raise InvalidInputError(f"span {row} {array[row].tolist()} has a negative offset or length")
    return array


def spans_to_wire(spans, nkeys: int) -> bytes:
    """The wire form of ``spans`` (checked with :func:`as_spans`)."""
    return as_spans(spans, nkeys).astype("<i8", copy=False).tobytes()


def spans_from_wire(raw, nkeys: int) -> np.ndarray | None:
    """Decode a request's ``"spans"`` (``None``: whole keys); raises ``InvalidInputError``."""
    if raw is None:
        return None
    if not isinstance(raw, (bytes, bytearray)) or len(raw) % SPAN_WIRE_BYTES:
        raise InvalidInputError("spans must be bytes of little-endian int64 (key index, offset, nbytes) rows")
    return as_spans(np.frombuffer(raw, dtype="<i8").reshape(-1, 3), nkeys)


def span_regions(regions: np.ndarray, spans: np.ndarray | None, keys: Sequence[str], unit: str) -> np.ndarray:
    """The arena regions ``(offset, nbytes)`` of ``spans`` of keys leased at ``regions``.

    ``regions`` is int64 ``[n, 2]``, one whole-blob region per key. With
    ``spans`` ``None`` it is returned as it is.

    Raises
    ------
    InvalidInputError
        A span reaches past its key's blob; names the unit, key and span.
    """
    if spans is None:
        return regions
    blob = regions[spans[:, 0]]
    # offset > size - nbytes, not offset + nbytes > size: the sum can overflow int64.
    outside = spans[:, 1] > blob[:, 1] - spans[:, 2]
    if outside.any():
        row = int(np.flatnonzero(outside)[0])
        index, offset, nbytes = spans[row].tolist()
        raise InvalidInputError(f"unit {unit}: span {row} (bytes [{offset}, {offset + nbytes})) is outside key "
                                f"{keys[index]!r}, which holds {int(blob[row, 1])} bytes")
    out = np.empty((len(spans), 2), dtype=np.int64)
    out[:, 0] = blob[:, 0] + spans[:, 1]
    out[:, 1] = spans[:, 2]
    return out
