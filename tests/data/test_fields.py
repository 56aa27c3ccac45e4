import dataclasses
import json

import numpy as np
import pytest

from gputq.data import canonical
from gputq.data.canonical import canonicalize
from gputq.data.fields import FieldRegistry, FieldSpec, logprobs_spec, routed_experts_spec, row_nbytes
from gputq.data.refs import FieldRef
from gputq.errors import ConfigError, FieldValueError, InvalidInputError
from gputq.kernels import host_native


def test_builtin_specs():
    lp = logprobs_spec()
    assert (lp.name, lp.row_shape, lp.dtype, lp.restored_dtype, lp.fill) == ("logprobs", (), "float32", "float32", 0.0)
    assert lp.span == "output" and lp.sample_key == "rollout_log_probs"
    re = routed_experts_spec(3, 2, "uint8")
    assert (re.name, re.row_shape, re.dtype, re.restored_dtype, re.fill) == ("routed_experts", (3, 2), "uint8", "int32", 0)
    assert re.span == "context" and re.sample_key == "rollout_routed_experts"
    assert routed_experts_spec(3, 2).dtype == "int32"
    with pytest.raises(ConfigError, match="uint8"):
        routed_experts_spec(3, 2, "int16")


def test_row_nbytes():
    assert row_nbytes(logprobs_spec()) == 4
    assert row_nbytes(routed_experts_spec(75, 8, "uint16")) == 75 * 8 * 2
    assert row_nbytes(routed_experts_spec(75, 8, "uint8")) == 600


def test_spec_validation_and_roundtrip():
    spec = FieldSpec("entropy", (), "float16", "float32", 0.0)
    assert spec.sample_key == "rollout_entropy" and spec.span == "output"
    assert FieldSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    with pytest.raises(ConfigError, match="widen"):
        FieldSpec("x", (2,), "int32", "uint8", 0)
    with pytest.raises(ConfigError, match="span"):
        FieldSpec("x", (), "float32", "float32", 0.0, span="tokens")
    with pytest.raises(ConfigError, match="fill"):
        FieldSpec("x", (), "int32", "int32", 0.5)
    with pytest.raises(ConfigError, match="row_shape"):
        FieldSpec("x", (0,), "int32", "int32", 0)
    bad = spec.to_dict() | {"schema": 7}
    with pytest.raises(InvalidInputError, match="schema version 7"):
        FieldSpec.from_dict(bad)


def test_registry():
    reg = FieldRegistry.builtin(4, 2, "uint16")
    assert reg.names() == ("logprobs", "routed_experts")
    assert reg.get("routed_experts").dtype == "uint16"
    assert "logprobs" in reg and len(reg) == 2
    with pytest.raises(InvalidInputError, match=r"unknown field 'entropy'.*logprobs.*routed_experts"):
        reg.get("entropy")
    reg.register(logprobs_spec())  # identical: no-op
    with pytest.raises(ConfigError, match="already registered"):
        reg.register(routed_experts_spec(4, 2, "int32"))
    reg.register(FieldSpec("entropy", (), "float32", "float32", 0.0))
    assert reg.names()[-1] == "entropy"


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int32"])
def test_canonicalize_experts_in_range(dtype):
    spec = routed_experts_spec(3, 2, dtype)
    top = min(np.iinfo(dtype).max, 2**31 - 1)
    src = np.random.default_rng(0).integers(0, top, (5, 3, 2), dtype=np.int64)
    src[0, 0, 0], src[4, 2, 1] = 0, top
    out = canonicalize("k", spec, src)
    assert out.dtype == np.dtype(dtype) and out.flags.c_contiguous and out.shape == (5, 3, 2)
    np.testing.assert_array_equal(out.astype(np.int64), src)


def test_canonicalize_no_copy_and_contiguous():
    spec = routed_experts_spec(3, 2, "uint8")
    ready = np.zeros((4, 3, 2), np.uint8)
    assert canonicalize("k", spec, ready) is ready
    strided = np.arange(48, dtype=np.int32).reshape(8, 3, 2)[::2]
    out = canonicalize("k", spec, strided)
    assert out.flags.c_contiguous and np.array_equal(out, strided)
    assert canonicalize("k", spec, np.zeros((0, 3, 2), np.int32)).shape == (0, 3, 2)


@pytest.mark.parametrize("dtype,value", [("uint8", 256), ("uint8", -1), ("uint16", 65536),
                                         ("uint16", -3), ("int32", 2**31)])
