"""Field specs: what a per-token payload looks like stored and restored.

A field is a per-token payload that gputq can offload. Its :class:`FieldSpec`
says how one token's row is shaped, which compact dtype holds it in a
StorageUnit, which dtype the trainer gets back, what fills rows no step
produced, and which tokens of a sample carry it (``span``):

- ``"output"``: one row per generated token; the trainer wants it for the
  response only (``rollout_log_probs``), non-generated response tokens get
  ``fill``.
- ``"context"``: one row per context token except the last; the trainer
  wants ``[T-1, *row_shape]`` per sample (``rollout_routed_experts``).

:func:`canonicalize` is the gate every payload passes before it is stored:
it checks shape, dtype, NaNs and range, and converts to the compact dtype
without ever truncating, in one pass over the data.
"""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from gputq.data.packing import bits_for, check_ids, pack_rows_into, packed_row_bytes, packed_shape
from gputq.data.refs import check_fill, read_record
from gputq.kernels.host_native import narrow_rows_host, pack_rows_host
from gputq.errors import ConfigError, FieldValueError, InvalidInputError

__all__ = [
    "sample_key_of",
    "LOGPROBS",
    "ROUTED_EXPERTS",
    "ROUTED_EXPERTS_DTYPES",
    "ROUTED_EXPERTS_FORMATS",
    "SPANS",
    "FieldRegistry",
    "FieldSpec",
    "canonicalize",
    "logprobs_spec",
    "routed_experts_spec",
    "row_nbytes",
]

LOGPROBS = "logprobs"
ROUTED_EXPERTS = "routed_experts"
ROUTED_EXPERTS_DTYPES = ("uint8", "uint16", "int32")
#: What ``routed_experts_dtype`` may name: a stored dtype, ``packed`` (IDs at ``ceil(log2 E)`` bits,
#: see :mod:`gputq.data.packing`) or ``auto`` (the narrowest exact one for ``num_experts``).
ROUTED_EXPERTS_FORMATS = (*ROUTED_EXPERTS_DTYPES, "packed", "auto")
SPANS = ("output", "context")
_SPEC_SCHEMA = 1
# Source bytes converted and checked at a time: small enough that the check re-reads a chunk
# from cache (a core's L2 or its share of L3), large enough that numpy's per-call cost is noise.
_CHUNK_BYTES = 2 << 20


