"""The public entry points' promise under bad input: an exact round trip, or a typed error naming what was
wrong with nothing stored for that step, and the unit serving exactly afterwards.

Property-based (hypothesis, bounded examples, no deadline: a busy machine must not fail it) against real
units over tcp and shm. Each numbered item is a case that once failed: a silent truncation, a half-stored
step, a mixed key, an untyped error.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gputq.client.reader import Reader
from gputq.client.writer import Writer
from gputq.config import GputqConfig
from gputq.data.refs import Layout
from gputq.data.slices import ParallelSlice
from gputq.errors import (
    CapacityError,
    ConfigError,
    DuplicateKeyError,
    FieldValueError,
    GputqError,
    InvalidInputError,
    LayoutError,
    RequestTooLargeError,
)
from tests.conftest import local_units

pytestmark = pytest.mark.timeout(240)

LAYERS, TOPK = 2, 3
SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module", params=["tcp", "shm"])
def deployment(request):
    """Two units storing expert IDs as uint8, a writer and a reader; the unit objects to count keys."""
    with local_units(request.param, units=2, capacity=4 << 20, routed_experts_dtype="uint8",
                     put_timeout_s=0.5) as (config, units, clients):
        with Writer(clients, config) as writer, Reader(clients, config) as reader:
            yield config, units, writer, reader


def _keys(units) -> set[str]:
    """Every key the units store, committed or still being written."""
    found = set()
    for unit in units:
        listing = unit.unit.keys()
        found.update(key for keys in listing["partitions"].values() for key in keys)
        found.update(listing["reserved"])
    return found


_counter = iter(range(10**9))


def _fresh(prefix: str) -> str:
    return f"{prefix}-{next(_counter)}"


def _round_trip(writer, reader, key: str, fields: dict) -> dict:
    refs = writer.put(key, "p", fields)
    writer.flush()
    (got,) = reader.fetch([{name: Layout.from_ref(ref) for name, ref in refs.items()}])
    return got


def _assert_serving(writer, reader) -> None:
    """The unit still round-trips a normal step exactly."""
    experts = np.arange(5 * LAYERS * TOPK, dtype=np.int32).reshape(5, LAYERS, TOPK) % 200
    got = _round_trip(writer, reader, _fresh("ok"), {"routed_experts": experts,
                                                     "logprobs": np.linspace(-1, 0, 5, dtype=np.float32)})
    np.testing.assert_array_equal(got["rollout_routed_experts"], experts)


# -- item 1: byte order goes through the same range check ----------------------------------------------

INTEGER_DTYPES = [f"{order}{kind}{size}" for order in "<>" for kind in "iu" for size in (1, 2, 4, 8)]


@st.composite
def expert_arrays(draw):
    dtype = np.dtype(draw(st.sampled_from(INTEGER_DTYPES)))
    rows = draw(st.integers(0, 12))
    info = np.iinfo(dtype)
    low, high = max(int(info.min), -300), min(int(info.max), 2**40)
    values = draw(st.lists(st.integers(low, high), min_size=rows * LAYERS * TOPK, max_size=rows * LAYERS * TOPK))
    array = np.array(values, dtype=dtype).reshape(rows, LAYERS, TOPK)
    if draw(st.booleans()) and rows > 1:  # a strided view, not a contiguous array
        array = array[::2]
    return array


@SETTINGS
@given(experts=expert_arrays())
@example(experts=np.full((4, LAYERS, TOPK), 2**56, dtype=">i8"))  # stored 0 before
@example(experts=np.full((4, LAYERS, TOPK), 5, dtype=">i8"))  # a bare IndexError before
def test_expert_ids_of_any_dtype_and_byte_order_round_trip_exactly_or_are_refused(deployment, experts):
    config, units, writer, reader = deployment
    key = _fresh("e")
    before = _keys(units)
    fits = experts.size == 0 or (int(experts.min()) >= 0 and int(experts.max()) <= 255)
    if fits:
        got = _round_trip(writer, reader, key, {"routed_experts": experts})
        assert got["rollout_routed_experts"].dtype == np.int32
        np.testing.assert_array_equal(got["rollout_routed_experts"], experts.astype(np.int64))
    else:
        with pytest.raises(FieldValueError, match=rf"key '{key}' field 'routed_experts': value -?\d+ at index"):
            writer.put(key, "p", {"routed_experts": experts})
        writer.flush()
        assert _keys(units) == before


@SETTINGS
@given(dtype=st.sampled_from(["<f2", ">f2", "<f4", ">f4", "<f8", ">f8"]), rows=st.integers(0, 20),
       nan_at=st.none() | st.integers(0, 19))
def test_logprobs_of_any_float_dtype_round_trip_as_float32_or_a_nan_is_named(deployment, dtype, rows, nan_at):
    config, units, writer, reader = deployment
    logprobs = np.linspace(-3, 0, rows).astype(dtype)
    key = _fresh("l")
    if nan_at is not None and nan_at < rows:
        logprobs[nan_at] = np.nan
        with pytest.raises(FieldValueError, match=rf"key '{key}' field 'logprobs': NaN at index \[{nan_at}\]"):
            writer.put(key, "p", {"logprobs": logprobs})
        return
    got = _round_trip(writer, reader, key, {"logprobs": logprobs})
    np.testing.assert_array_equal(got["rollout_log_probs"], logprobs.astype(np.float32))


# -- item 2: a step is stored whole or not at all ------------------------------------------------------

def test_a_step_larger_than_an_arena_is_refused_at_put_with_nothing_stored(deployment):
    config, units, writer, reader = deployment
    before = _keys(units)
    too_many = (config.unit_capacity_bytes // (LAYERS * TOPK)) + 1
    with pytest.raises(RequestTooLargeError, match="key 'big': its fields need") as info:
        writer.put("big", "p", {"logprobs": np.zeros(4, np.float32),
                                "routed_experts": np.zeros((too_many, LAYERS, TOPK), np.int32)})
    assert isinstance(info.value, ValueError)
    writer.flush()
    assert _keys(units) == before
    _assert_serving(writer, reader)


def test_a_step_whose_second_field_fails_to_land_leaves_neither_stored(deployment):
    """The first field lands, the second finds its key taken: the first is deleted before flush raises."""
    config, units, writer, reader = deployment
    key = _fresh("d")
    writer.put(key, "p", {"logprobs": np.zeros(4, np.float32)})
    writer.flush()
    before = _keys(units)
    with pytest.raises(DuplicateKeyError) as info:
        writer.put(key, "p", {"routed_experts": np.ones((4, LAYERS, TOPK), np.int32),
                              "logprobs": np.zeros(4, np.float32)})
        writer.flush()
    assert isinstance(info.value, ValueError) and set(info.value.keys) == {f"{key}/logprobs", f"{key}/routed_experts"}
    assert _keys(units) == before  # the new field is gone again, the old one kept
    _assert_serving(writer, reader)


def test_a_step_that_finds_the_arena_full_is_a_capacity_error_with_nothing_of_it_stored():
    with local_units("tcp", units=1, capacity=1 << 20, put_timeout_s=0.3) as (config, units, clients):
        with Writer(clients, config) as writer:
            writer.put("a", "p", {"logprobs": np.zeros((600 << 10) // 4, np.float32)})
            writer.flush()
            with pytest.raises(CapacityError) as info:
                writer.put("b", "p", {"routed_experts": np.zeros((10, LAYERS, TOPK), np.int32),
                                      "logprobs": np.zeros((600 << 10) // 4, np.float32)})
                writer.flush()
            assert isinstance(info.value, TimeoutError)
            assert _keys(units) == {"a/logprobs"}


# -- item 3: two writers, one key: one winner or none --------------------------------------------------

def test_two_writers_putting_one_key_at_once_leave_one_whole_step_or_none():
    with local_units("tcp", units=1) as (config, units, clients):
        with Writer(clients, config) as a, Writer(clients, config) as b, Reader(clients, config) as reader:
            for round_ in range(30):
                key = f"race-{round_}"
                start = threading.Barrier(2)
                errors, refs = {}, {}

                def put(writer, tag):
                    start.wait(timeout=30)
                    try:
                        refs[tag] = writer.put(key, "p", {"logprobs": np.full(64, tag, np.float32),
                                                          "routed_experts": np.full((64, LAYERS, TOPK), tag, np.int32)})
                        writer.flush()
                    except GputqError as exc:
                        errors[tag] = exc

                threads = [threading.Thread(target=put, args=(w, t)) for w, t in ((a, 1), (b, 2))]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(timeout=60)
                assert all(isinstance(e, DuplicateKeyError) for e in errors.values()), errors
                stored = sorted(k for k in _keys(units) if k.startswith(f"{key}/"))
                assert stored in ([], [f"{key}/logprobs", f"{key}/routed_experts"]), (round_, stored, errors)
                if stored:  # the winner's flush succeeded and its references read its own values
                    (winner,) = {1, 2} - set(errors)
                    (got,) = reader.fetch([{n: Layout.from_ref(r) for n, r in refs[winner].items()}])
                    assert (got["rollout_log_probs"] == winner).all()
                    assert (got["rollout_routed_experts"] == winner).all()
                else:
                    assert len(errors) == 2


# -- item 4: untyped errors from put --------------------------------------------------------------------

@pytest.mark.parametrize("key,fields,error,message", [
    ("r", {"logprobs": [[1.0], [1.0, 2.0]]}, FieldValueError, "key 'r' field 'logprobs': not an array of one shape"),
    ("r", [("logprobs", np.zeros(3, np.float32))], InvalidInputError, "r: fields must be a mapping"),
    ("a\ud800", {"logprobs": np.zeros(3, np.float32)}, InvalidInputError, "is not valid UTF-8 text"),
    (None, {"logprobs": np.zeros(3, np.float32)}, InvalidInputError, "key must be a non-empty str, got None"),
    (b"k", {"logprobs": np.zeros(3, np.float32)}, InvalidInputError, "key must be a non-empty str, got b'k'"),
    ("", {"logprobs": np.zeros(3, np.float32)}, InvalidInputError, "key must be a non-empty str, got ''"),
    ("k" * 2000, {"logprobs": np.zeros(3, np.float32)}, InvalidInputError, "bytes of UTF-8, more than 1024"),
    ("r", {3: np.zeros(3, np.float32)}, InvalidInputError, "a field name must be a non-empty str"),
])
def test_bad_put_arguments_are_typed_errors_with_nothing_stored(deployment, key, fields, error, message):
    config, units, writer, reader = deployment
    before = _keys(units)
    with pytest.raises(error, match=message.replace("(", r"\(")) as info:
        writer.put(key, "p", fields)
    assert isinstance(info.value, ValueError)
    writer.flush()
    assert _keys(units) == before


@SETTINGS
@given(key=st.text(min_size=0, max_size=12))
def test_any_text_key_round_trips_or_is_refused_as_bad_input(deployment, key):
    config, units, writer, reader = deployment
    try:
        valid = bool(key) and bool(key.encode("utf-8"))
    except UnicodeEncodeError:
        valid = False
    key = f"{next(_counter)}{key}" if valid else key
    if valid:
        got = _round_trip(writer, reader, key, {"logprobs": np.full(3, -0.5, np.float32)})
        np.testing.assert_array_equal(got["rollout_log_probs"], np.full(3, -0.5, np.float32))
    else:
        with pytest.raises(InvalidInputError):
            writer.put(key, "p", {"logprobs": np.zeros(3, np.float32)})


# -- item 5: the read side -----------------------------------------------------------------------------

def _stored_layouts(writer) -> dict:
    refs = writer.put(_fresh("read"), "p", {"logprobs": np.zeros(6, np.float32),
                                            "routed_experts": np.ones((6, LAYERS, TOPK), np.int32)})
    writer.flush()
    return {name: Layout.from_ref(ref) for name, ref in refs.items()}


@SETTINGS
@given(junk=st.sampled_from(["none", "layout", "int", "str", "dict_int", "swapped", "nested", "set"]))
def test_a_bad_shard_is_a_typed_error_naming_the_sample(deployment, junk):
    config, units, writer, reader = deployment
    sample = _stored_layouts(writer)
    shard = {"none": None, "layout": [sample["logprobs"]], "int": 3, "str": "shard",
             "dict_int": [{"logprobs": 3}], "swapped": [{"logprobs": sample["routed_experts"]}],
             "nested": [[sample]], "set": [{"logprobs"}]}[junk]
    with pytest.raises(InvalidInputError) as info:
        reader.fetch(shard)
    if junk == "swapped":
        assert isinstance(info.value, LayoutError) and "field 'logprobs' holds a layout of field" in str(info.value)
    with pytest.raises(InvalidInputError):
        reader.stream(shard, [[0]])
    _assert_serving(writer, reader)


@pytest.mark.parametrize("kwargs,message", [
    ({"micro_batches": None}, "micro_batches must be a list of lists"),
    ({"micro_batches": [0]}, "micro-batch 0 must be a list of shard positions, got int$"),
    ({"micro_batches": ["01"]}, "micro-batch 0 must be a list of shard positions, got str$"),
    ({"micro_batches": [[0, 1], []]}, "^micro-batch 1 is empty$"),
    ({"micro_batches": [[0], [2]]}, "^micro-batch 1 names sample 2; the shard has 2 samples$"),
    ({"micro_batches": [[-1], [0, 1]]}, "^micro-batch 0 names sample -1; the shard has 2 samples$"),
    ({"micro_batches": [[True], [0]]}, "^micro-batch 0 names sample True; the shard has 2 samples$"),
    ({"micro_batches": [[0.0], [1]]}, r"^micro-batch 0 names sample 0\.0; the shard has 2 samples$"),
    ({"micro_batches": [[0, 1], [1]]}, "^sample 1 is in micro-batches 0 and 1: micro-batches must partition"),
    ({"total_lengths": ["x", 7]}, r"sample 0: total length must be an int >= 1, got 'x'"),
    ({"total_lengths": [10.9, 7]}, r"sample 0: total length must be an int >= 1, got 10.9"),
    ({"total_lengths": [7, 0]}, r"^sample 1: total length must be an int >= 1, got 0$"),
    ({"total_lengths": [7]}, "^1 total lengths for 2 samples$"),
    ({"total_lengths": 7}, "total_lengths must be a list of ints"),
    ({"fields": ["rewards"]}, "^field 'rewards' is missing from some samples of micro-batch 0$"),
    ({"fields": "logprobs"}, "^fields must be a list of field names, got 'logprobs'$"),
    ({"hold": 1}, "^hold must be a bool, got 1$"),
])
def test_bad_stream_arguments_are_typed_errors(deployment, kwargs, message):
    config, units, writer, reader = deployment
    shard = [_stored_layouts(writer), _stored_layouts(writer)]  # R3 of 6 rows: 7 tokens each
    arguments = {"micro_batches": [[0], [1]], "rank": ParallelSlice(num_experts=16)} | kwargs
    with pytest.raises(InvalidInputError, match=message):
        reader.stream(shard, **arguments)


# -- item 6: timeouts are finite -----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["read_timeout_s", "put_timeout_s", "control_timeout_s", "send_timeout_s"])
@pytest.mark.parametrize("value", [float("inf"), float("nan"), 1e400, 1e300, 0, -1])
def test_a_timeout_that_is_not_a_finite_positive_number_is_refused_at_config(name, value, tmp_path):
    with pytest.raises(ConfigError, match=name):
        GputqConfig(**{name: value})
    with pytest.raises(ConfigError, match=name):
        GputqConfig.load(env={f"GPUTQ_{name.upper()}": repr(value)})
    path = tmp_path / "c.yaml"
    path.write_text(f"{name}: {'.inf' if value == float('inf') else repr(value)}\n")
    with pytest.raises(ConfigError, match=name):
        GputqConfig.load(yaml_path=str(path), env={})


# -- item 7: config and deployment errors in the tree --------------------------------------------------

def test_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path):
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"\xff\xfe\x00transport: tcp")
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        GputqConfig.load(yaml_path=str(path), env={})


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("overrides,message", [
    ({"shm_dir": "/nonexistent-gputq-dir"}, "No such file or directory"),
    ({"unit_capacity_bytes": 10**18}, "cannot reserve a 1000000000000000000 byte arena"),
])
def test_a_unit_that_cannot_start_is_a_config_error_naming_why(overrides, message):
    from gputq.cluster.deploy import Deployment

    config = GputqConfig(enabled=True, num_units=1, unit_capacity_bytes=1 << 20, transport="tcp") \
        .replace(**overrides)
    with pytest.raises(ConfigError, match=f"a StorageUnit could not start with this config: .*{message}"):
        Deployment.start(config, num_cpus=1)