def test_canonicalize_out_of_range_names_key_field_value(dtype, value):
    spec = routed_experts_spec(3, 2, dtype)
    src = np.zeros((4, 3, 2), np.int64)
    src[2, 1, 0] = value
    with pytest.raises(FieldValueError) as info:
        canonicalize("p/s1/3", spec, src)
    msg = str(info.value)
    assert "'p/s1/3'" in msg and "'routed_experts'" in msg and str(value) in msg and "[2, 1, 0]" in msg
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("source,dtype,value", [("int8", "uint8", -1), ("int16", "uint16", -3),
                                                ("int16", "uint8", -128), ("uint32", "int32", 2**31)])
def test_canonicalize_catches_ids_that_wrap_in_a_same_width_cast(source, dtype, value):
    # -1 as int8 has the bits of 255: a check reading the bits as unsigned would pass it.
    spec = routed_experts_spec(3, 2, dtype)
    src = np.zeros((4, 3, 2), source)
    src[3, 2, 1] = value
    with pytest.raises(FieldValueError, match=rf"value {value} at index \[3, 2, 1\] does not fit {dtype}"):
        canonicalize("k", spec, src)
    with pytest.raises(FieldValueError, match=rf"value {value} at index \[3, 2, 1\]"):
        canonicalize("k", spec, src, out=np.empty(src.size * 4, np.uint8))


def test_canonicalize_rejects_bad_shape_and_dtype():
    spec = routed_experts_spec(3, 2, "uint16")
    with pytest.raises(FieldValueError, match=r"'k1'.*'routed_experts'.*expected shape \[rows, 3, 2\]"):
        canonicalize("k1", spec, np.zeros((4, 6), np.int32))
    with pytest.raises(FieldValueError, match=r"expected shape \[rows, 3, 2\], got \(4, 3, 3\)"):
        canonicalize("k1", spec, np.zeros((4, 3, 3), np.int32))
    with pytest.raises(FieldValueError, match="integer array.*float32"):
        canonicalize("k1", spec, np.ones((4, 3, 2), np.float32))  # integral floats are still floats
    with pytest.raises(FieldValueError, match="integer array.*bool"):
        canonicalize("k1", spec, np.ones((4, 3, 2), bool))
    with pytest.raises(FieldValueError, match="floating-point"):
        canonicalize("k1", logprobs_spec(), np.zeros(4, np.int32))
    with pytest.raises(FieldValueError, match=r"expected shape \[rows\]"):
        canonicalize("k1", logprobs_spec(), np.zeros((4, 1), np.float32))


def test_canonicalize_logprobs():
    spec = logprobs_spec()
    src = np.array([-0.5, -1.25, -np.inf, 0.0])  # float64 from a JSON list
    out = canonicalize("k", spec, src)
    assert out.dtype == np.float32 and np.array_equal(out, src.astype(np.float32))
    mixed = np.array([np.inf, -np.inf], np.float32)  # sums to NaN but holds none
    assert np.array_equal(canonicalize("k", spec, mixed), mixed)
    bad = np.array([-1.0, -2.0, -3.0, np.nan, np.nan], np.float32)
    with pytest.raises(FieldValueError, match=r"'k'.*'logprobs'.*NaN at index \[3\]"):
        canonicalize("k", spec, bad)


@pytest.fixture(params=["codec", "numpy"])
def store_by(request, monkeypatch):
    """Whole-byte IDs stored by the host codec (where it builds) or, as without a C compiler, by numpy."""
    if request.param == "numpy":
        monkeypatch.setattr(host_native, "_state", {"lib": None, "status": "numpy, for this test"})
    elif host_native.host_codec() is None:
        pytest.skip(f"no host codec here: {host_native.host_codec_status()}")
    return request.param


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int32"])
def test_canonicalize_layer_major_stores_each_layer_contiguously(dtype, store_by, monkeypatch):
    spec = routed_experts_spec(5, 3, dtype)
    src = np.random.default_rng(0).integers(0, 200, (3000, 5, 3)).astype(np.int32)  # several chunks
    stored = []
    spy = lambda *args: stored.append(host_native.narrow_rows_host(*args)) or stored[-1]  # noqa: E731
    monkeypatch.setattr(canonical, "narrow_rows_host", spy)
    out = canonicalize("k", spec, src, out=np.empty(src.size * 4, np.uint8), layer_major=True)
    assert out.shape == (5, 3000, 3) and out.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(out, src.transpose(1, 0, 2))
    assert stored == ([-1] if store_by == "codec" else [None])  # the codec stored it in one call, or numpy did
    assert canonicalize("k", spec, src[:0], layer_major=True).shape == (5, 0, 3)


