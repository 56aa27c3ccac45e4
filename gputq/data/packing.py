"""Expert IDs at the bits they need: one row of K IDs in ``ceil(K * b / 8)`` bytes, ``b = ceil(log2 E)``.

The packed format
-----------------
A row (one layer's K expert IDs of one token, in top-k order) is one bit
string, least significant bit first: ID ``j`` occupies bits
``[j * b, (j + 1) * b)`` of it, its own least significant bit first, and bit
``n`` of the string is bit ``n % 8`` of the row's byte ``n // 8``. The last
byte's unused high bits are zero. Rows are whole bytes, so a layer-major
blob keeps every layer contiguous and a token range of a layer is a byte
range: span reads move only the slice, as with whole-byte formats.

For example ``E = 384`` (``b = 9``), ``K = 2``, IDs ``[1, 300]``: bits
``1 0 0 0 0 0 0 0 0`` then ``0 0 1 1 0 1 0 0 1`` give the bytes
``0x01 0x58 0x02``.

Top-k order is kept (the MoE combine consumes experts in column order,
which changes BF16 accumulation): a set encoding would not be exact.

:func:`pack_rows` and :func:`unpack_rows` move whole arrays with a handful
of numpy operations per column of IDs (no Python loop over rows): each row
is assembled in 64-bit words, one shift and one OR per ID.
"""

from __future__ import annotations

import numpy as np

from gputq.errors import ConfigError, FieldValueError, InvalidInputError
from gputq.kernels.plan import packed_row_bytes
from gputq.kernels.reference import packed_words, unpack_rows_into

__all__ = ["MAX_BITS", "bits_for", "packed_row_bytes", "packed_shape", "pack_rows", "unpack_rows", "check_ids",
           "pack_rows_into"]

#: Widest ID packed: 16 bits, 65,536 experts (wider IDs are stored as int32).
MAX_BITS = 16


def bits_for(num_experts: int) -> int:
    """Bits one ID of ``num_experts`` experts needs: ``ceil(log2 E)``, at least 1."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer)) or num_experts < 1:
        raise ConfigError(f"num_experts must be an int >= 1, got {num_experts!r}")
    bits = max(1, (int(num_experts) - 1).bit_length())
    if bits > MAX_BITS:
        raise ConfigError(f"{num_experts} experts need {bits} bits per ID; packed IDs hold at most {MAX_BITS}")
    return bits


def packed_shape(row_shape: tuple, num_experts: int) -> tuple:
    """The stored shape of a row of IDs ``row_shape`` (``[..., K]``) packed for ``num_experts``: ``[..., bytes]``."""
    return (*row_shape[:-1], packed_row_bytes(row_shape[-1], bits_for(num_experts)))


def check_ids(where: str, ids: np.ndarray, num_experts: int, row0: int = 0) -> None:
    """Raise ``FieldValueError`` naming the first ID outside ``[0, num_experts)``.

    ``ids`` may be rows ``row0``... of a larger payload: the index named
    counts from the payload's first row.
    """
    if not ids.size:
        return
    low, high = int(np.minimum.reduce(ids, axis=None)), int(np.maximum.reduce(ids, axis=None))
    if low >= 0 and high < num_experts:
        return
    flat = np.flatnonzero((ids < 0) | (ids >= num_experts))[0]
    index = [int(i) for i in np.unravel_index(flat, ids.shape)]
    index[0] += row0
    raise FieldValueError(f"{where}: expert ID {int(ids.reshape(-1)[flat])} at index {index} is outside "
                          f"[0, {num_experts}) (num_experts {num_experts}); nothing was stored")


def pack_rows(ids, num_experts: int, *, where: str = "routed_experts", out: np.ndarray | None = None
              ) -> np.ndarray:
    """Pack ``ids`` ``[..., K]`` (any integer dtype) into uint8 ``[..., ceil(K * b / 8)]``.

    Every ID is checked first: one that is negative or ``>= num_experts``
    raises :class:`~gputq.errors.FieldValueError` naming it, its index and
    ``where``; nothing is truncated. ``out`` (C-contiguous uint8 of the
    packed shape) receives the result when given.
    """
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu" or ids.ndim < 1 or ids.shape[-1] < 1:
        raise FieldValueError(f"{where}: expected an integer array of rows of IDs, got {ids.dtype}{ids.shape}")
    bits = bits_for(num_experts)
    check_ids(where, ids, num_experts)
    topk = ids.shape[-1]
    row_bytes = packed_row_bytes(topk, bits)
    shape = (*ids.shape[:-1], row_bytes)
    rows = ids.reshape(-1, topk)
    if out is None:
        target = np.empty(len(rows) * row_bytes, np.uint8)
    else:
        target = _checked_out(out, np.uint8, len(rows) * row_bytes, "out")
    pack_rows_into(rows, bits, target.reshape(-1, row_bytes))
    return target.reshape(shape)


def pack_rows_into(rows: np.ndarray, bits: int, out: np.ndarray) -> np.ndarray:
    """Pack checked IDs ``rows`` ``[n, K]`` into uint8 ``out`` ``[n, packed_row_bytes(K, bits)]`` (any strides).

    No ID is checked here: :func:`check_ids` them first (an ID of more than
    ``bits`` bits would spill into its neighbour).
    """
    topk = rows.shape[-1]
    acc = np.zeros((len(rows), packed_words(topk, bits)), np.uint64)
    for j in range(topk):
        word, shift = divmod(j * bits, 64)
        column = rows[:, j].astype(np.uint64)
        acc[:, word] |= column << np.uint64(shift)
        if shift + bits > 64:
            acc[:, word + 1] |= column >> np.uint64(64 - shift)
    out[...] = acc.astype("<u8", copy=False).view(np.uint8)[:, :out.shape[-1]]
    return out


def unpack_rows(packed, topk: int, num_experts: int, *, out: np.ndarray | None = None) -> np.ndarray:
    """Unpack uint8 ``[..., ceil(K * b / 8)]`` rows into int32 ``[..., K]`` (or into ``out``)."""
    packed = np.asarray(packed)
    if isinstance(topk, bool) or not isinstance(topk, (int, np.integer)) or topk < 1:
        raise FieldValueError(f"topk must be an int >= 1 (IDs in a row), got {topk!r}")
    bits = bits_for(num_experts)
    row_bytes = packed_row_bytes(topk, bits)
    if packed.dtype != np.uint8 or packed.ndim < 1 or packed.shape[-1] != row_bytes:
        raise FieldValueError(f"packed rows of {topk} IDs at {bits} bits are uint8 [..., {row_bytes}], "
                              f"got {packed.dtype}{packed.shape}")
    rows = packed.reshape(-1, row_bytes)
    if out is None:
        result = np.empty((*packed.shape[:-1], topk), np.int32)
    else:
        result = _checked_out(out, np.int32, len(rows) * topk, "out").reshape((*packed.shape[:-1], topk))
    unpack_rows_into(rows, topk, bits, result.reshape(-1, topk))
    return result


def _checked_out(out, dtype, size: int, what: str) -> np.ndarray:
    """``out`` if it is a writable C-contiguous array of ``size`` elements of ``dtype`` (a reshape of anything
    else would be a copy, and the result would be written where the caller never looks)."""
    if not (isinstance(out, np.ndarray) and out.dtype == dtype and out.size == size and out.flags.c_contiguous
            and out.flags.writeable):
        raise InvalidInputError(f"{what} must be a writable C-contiguous {np.dtype(dtype)} array of {size} "
                                f"elements")
    return out
