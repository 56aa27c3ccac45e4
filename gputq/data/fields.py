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

:func:`~gputq.data.canonical.canonicalize` is the gate every payload
passes before it is stored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from gputq.data.packing import bits_for, packed_row_bytes, packed_shape
from gputq.data.refs import check_fill, read_record
from gputq.errors import ConfigError, InvalidInputError

__all__ = [
    "sample_key_of",
    "LOGPROBS",
    "ROUTED_EXPERTS",
    "ROUTED_EXPERTS_DTYPES",
    "ROUTED_EXPERTS_FORMATS",
    "SPANS",
    "FieldRegistry",
    "FieldSpec",
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
    id_limit:
        ``0``: an integer field's values are bounded by its stored dtype.
        Else they are IDs checked in ``[0, id_limit)`` at put, as packed
        IDs are against ``num_experts`` (whole-byte expert IDs of a model
        with fewer experts than the dtype holds); at most the dtype's range.
    """

    name: str
    row_shape: tuple[int, ...]
    dtype: str
    restored_dtype: str
    fill: float | int
    span: str = "output"
    sample_key: str = field(default="")
    num_experts: int = 0
    id_limit: int = 0

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
        if self.id_limit:
            self._check_id_limit(stored)

    def _check_packing(self) -> None:
        where = f"field {self.name!r}"
        bits_for(self.num_experts)  # a ConfigError past 16 bits
        if self.dtype != "uint8" or self.restored_dtype != "int32":
            raise ConfigError(f"{where}: packed IDs are stored as uint8 and restored as int32, got "
                              f"{self.dtype}/{self.restored_dtype}")
        if len(self.row_shape) not in (1, 2):
            raise ConfigError(f"{where}: packed IDs need rows [K] or [layers, K], got {self.row_shape}")

    def _check_id_limit(self, stored: np.dtype) -> None:
        where = f"field {self.name!r}"
        limit = self.id_limit
        if isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or limit < 1:
            raise ConfigError(f"{where}: id_limit must be an int >= 1 (or 0: none), got {limit!r}")
        if stored.kind not in "iu" or self.num_experts:
            raise ConfigError(f"{where}: id_limit bounds whole-byte integer IDs, not {stored} "
                              f"{'packed IDs' if self.num_experts else 'values'}")
        if limit > int(np.iinfo(stored).max) + 1:
            raise ConfigError(f"{where}: {stored} holds IDs below {int(np.iinfo(stored).max) + 1}, not {limit}")
        object.__setattr__(self, "id_limit", int(limit))

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
        if self.id_limit:  # likewise: records of specs without it are as they were
            record["id_limit"] = self.id_limit
        return record

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FieldSpec:
        """Inverse of :meth:`to_dict`; raises ``InvalidInputError`` on a bad record."""
        rec = read_record(data, "FieldSpec", _SPEC_SCHEMA,
                          ("name", "row_shape", "dtype", "restored_dtype", "fill", "span", "sample_key"),
                          optional=("num_experts", "id_limit"))
        return cls(rec["name"], tuple(rec["row_shape"]), rec["dtype"], rec["restored_dtype"],
                   rec["fill"], rec["span"], rec["sample_key"], rec.get("num_experts", 0), rec.get("id_limit", 0))


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
        Given, every ID at or above it is refused at put, whatever
        the format (whole bytes: :attr:`FieldSpec.id_limit`).
    """
    if dtype not in ROUTED_EXPERTS_FORMATS:
        raise ConfigError(f"routed_experts dtype must be one of {ROUTED_EXPERTS_FORMATS}, got {dtype!r}")
    if dtype in ("packed", "auto"):
        if not num_experts:
            raise ConfigError(f"routed_experts dtype {dtype!r} needs num_experts (the model's routed experts)")
        dtype = _narrowest(topk, num_experts) if dtype == "auto" else "packed"
    if dtype != "packed":
        return FieldSpec(ROUTED_EXPERTS, (num_layers, topk), dtype, "int32", 0, span="context",
                         id_limit=num_experts)
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