def test_canonicalize_layer_major_names_the_token_major_index_of_a_bad_id(store_by):
    spec = routed_experts_spec(4, 2, "uint8")
    src = np.zeros((2500, 4, 2), np.int32)
    src[2100, 3, 1] = 256
    with pytest.raises(FieldValueError, match=r"value 256 at index \[2100, 3, 1\]"):
        canonicalize("k", spec, src, layer_major=True)
    with pytest.raises(InvalidInputError, match="two or more dimensions"):
        canonicalize("k", logprobs_spec(), np.zeros(4, np.float32), layer_major=True)


@pytest.mark.parametrize("layer_major", [False, True])
@pytest.mark.parametrize("source", ["<i4", ">i4", "<i8", "<u2"])
@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int32", "auto"])
def test_whole_byte_ids_at_or_above_num_experts_are_refused(dtype, source, layer_major, store_by):
    """A configured num_experts bounds every ID, whatever the format: an ID the dtype holds but the model has no
    expert for (160 experts stored in uint8, say, by ``auto``) is refused with its token-major index, as a
    packed one is, by the codec and by numpy, from native, big-endian, wider and unsigned input."""
    spec = routed_experts_spec(4, 8, dtype, 160)
    assert spec.id_limit == 160 and spec.dtype == ("uint8" if dtype == "auto" else dtype)
    src = np.random.default_rng(3).integers(0, 160, (2500, 4, 8)).astype(source)
    stored = canonicalize("k", spec, src, out=np.empty(src.size * 4, np.uint8), layer_major=layer_major)
    np.testing.assert_array_equal(stored, src.transpose(1, 0, 2) if layer_major else src)
    for bad in (160, 255):
        src[2100, 3, 5] = bad
        with pytest.raises(FieldValueError, match=rf"expert ID {bad} at index \[2100, 3, 5\] is outside \[0, 160\)"):
            canonicalize("k", spec, src, out=np.empty(src.size * 4, np.uint8), layer_major=layer_major)
        with pytest.raises(FieldValueError, match=rf"expert ID {bad} at index \[2100, 3, 5\]"):
            canonicalize("k", spec, src)  # no out: also where the input is stored as it is
    if source != "<u2":
        src[2100, 3, 5] = -1
        with pytest.raises(FieldValueError, match=r"expert ID -1 at index \[2100, 3, 5\]"):
            canonicalize("k", spec, src, layer_major=layer_major)


def test_id_limit_round_trips_and_is_checked():
    spec = routed_experts_spec(4, 8, "uint16", 160)
    record = spec.to_dict()
    assert record["id_limit"] == 160 and FieldSpec.from_dict(json.loads(json.dumps(record))) == spec
    assert "id_limit" not in routed_experts_spec(4, 8, "uint16").to_dict()  # records without it are as they were
    assert routed_experts_spec(4, 8, "packed", 160).id_limit == 0  # packed IDs are checked against num_experts
    with pytest.raises(ConfigError, match="uint8 holds IDs below 256, not 300"):
        routed_experts_spec(4, 8, "uint8", 300)
    with pytest.raises(ConfigError, match="whole-byte integer IDs"):
        FieldSpec("x", (), "float32", "float32", 0.0, id_limit=10)
    with pytest.raises(ConfigError, match="id_limit must be an int >= 1"):
        FieldSpec("x", (2,), "int32", "int32", 0, id_limit=-3)
    ref = FieldRef("k", "routed_experts", "u0", 10, "uint8", (3, 8), "p", "inc", 7, id_limit=160)
    assert ref.to_dict()["id_limit"] == 160 and FieldRef.from_dict(json.loads(json.dumps(ref.to_dict()))) == ref
    assert "id_limit" not in dataclasses.replace(ref, id_limit=0).to_dict()
    with pytest.raises(InvalidInputError, match="not packed ones"):
        FieldRef("k", "routed_experts", "u0", 10, "uint8", (3, 8), "p", "inc", 7, 160, 160)
    with pytest.raises(InvalidInputError, match="not float32"):
        FieldRef("k", "logprobs", "u0", 10, "float32", (), "p", "inc", 7, id_limit=3)
