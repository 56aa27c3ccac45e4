"""The gate every payload passes before it is stored: checked against its field's spec, then compacted.

:func:`canonicalize` checks a payload's shape, dtype, NaNs and range and
converts it to the field's compact stored dtype (packing IDs where the spec
says so), never truncating, in one pass over the data: the payload goes
through in chunks that stay in a core's cache, each converted and checked
while it is still there. Layer-major fields are transposed in the same
pass. The host codec (:mod:`gputq.kernels.host_native`) does the pass in C
where it loads; numpy does it otherwise, with the same results and errors.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Any

import numpy as np

from gputq.data.fields import FieldSpec, row_nbytes
from gputq.data.packing import bits_for, check_ids, pack_rows_into
from gputq.errors import FieldValueError, InvalidInputError
from gputq.kernels.host_native import narrow_rows_host, pack_rows_host

__all__ = ["canonicalize"]

# Source bytes converted and checked at a time: small enough that the check re-reads a chunk
# from cache (a core's L2 or its share of L3), large enough that numpy's per-call cost is noise.
_CHUNK_BYTES = 2 << 20


def canonicalize(key: str, spec: FieldSpec, array: Any, *, out: np.ndarray | None = None,
                 layer_major: bool = False) -> np.ndarray:
    """Check ``array`` against ``spec`` and return it in the stored dtype.

    Returns a C-contiguous array of ``spec.dtype`` with shape
    ``[rows, *spec.stored_shape]``, or with ``layer_major`` (rows of two or
    more dimensions only) ``[stored_shape[0], rows, *stored_shape[1:]]``:
    the order such blobs are stored in (see :mod:`gputq.data.slices`). A
    packed spec's IDs are packed in that same pass. Raises
    :class:`~gputq.errors.FieldValueError` naming ``key`` and the field for
    a wrong shape, a float array for an integer field, a NaN (first index)
    or an ID the stored dtype cannot hold, or at or above the spec's
    ``num_experts`` (packed) or ``id_limit`` (value and first index).
    Values are never truncated.

    Checking and converting are one pass: the array goes through in chunks
    that stay in a core's cache, each converted and then checked while it is
    still there, so the payload is read from memory once.

    Parameters
    ----------
    key, spec, array:
        The stored key (for messages), the field's spec and the payload.
    out:
        Where the result goes: a writable C-contiguous uint8 array of at
        least ``rows * row_nbytes(spec)`` bytes, which the result views. With
        it the caller always gets its own copy, made in that same pass.
        Without it, an input that already is C-contiguous in the stored
        dtype is returned as is (after its check), else a new array.
    """
    where = f"key {key!r} field {spec.name!r}"
    arr = np.asarray(array)
    check = _input_check(where, spec, arr)
    stored = np.dtype(spec.dtype)
    if out is None and not (layer_major or spec.num_experts) and arr.dtype == stored and arr.flags.c_contiguous:
        if check is not None:
            check(where, arr, arr, 0)
        return arr
    shape = (arr.shape[0], *spec.stored_shape)
    result = np.empty(shape, stored) if out is None else _into(where, out, arr.shape[0] * row_nbytes(spec), stored,
                                                                shape)
    if arr.size and spec.integral and (_packed_natively(where, arr, result, spec.num_experts, layer_major)
                                       if spec.num_experts else
                                       _narrowed_natively(where, arr, result, layer_major, spec.id_limit)):
        return result.reshape(-1).reshape((shape[1], shape[0], *shape[2:])) if layer_major else result
    convert = _packer(where, spec.num_experts) if spec.num_experts else _converter(where, check)
    narrowing_floats = check is _check_nan and arr.dtype.itemsize > stored.itemsize
    # A float64 beyond float32's range becomes inf, as with astype, without a warning.
    with np.errstate(over="ignore") if narrowing_floats else contextlib.nullcontext():
        if layer_major:
            return _to_layer_major(where, arr, result, convert)
        if (check is None and not spec.num_experts) or not arr.size:
            np.copyto(result, arr, casting="unsafe")  # nothing to check: a widening cast, or no rows
            return result
        step = max(1, _CHUNK_BYTES // arr[:1].nbytes)
        for start in range(0, arr.shape[0], step):
            convert(arr[start:start + step], result[start:start + step], start)
    return result


def _input_check(where: str, spec: FieldSpec, arr: np.ndarray):
    """Refuse a wrong shape or kind of ``arr``; return the check its values need (range, NaN), or None."""
    if arr.ndim != 1 + len(spec.row_shape) or tuple(arr.shape[1:]) != spec.row_shape:
        raise FieldValueError(f"{where}: expected shape [{', '.join(map(str, ('rows', *spec.row_shape)))}], "
                              f"got {arr.shape}")
    if spec.integral:
        if arr.dtype.kind not in "iu":
            raise FieldValueError(f"{where}: expected an integer array, got dtype {arr.dtype}")
        if spec.id_limit:
            return lambda where, src, dst, row0: check_ids(where, src, spec.id_limit, row0)
        return None if _widens(arr.dtype, np.dtype(spec.dtype)) else _check_range
    if arr.dtype.kind != "f":
        raise FieldValueError(f"{where}: expected a floating-point array, got dtype {arr.dtype}")
    return _check_nan


def _into(where: str, out, nbytes: int, stored: np.dtype, shape: tuple) -> np.ndarray:
    """``out``'s first ``nbytes`` as the result, if it is a writable contiguous uint8 array that large."""
    if not (isinstance(out, np.ndarray) and out.dtype == np.uint8 and out.ndim == 1
            and out.flags.c_contiguous and out.flags.writeable and out.nbytes >= nbytes):
        raise InvalidInputError(f"{where}: out must be a writable contiguous uint8 array of at least {nbytes} bytes")
    return out[:nbytes].view(stored).reshape(shape)