@dataclass(frozen=True)
class FieldSpec:
    """How one field is stored and restored.

    Parameters
    ----------
    name:
        Field name (``"logprobs"``, ``"routed_experts"``, ...).
    row_shape:
        Shape of one token's row; ``()`` for a scalar per token.
    dtype:
        Stored (compact) numpy dtype name.
    restored_dtype:
        Dtype the trainer receives; the stored dtype must cast to it safely.
    fill:
        Value of target rows that no stored fragment covers.
    span:
        ``"output"`` or ``"context"`` (see the module docstring).
    sample_key:
        Name of the restored tensor in a trainer sample; defaults to
        ``"rollout_<name>"``.
    num_experts:
        ``0``: each element is stored as ``dtype``. Else the field holds
        expert IDs below ``num_experts``, stored packed (``dtype`` uint8):
        the last axis of a row (K IDs) in ``ceil(K * b / 8)`` bytes at
        ``b = ceil(log2 num_experts)`` bits each, see
        :mod:`gputq.data.packing`; restored as int32.
    """

    name: str
    row_shape: tuple[int, ...]
    dtype: str
    restored_dtype: str
    fill: float | int
    span: str = "output"
    sample_key: str = field(default="")
    num_experts: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"field name must be a non-empty string, got {self.name!r}")
        shape = tuple(self.row_shape)
        if not all(isinstance(d, (int, np.integer)) and d > 0 for d in shape):
            raise ConfigError(f"field {self.name!r}: row_shape must hold positive ints, got {self.row_shape!r}")
        object.__setattr__(self, "row_shape", tuple(int(d) for d in shape))
        try:
            stored, restored = np.dtype(self.dtype), np.dtype(self.restored_dtype)
        except TypeError as exc:
            raise ConfigError(f"field {self.name!r}: unknown dtype ({exc})") from None
        if stored.kind not in "iuf" or restored.kind not in "iuf":
            raise ConfigError(f"field {self.name!r}: dtypes must be integer or float, got {stored}/{restored}")
        if not np.can_cast(stored, restored, "safe"):
            raise ConfigError(f"field {self.name!r}: stored dtype {stored} does not widen safely to {restored}")
        object.__setattr__(self, "dtype", stored.name)
        object.__setattr__(self, "restored_dtype", restored.name)
        object.__setattr__(self, "fill", check_fill(self.fill, restored, f"field {self.name!r}", ConfigError))
        if self.span not in SPANS:
            raise ConfigError(f"field {self.name!r}: span must be one of {SPANS}, got {self.span!r}")
        if not self.sample_key:
            object.__setattr__(self, "sample_key", sample_key_of(self.name))
        if self.num_experts:
            self._check_packing()

    def _check_packing(self) -> None:
        where = f"field {self.name!r}"
        bits_for(self.num_experts)  # a ConfigError past 16 bits
        if self.dtype != "uint8" or self.restored_dtype != "int32":
            raise ConfigError(f"{where}: packed IDs are stored as uint8 and restored as int32, got "
                              f"{self.dtype}/{self.restored_dtype}")
        if len(self.row_shape) not in (1, 2):
            raise ConfigError(f"{where}: packed IDs need rows [K] or [layers, K], got {self.row_shape}")

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The shape of one stored row in :attr:`dtype` (``row_shape``, or its packed bytes)."""
        return packed_shape(self.row_shape, self.num_experts) if self.num_experts else self.row_shape

    @property
    def integral(self) -> bool:
        """True when the field holds integer IDs (floats are then rejected)."""
        return np.dtype(self.dtype).kind in "iu"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe description (schema-versioned)."""
        record = {"schema": _SPEC_SCHEMA, "name": self.name, "row_shape": list(self.row_shape),
                  "dtype": self.dtype, "restored_dtype": self.restored_dtype, "fill": self.fill,
                  "span": self.span, "sample_key": self.sample_key}
        if self.num_experts:  # only packed specs carry it: readers of whole-dtype records see no change
            record["num_experts"] = self.num_experts
        return record

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FieldSpec:
        """Inverse of :meth:`to_dict`; raises ``InvalidInputError`` on a bad record."""
        rec = read_record(data, "FieldSpec", _SPEC_SCHEMA,
                          ("name", "row_shape", "dtype", "restored_dtype", "fill", "span", "sample_key"),
                          optional=("num_experts",))
        return cls(rec["name"], tuple(rec["row_shape"]), rec["dtype"], rec["restored_dtype"],
                   rec["fill"], rec["span"], rec["sample_key"], rec.get("num_experts", 0))


def sample_key_of(field: str) -> str:
    """The trainer's name for ``field`` (slime's ``rollout_log_probs`` for logprobs)."""
    return "rollout_log_probs" if field == LOGPROBS else f"rollout_{field}"


def logprobs_spec() -> FieldSpec:
    """The built-in ``logprobs`` field: float32 per generated token, fill 0.0."""
    return FieldSpec(LOGPROBS, (), "float32", "float32", 0.0, span="output")


def routed_experts_spec(num_layers: int, topk: int, dtype: str = "int32", num_experts: int = 0) -> FieldSpec:
    """The built-in ``routed_experts`` field: ``[num_layers, topk]`` IDs per token.

    Parameters
    ----------
    num_layers, topk:
        Recorded MoE layers and routing top-k.
    dtype:
        Stored format, one of :data:`ROUTED_EXPERTS_FORMATS`: ``uint8``,
        ``uint16``, ``int32``, ``packed`` or ``auto``; always restored as
        int32.
    num_experts:
        Routed experts E; ``packed`` and ``auto`` need it (nothing guesses
        it from the data). ``auto`` stores whole bytes where packing would
        save none (E = 256 in uint8, E = 65,536 in uint16), else packed.
    """
    if dtype not in ROUTED_EXPERTS_FORMATS:
        raise ConfigError(f"routed_experts dtype must be one of {ROUTED_EXPERTS_FORMATS}, got {dtype!r}")
    if dtype in ("packed", "auto"):
        if not num_experts:
            raise ConfigError(f"routed_experts dtype {dtype!r} needs num_experts (the model's routed experts)")
        dtype = _narrowest(topk, num_experts) if dtype == "auto" else "packed"
    if dtype != "packed":
        return FieldSpec(ROUTED_EXPERTS, (num_layers, topk), dtype, "int32", 0, span="context")
    return FieldSpec(ROUTED_EXPERTS, (num_layers, topk), "uint8", "int32", 0, span="context",
                     num_experts=num_experts)


