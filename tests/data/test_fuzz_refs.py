"""Fuzz: records from ``from_dict`` and payloads through ``canonicalize``.

Any dict (or any value at all) read as a FieldRef or Layout gives the
object or ``InvalidInputError``, never another exception. Any payload
through ``canonicalize`` gives exactly its values in the stored dtype or a
``FieldValueError`` whose message a plain whole-array reference predicts.
A small sample runs in the default suite, 10,000 cases each under
``-m slow``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402

from gputq.data import canonical  # noqa: E402
from gputq.data.canonical import canonicalize  # noqa: E402
from gputq.data.fields import FieldSpec, row_nbytes  # noqa: E402
from gputq.data.refs import FieldRef, Fragment, Layout  # noqa: E402
from gputq.errors import FieldValueError, InvalidInputError  # noqa: E402

FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=10_000, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- records ---------------------------------------------------------------

scalars = (st.none() | st.booleans() | st.integers() | st.integers(-3, 2**64) | st.floats()
           | st.text(max_size=8) | st.binary(max_size=8)
           | st.sampled_from(["uint8", "int32", "float32", "float16", ">i4", "i4,i4", "O", "M8", "S3", "", "V8"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
                      | st.dictionaries(st.text(max_size=6) | st.integers(), inner, max_size=4), max_leaves=12)

_REF = FieldRef("s/0/routed_experts", "routed_experts", "su-0", 6, "uint16", (3, 2), "p", "00ff00ff00ff00ff", 42)


def _ref_records():
    base = _REF.to_dict()
    mutate = st.dictionaries(st.sampled_from(sorted(base) + ["extra"]), values, max_size=3)
    drop = st.sets(st.sampled_from(sorted(base)), max_size=2)
    return st.builds(lambda m, d: {k: v for k, v in (base | m).items() if k not in d}, mutate, drop)


def _layout_records():
    other = FieldRef("s/1/routed_experts", "routed_experts", "su-1", 4, "uint8", (3, 2), "p", "", 0)
    layout = Layout("routed_experts", 12, 0, (Fragment(_REF, 1, 0, 5), Fragment(other, 0, 7, 4)), "int32", (3, 2))
    base = layout.to_dict()
    keys = sorted(base) + ["extra"]
    fragment = st.lists(st.integers(-2, 20) | values, min_size=0, max_size=5)
    mutate = st.dictionaries(st.sampled_from(keys), values | st.lists(fragment, max_size=3), max_size=3)
    refs = st.lists(_ref_records(), max_size=3)
    return st.builds(lambda m, r, use_r: base | m | ({"refs": r} if use_r else {}), mutate, refs, st.booleans())


def _check_record(cls, record):
    """``cls.from_dict(record)`` (checked to round-trip), or the InvalidInputError it raised."""
    try:
        obj = cls.from_dict(record)
    except InvalidInputError as exc:
        return exc
    assert isinstance(obj, cls)
    text = json.dumps(obj.to_dict())  # compared as text: a NaN fill is not equal to itself
    assert json.dumps(cls.from_dict(json.loads(text)).to_dict()) == text
    return obj


def _fuzz_records(data) -> list:
    """Read fuzzed records as FieldRef and Layout; what each read gave."""
    kind = data.draw(st.sampled_from(["ref", "layout", "anything"]))
    if kind == "ref":
        return [_check_record(FieldRef, data.draw(_ref_records()))]
    if kind == "layout":
        return [_check_record(Layout, data.draw(_layout_records()))]
    thing = data.draw(values)
    return [_check_record(FieldRef, thing), _check_record(Layout, thing)]


@FAST
@given(st.data())
def test_records_give_the_object_or_invalid_input(data):
    outcomes = _fuzz_records(data)
    assert outcomes and all(isinstance(o, (FieldRef, Layout, InvalidInputError)) for o in outcomes), outcomes


@pytest.mark.slow
@pytest.mark.timeout(900)
@SLOW
@given(st.data())
def test_records_give_the_object_or_invalid_input_10k(data):
    outcomes = _fuzz_records(data)
    assert outcomes and all(isinstance(o, (FieldRef, Layout, InvalidInputError)) for o in outcomes), outcomes


def test_valid_records_round_trip_unchanged():
    assert FieldRef.from_dict(_REF.to_dict()) == _REF
    assert FieldRef.from_dict(_REF.to_dict()).generation == 42


# -- payloads --------------------------------------------------------------

SPECS = [
    FieldSpec("routed_experts", (3, 2), "uint8", "int32", 0, span="context"),
    FieldSpec("routed_experts", (3, 2), "uint16", "int32", 0, span="context"),
    FieldSpec("routed_experts", (3, 2), "int32", "int32", 0, span="context"),
    FieldSpec("logprobs", (), "float32", "float32", 0.0),
    FieldSpec("entropy", (2,), "float16", "float32", 0.0),
]
DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "float32", "float64"]


def _index(flat: int, shape) -> str:
    return "[" + ", ".join(str(int(i)) for i in np.unravel_index(flat, shape)) + "]"


def _expected_error(key: str, spec: FieldSpec, arr: np.ndarray) -> str | None:
    """The message canonicalize must raise, from a plain whole-array reading; None if it must not."""
    where = f"key {key!r} field {spec.name!r}"
    if arr.ndim != 1 + len(spec.row_shape) or tuple(arr.shape[1:]) != spec.row_shape:
        return f"{where}: expected shape [{', '.join(map(str, ('rows', *spec.row_shape)))}], got {arr.shape}"
    stored = np.dtype(spec.dtype)
    if spec.integral:
        if arr.dtype.kind not in "iu":
            return f"{where}: expected an integer array, got dtype {arr.dtype}"
        info = np.iinfo(stored)
        for i, value in enumerate(arr.reshape(-1).tolist()):
            if not info.min <= value <= info.max:
                return (f"{where}: value {value} at index {_index(i, arr.shape)} does not fit {stored} "
                        f"(range [{info.min}, {info.max}])")
        return None
    if arr.dtype.kind != "f":
        return f"{where}: expected a floating-point array, got dtype {arr.dtype}"
    nans = np.flatnonzero(np.isnan(arr))
    return f"{where}: NaN at index {_index(nans[0], arr.shape)}" if nans.size else None


@st.composite
def _payloads(draw):
    spec = draw(st.sampled_from(SPECS))
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    rows = draw(st.integers(0, 9))
    shape = (rows, *spec.row_shape) if draw(st.integers(0, 9)) else \
        draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
    if dtype.kind == "f":
        elements = st.floats(width=8 * dtype.itemsize, allow_nan=True, allow_infinity=True)
    elif dtype.kind == "b":
        elements = st.booleans()
    else:
        info = np.iinfo(dtype)
        # Mostly small IDs, with the edges of every stored dtype and of the input dtype.
        edges = [v for v in (-1, 0, 255, 256, 65535, 65536, 2**31 - 1, 2**31, -2**31 - 1, info.min, info.max)
                 if info.min <= v <= info.max]
        elements = st.integers(0, min(info.max, 300)) | st.sampled_from(edges)
    arr = draw(hnp.arrays(dtype, shape, elements=elements))
    if arr.ndim and arr.shape[0] > 1 and draw(st.booleans()):
        arr = arr[::2]  # not contiguous
    return spec, arr


def _fuzz_payload(data):
    """Canonicalize a fuzzed payload; the stored array (checked exact), or the FieldValueError predicted."""
    spec, arr = data.draw(_payloads())
    use_out = data.draw(st.booleans())
    chunk = data.draw(st.sampled_from([1, 7, 64, 1 << 20]))  # chunk edges land anywhere
    expected = _expected_error("k", spec, arr)
    before = arr.copy()
    saved = canonical._CHUNK_BYTES
    canonical._CHUNK_BYTES = chunk
    try:
        out = None
        if use_out and arr.ndim:
            out = np.full(arr.shape[0] * row_nbytes(spec) + 3, 0xAB, np.uint8)
        try:
            got = canonicalize("k", spec, arr, out=out)
        except FieldValueError as exc:
            assert str(exc) == expected
            return exc
    finally:
        canonical._CHUNK_BYTES = saved
    assert expected is None, expected
    stored = np.dtype(spec.dtype)
    assert got.dtype == stored and got.shape == arr.shape and got.flags.c_contiguous
    with np.errstate(over="ignore"):
        assert np.array_equal(got, arr.astype(stored), equal_nan=False)  # exact: no NaN got through
    if stored.kind in "iu":
        assert [int(v) for v in got.reshape(-1).tolist()] == [int(v) for v in arr.reshape(-1).tolist()]
    if out is not None and got.size:
        assert np.shares_memory(got, out) and not np.shares_memory(got, arr)
    assert np.array_equal(arr, before, equal_nan=True)  # the caller's array is never written
    return got


@FAST
@given(st.data())
def test_payloads_give_exact_values_or_field_value_error(data):
    outcome = _fuzz_payload(data)
    assert isinstance(outcome, (np.ndarray, FieldValueError)), outcome


@pytest.mark.slow
@pytest.mark.timeout(900)
@SLOW
@given(st.data())
def test_payloads_give_exact_values_or_field_value_error_10k(data):
    outcome = _fuzz_payload(data)
    assert isinstance(outcome, (np.ndarray, FieldValueError)), outcome