def _converter(where: str, check):
    """``convert(src, dst, row0)``: rows ``row0``... of a payload cast into ``dst``, then checked there."""
    def convert(src: np.ndarray, dst: np.ndarray, row0: int) -> None:
        np.copyto(dst, src, casting="unsafe")
        if check is not None:
            check(where, src, dst, row0)
    return convert


def _packed_natively(where: str, arr: np.ndarray, result: np.ndarray, num_experts: int, layer_major: bool) -> bool:
    """Pack (and check) ``arr`` into ``result`` with the host codec, in one pass; False where it cannot."""
    bad = pack_rows_host(arr, bits_for(num_experts), num_experts, result, layer_major)
    if bad is None:
        return False
    if bad >= 0:
        row = bad // math.prod(arr.shape[1:])
        check_ids(where, arr[row:row + 1], num_experts, row)  # raises, naming the first bad ID
    return True


def _narrowed_natively(where: str, arr: np.ndarray, result: np.ndarray, layer_major: bool, id_limit: int) -> bool:
    """Store (and check) ``arr`` as ``result``'s whole-byte dtype with the host codec, in one pass; False where
    it cannot (see :func:`~gputq.kernels.host_native.narrow_rows_host`). Each ID is checked below ``id_limit``
    where it is given, else within the stored dtype's range."""
    stored = result.dtype
    limit = id_limit or (0 if _widens(arr.dtype, stored) else int(np.iinfo(stored).max) + 1)
    bad = narrow_rows_host(arr, limit, result, layer_major)
    if bad is None:
        return False
    if bad >= 0:  # raises, naming the first bad value
        row = bad // math.prod(arr.shape[1:])
        if id_limit:
            check_ids(where, arr[row:row + 1], id_limit, row)
        _check_range(where, arr[row:row + 1], result[:1], row)
    return True


def _packer(where: str, num_experts: int):
    """``convert(src, dst, row0)``: rows ``row0``... of IDs checked below ``num_experts``, then packed into ``dst``."""
    bits = bits_for(num_experts)

    def convert(src: np.ndarray, dst: np.ndarray, row0: int) -> None:
        check_ids(where, src, num_experts, row0)
        pack_rows_into(src.reshape(-1, src.shape[-1]), bits, dst.reshape(-1, dst.shape[-1]))
    return convert