def _narrowest(topk: int, num_experts: int) -> str:
    """The exact format of fewest bytes per row; a whole-byte one where it is as narrow (it restores by a cast)."""
    if num_experts > 1 << 16:
        return "int32"
    packed = packed_row_bytes(topk, bits_for(num_experts))
    for whole, itemsize in (("uint8", 1), ("uint16", 2)):
        if num_experts <= 1 << (8 * itemsize) and topk * itemsize <= packed:
            return whole
    return "packed"


def row_nbytes(spec: FieldSpec) -> int:
    """Stored bytes of one token's row of ``spec``."""
    return math.prod(spec.stored_shape) * np.dtype(spec.dtype).itemsize


class FieldRegistry:
    """An open set of field specs, looked up by name.

    Parameters
    ----------
    specs:
        Initial specs (registered in order).
    """

    def __init__(self, specs: tuple[FieldSpec, ...] | list[FieldSpec] = ()):
        self._specs: dict[str, FieldSpec] = {}
        for spec in specs:
            self.register(spec)

    @classmethod
    def builtin(cls, num_layers: int, topk: int, routed_experts_dtype: str = "int32",
                num_experts: int = 0) -> FieldRegistry:
        """A registry holding ``logprobs`` and ``routed_experts`` (see :func:`routed_experts_spec`)."""
        return cls([logprobs_spec(), routed_experts_spec(num_layers, topk, routed_experts_dtype, num_experts)])

    def register(self, spec: FieldSpec) -> FieldSpec:
        """Add ``spec``; re-registering an identical spec is a no-op, a different one an error."""
        if not isinstance(spec, FieldSpec):
            raise InvalidInputError(f"register() takes a FieldSpec, got {type(spec).__name__}")
        known = self._specs.get(spec.name)
        if known is not None and known != spec:
            raise ConfigError(f"field {spec.name!r} is already registered as {known}, not {spec}")
        self._specs[spec.name] = spec
        return spec

    def get(self, name: str) -> FieldSpec:
        """The spec of ``name``; raises ``InvalidInputError`` listing the known fields."""
        try:
            return self._specs[name]
        except KeyError:
            raise InvalidInputError(f"unknown field {name!r}; known fields: {list(self._specs)}") from None

    def names(self) -> tuple[str, ...]:
        """Registered field names, in registration order."""
        return tuple(self._specs)

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def __iter__(self):
        return iter(self._specs.values())

    def __len__(self) -> int:
        return len(self._specs)


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
    or an ID the stored dtype (or ``num_experts``) cannot hold (value and
    first index). Values are never truncated.

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
                                       if spec.num_experts else _narrowed_natively(where, arr, result, layer_major)):
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


def _narrowed_natively(where: str, arr: np.ndarray, result: np.ndarray, layer_major: bool) -> bool:
    """Store (and check) ``arr`` as ``result``'s whole-byte dtype with the host codec, in one pass; False where
    it cannot (see :func:`~gputq.kernels.host_native.narrow_rows_host`)."""
    stored = result.dtype
    limit = 0 if _widens(arr.dtype, stored) else int(np.iinfo(stored).max) + 1
    bad = narrow_rows_host(arr, limit, result, layer_major)
    if bad is None:
        return False
    if bad >= 0:
        row = bad // math.prod(arr.shape[1:])
        _check_range(where, arr[row:row + 1], result[:1], row)  # raises, naming the first bad value
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
