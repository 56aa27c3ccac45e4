"""Fuzzed calls into a StorageUnit: whatever a remote peer sends, the unit answers with a
msgpack-able result or a typed error, and stays consistent."""

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gputq.errors import GputqError, InvalidInputError, StaleReadError, UnknownKeyError
from gputq.unit.storage_unit import CONTROL_METHODS, StorageUnit

KIB = 1024
KEYS = ["a", "b", "c"]
PARAMS = ["keys", "partition", "missing_ok", "release_id", "from_partition", "to_partition", "after", "limit"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=8),
                    st.binary(max_size=8), st.sampled_from(KEYS + ["p", "q", "default"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=4), inner, max_size=3)),
                      max_leaves=8)
key_lists = st.one_of(st.lists(st.sampled_from(KEYS + ["zz"]), max_size=4), values)
methods = st.one_of(st.sampled_from(sorted(CONTROL_METHODS)), st.text(max_size=10), values)
args = st.one_of(st.dictionaries(st.one_of(st.sampled_from(PARAMS), st.text(max_size=6)),
                                 st.one_of(key_lists, values), max_size=4), values)
timeouts = st.sampled_from([None, 0, 0.0, -1, float("nan"), "1", True, [], {}])


@pytest.fixture(scope="module")
def unit():
    with StorageUnit("su-fuzz", 256 * KIB, put_timeout_s=0) as su:
        yield su


def _stored(unit, key):
    try:
        unit.lookup([key])
    except UnknownKeyError:
        return False
    return True


def _restock(unit):
    for key in KEYS:
        if not _stored(unit, key):
            unit.abort_write(key)
            unit.put(key, np.full(100, ord(key), np.uint8), {"partition": "p", "generation": ord(key)})


def _check_consistent(unit):
    stats = unit.stats()
    assert stats["leases"] == 0 and stats["writers_waiting"] == 0
    listed = unit.keys()
    assert all(count >= 1 for keys in listed["partitions"].values() for count in keys.values())
    for key in KEYS:
        if _stored(unit, key):
            assert unit.read([key])[0].tolist() == [ord(key)] * 100


#: What a malformed or unlucky control call may raise.
CONTROL_ERRORS = (InvalidInputError, UnknownKeyError)


def _control_case(unit, method, arguments):
    """One fuzzed control call: its msgpack-packed result, or the GputqError it raised."""
    _restock(unit)
    try:
        outcome = msgpack.packb(unit.control(method, arguments))
    except GputqError as exc:
        outcome = exc
    _check_consistent(unit)
    return outcome


def _handler_case(unit, key, nbytes, meta, timeout, keys, generations, incarnation, lease_id):
    """Fuzzed transport-handler calls (write, leases, commit, abort); the unit's stats after them."""
    _restock(unit)
    try:
        unit.begin_write(key, nbytes, meta, timeout)
    except GputqError as exc:
        assert type(exc).__name__ in {"InvalidInputError", "DuplicateKeyError", "RequestTooLargeError",
                                      "CapacityError"}, exc
    else:
        unit.abort_write(key)
    for call in (lambda: unit.lease(keys, generations, incarnation),
                 lambda: unit.lease_regions(keys, generations, incarnation, expires=False)):
        try:
            lease = call()
        except (InvalidInputError, UnknownKeyError, StaleReadError):
            continue
        assert unit.end_lease(lease[0] if isinstance(lease, tuple) else lease.lease_id) is True
    for call in (lambda: unit.end_lease(lease_id), lambda: unit.commit_write(key), lambda: unit.abort_write(key)):
        try:
            call()
        except (InvalidInputError, UnknownKeyError):
            pass
    _check_consistent(unit)
    return unit.stats()


handler_args = dict(key=st.one_of(st.sampled_from(KEYS + ["new"]), values),
                    nbytes=st.one_of(st.integers(-5, 300 * KIB), values), meta=st.one_of(
                        st.fixed_dictionaries({}, optional={"partition": values, "generation": values}), values),
                    timeout=timeouts, keys=key_lists, generations=values,
                    incarnation=st.one_of(st.none(), st.text(max_size=16), values),
                    lease_id=st.one_of(st.integers(-2**64, 2**64), values))

FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
                database=None)


@settings(FUZZ, max_examples=100)
@given(method=methods, arguments=args)
def test_fuzzed_control_calls_answer_or_raise_typed_errors(unit, method, arguments):
    outcome = _control_case(unit, method, arguments)
    assert isinstance(outcome, (bytes, *CONTROL_ERRORS)), outcome


@settings(FUZZ, max_examples=100)
@given(**handler_args)
def test_fuzzed_handler_calls_answer_or_raise_typed_errors(unit, **call):
    stats = _handler_case(unit, **call)
    assert stats["reservations"] == stats["leases"] == 0, stats  # nothing left reserved or pinned


@pytest.mark.slow
@pytest.mark.timeout(900)
@settings(FUZZ, max_examples=10_000)
@given(method=methods, arguments=args)
def test_fuzzed_control_calls_many(unit, method, arguments):
    outcome = _control_case(unit, method, arguments)
    assert isinstance(outcome, (bytes, *CONTROL_ERRORS)), outcome


@pytest.mark.slow
@pytest.mark.timeout(900)
@settings(FUZZ, max_examples=10_000)
@given(**handler_args)
def test_fuzzed_handler_calls_many(unit, **call):
    stats = _handler_case(unit, **call)
    assert stats["reservations"] == stats["leases"] == 0, stats  # nothing left reserved or pinned