def _to_layer_major(where: str, arr: np.ndarray, result: np.ndarray, convert) -> np.ndarray:
    """``arr`` ``[rows, L, ...]`` converted (and checked) into ``result``'s memory as ``[L, rows, ...]``.

    Chunk by chunk of tokens: converted (and checked) into a scratch chunk
    that stays in cache, then moved into every layer's run with each
    token's stored ``[...]`` as one item, which numpy copies whole (a
    transposing copy element by element runs at a quarter of the speed).
    """
    if arr.ndim < 3:
        raise InvalidInputError(f"{where}: layer-major storage needs rows of two or more dimensions, "
                                f"got shape {arr.shape}")
    rows, layers, inner = result.shape[0], result.shape[1], result.shape[2:]
    result = result.reshape(-1).reshape((layers, rows, *inner))
    if not rows:
        return result
    item = np.dtype((np.void, result[0, 0].nbytes))
    by_layer = result.view(item).reshape(layers, rows) if result[0, 0].nbytes else None
    step = max(1, _CHUNK_BYTES // max(1, arr[:1].nbytes))
    scratch = _scratch(min(step, rows) * result[:, 0].nbytes).view(result.dtype).reshape(
        (min(step, rows), layers, *inner))
    for start in range(0, rows, step):
        src = arr[start:start + step]
        chunk = scratch[:len(src)]
        convert(src, chunk, start)
        if by_layer is not None:
            np.copyto(by_layer[:, start:start + len(src)], chunk.view(item).reshape(len(src), layers).T)
    return result


_local = threading.local()


def _scratch(nbytes: int) -> np.ndarray:
    """This thread's scratch bytes for one chunk (puts run on the caller's threads)."""
    buffer = getattr(_local, "scratch", None)
    if buffer is None or buffer.nbytes < nbytes:
        buffer = _local.scratch = np.empty(nbytes, np.uint8)
    return buffer[:nbytes]


def _widens(source: np.dtype, stored: np.dtype) -> bool:
    """``np.can_cast(source, stored, "safe")``, remembered: it costs microseconds and put runs it per field."""
    known = _WIDENS.get((source, stored))
    if known is None:
        known = _WIDENS[(source, stored)] = bool(np.can_cast(source, stored, "safe"))
    return known


_WIDENS: dict[tuple[np.dtype, np.dtype], bool] = {}


def _check_range(where: str, src: np.ndarray, dst: np.ndarray, row0: int) -> None:
    """Raise if a value of ``src`` (rows ``row0``... of the payload) does not fit ``dst``'s dtype."""
    stored = dst.dtype
    info = np.iinfo(stored)
    if stored.kind == "u" and src.dtype.itemsize > stored.itemsize:
        # Negative IDs read as unsigned are huge, so one max checks both ends. The view keeps the
        # input's byte order: a big-endian array read as native would check other numbers.
        unsigned = src.view(np.dtype(f"u{src.dtype.itemsize}").newbyteorder(src.dtype.byteorder))
        if int(np.maximum.reduce(unsigned, axis=None)) <= info.max:
            return
    elif info.min <= int(np.minimum.reduce(src, axis=None)) and int(np.maximum.reduce(src, axis=None)) <= info.max:
        return
    bad = np.flatnonzero((src < info.min) | (src > info.max))[0]
    index = np.unravel_index(bad, src.shape)
    value = int(src.reshape(-1)[bad])
    raise FieldValueError(f"{where}: value {value} at index {_fmt_index((index[0] + row0, *index[1:]))} "
                          f"does not fit {stored} (range [{info.min}, {info.max}])")


def _check_nan(where: str, src: np.ndarray, dst: np.ndarray, row0: int) -> None:
    """Raise at the first NaN of ``dst`` (the converted rows ``row0``... of the payload)."""
    # One reduction first: the sum is NaN if any element is (or if +inf and -inf mix).
    with np.errstate(all="ignore"):
        if not np.isnan(np.add.reduce(dst, axis=None)):
            return
    nans = np.flatnonzero(np.isnan(dst))
    if nans.size:
        index = np.unravel_index(nans[0], dst.shape)
        raise FieldValueError(f"{where}: NaN at index {_fmt_index((index[0] + row0, *index[1:]))}")


def _fmt_index(index: tuple) -> str:
    return "[" + ", ".join(str(int(i)) for i in index) + "]"
