"""Packed expert IDs: the documented bit order pinned by golden bytes, every width and top-k against an
independent bit-by-bit codec, and IDs outside ``[0, E)`` refused by name."""

from __future__ import annotations

import numpy as np
import pytest

from gputq.data.canonical import canonicalize
from gputq.data.fields import FieldSpec, routed_experts_spec, row_nbytes
from gputq.data.packing import MAX_BITS, bits_for, pack_rows, packed_row_bytes, unpack_rows
from gputq.data.refs import FieldRef
from gputq.errors import ConfigError, FieldValueError, InvalidInputError

pytestmark = pytest.mark.timeout(60)


def _encode_bitwise(rows: np.ndarray, bits: int) -> np.ndarray:
    """The format as its docstring states it, one bit at a time."""
    topk = rows.shape[1]
    out = np.zeros((len(rows), packed_row_bytes(topk, bits)), np.uint8)
    for r, row in enumerate(rows.tolist()):
        for j, value in enumerate(row):
            for k in range(bits):
                n = j * bits + k
                out[r, n // 8] |= ((value >> k) & 1) << (n % 8)
    return out


def _decode_bitwise(packed: np.ndarray, topk: int, bits: int) -> np.ndarray:
    out = np.zeros((len(packed), topk), np.int64)
    for r, row in enumerate(packed.tolist()):
        for j in range(topk):
            for k in range(bits):
                n = j * bits + k
                out[r, j] |= ((row[n // 8] >> (n % 8)) & 1) << k
    return out


def test_golden_bytes_pin_the_bit_order():
    assert pack_rows(np.array([[1, 300]]), 384).tolist() == [[0x01, 0x58, 0x02]]
    # 7 bits (128 experts), top-8: 56 bits in 7 bytes; the IDs 0..7 in order.
    assert pack_rows(np.arange(8)[None], 128).tobytes().hex() == "8080604028180e"
    # 4 bits, top-3: two IDs per byte, low nibble first, the last byte's high half zero.
    assert pack_rows(np.array([[0xA, 0x5, 0xF]]), 16).tolist() == [[0x5A, 0x0F]]
    # 16 bits: little-endian uint16s.
    assert pack_rows(np.array([[0x1234, 0xFFFF]]), 65536).tolist() == [[0x34, 0x12, 0xFF, 0xFF]]


@pytest.mark.parametrize("bits", range(1, MAX_BITS + 1))
def test_every_width_and_topk_match_the_bitwise_codec_both_ways(bits):
    rng = np.random.default_rng(bits)
    experts = 1 << bits
    for topk in range(1, 17):
        ids = rng.integers(0, experts, (13, topk))
        ids[0] = experts - 1  # every bit set
        ids[1] = 0
        packed = pack_rows(ids, experts)
        assert packed.shape == (13, packed_row_bytes(topk, bits))
        np.testing.assert_array_equal(packed, _encode_bitwise(ids, bits), err_msg=f"b={bits} K={topk}")
        np.testing.assert_array_equal(_decode_bitwise(packed, topk, bits), ids)
        np.testing.assert_array_equal(unpack_rows(packed, topk, experts), ids)


def test_stored_bytes_per_row_are_the_issues_figures():
    # E=128, 384, 512 with K = 8, 8, 10: 7, 9 and 12 bytes per row and layer.
    assert [packed_row_bytes(k, bits_for(e)) for e, k in ((128, 8), (384, 8), (512, 10))] == [7, 9, 12]
    assert [bits_for(e) for e in (1, 2, 3, 256, 257, 65536)] == [1, 1, 2, 8, 9, 16]


def test_leading_dimensions_dtypes_and_byte_orders_round_trip():
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 384, (4, 5, 6, 8))  # [L, tokens, ..., K]
    for dtype in (np.int16, ">i4", "<u2", ">u8", np.int64):
        packed = pack_rows(ids.astype(dtype), 384)
        assert packed.shape == (4, 5, 6, 9)
        np.testing.assert_array_equal(unpack_rows(packed, 8, 384), ids)
    out = np.empty((4, 5, 6, 9), np.uint8)
    assert pack_rows(ids, 384, out=out) is not None and np.array_equal(out, packed)
    into = np.empty((4, 5, 6, 8), np.int32)
    unpack_rows(packed, 8, 384, out=into)
    np.testing.assert_array_equal(into, ids)


@pytest.mark.parametrize("bad, value, index", [(384, 384, [1, 2]), (-1, -1, [1, 2]), (2**40, 2**40, [1, 2])])
def test_an_id_outside_the_experts_is_refused_by_value_and_index(bad, value, index):
    ids = np.zeros((3, 4), np.int64)
    ids[1, 2] = bad
    with pytest.raises(FieldValueError, match=rf"key 'k' field 'routed_experts': expert ID {value} at index "
                                              rf"\[{index[0]}, {index[1]}\] is outside \[0, 384\)"):
        pack_rows(ids, 384, where="key 'k' field 'routed_experts'")


def test_bad_arguments_are_typed():
    with pytest.raises(ConfigError):
        bits_for(0)
    with pytest.raises(ConfigError, match="at most 16"):
        bits_for(65537)
    with pytest.raises(FieldValueError, match="integer"):
        pack_rows(np.zeros((2, 3), np.float32), 64)
    with pytest.raises(FieldValueError, match=r"uint8 \[..., 3\]"):
        unpack_rows(np.zeros((2, 4), np.uint8), 2, 384)
    # rows of no IDs: numpy's reshape would raise a bare ValueError
    with pytest.raises(FieldValueError, match="rows of IDs"):
        pack_rows(np.zeros((3, 0), np.int8), 4)
    for topk in (0, -1, True, 2.0):
        with pytest.raises(FieldValueError, match="topk must be an int >= 1"):
            unpack_rows(np.zeros((3, 0), np.uint8), topk, 4)
    ids = np.zeros((4, 8), np.int64)
    strided = np.zeros((4, 18), np.uint8)[:, ::2]  # a view a reshape would copy: the result would be lost
    with pytest.raises(InvalidInputError, match="C-contiguous uint8 array of 36"):
        pack_rows(ids, 384, out=strided)
    with pytest.raises(InvalidInputError, match="int32 array of 32"):
        unpack_rows(pack_rows(ids, 384), 8, 384, out=np.zeros((4, 8), np.int64))


# -- the stored format in the data model: specs, references, the one pass ------------------------------------

@pytest.mark.parametrize("experts,topk,chosen,row_bytes", [
    (128, 8, "packed", 7), (200, 8, "uint8", 8), (256, 8, "uint8", 8), (384, 8, "packed", 9),
    (512, 10, "packed", 12), (65536, 8, "uint16", 16), (100_000, 8, "int32", 32)])
def test_auto_picks_the_narrowest_exact_format(experts, topk, chosen, row_bytes):
    spec = routed_experts_spec(3, topk, "auto", experts)
    assert ("packed" if spec.num_experts else spec.dtype) == chosen
    assert row_nbytes(spec) == 3 * row_bytes and spec.restored_dtype == "int32"


def test_packed_and_auto_need_num_experts_and_refuse_what_cannot_pack():
    for dtype in ("packed", "auto"):
        with pytest.raises(ConfigError, match="needs num_experts"):
            routed_experts_spec(3, 8, dtype)
    with pytest.raises(ConfigError, match="at most 16"):
        routed_experts_spec(3, 8, "packed", 1 << 17)
    with pytest.raises(ConfigError, match="rows \\[K\\] or \\[layers, K\\]"):
        FieldSpec("x", (2, 3, 4), "uint8", "int32", 0, num_experts=8)
    with pytest.raises(ConfigError, match="stored as uint8"):
        FieldSpec("x", (3, 4), "uint16", "int32", 0, num_experts=8)


def test_packed_specs_and_refs_round_trip_and_whole_dtype_records_are_unchanged():
    spec = routed_experts_spec(3, 8, "packed", 384)
    assert spec.to_dict()["num_experts"] == 384 and FieldSpec.from_dict(spec.to_dict()) == spec
    assert "num_experts" not in routed_experts_spec(3, 8, "uint16").to_dict()
    ref = FieldRef("k", "routed_experts", "u0", 10, "uint8", (3, 8), "p", "inc", 7, 384)
    assert (ref.stored_shape, ref.packing, ref.row_nbytes, ref.nbytes) == ((3, 9), (8, 9), 27, 270)
    assert FieldRef.from_dict(ref.to_dict()) == ref
    plain = FieldRef("k", "routed_experts", "u0", 10, "uint16", (3, 8), "p", "inc", 7)
    assert set(plain.to_dict()) == {"schema", "key", "field", "unit", "rows", "dtype", "row_shape", "partition",
                                    "incarnation", "generation"}
    with pytest.raises(InvalidInputError, match="packed IDs are uint8"):
        FieldRef("k", "routed_experts", "u0", 10, "uint16", (3, 8), "p", num_experts=384)


@pytest.mark.parametrize("layer_major", [False, True])
@pytest.mark.parametrize("order", ["<i4", ">i4", "<i8", "<u2"])
def test_canonicalize_packs_in_its_one_pass_whatever_the_input_order(layer_major, order):
    # 3,000 rows of [5, 8] at 9 bits: several chunks of the pass, and big-endian input read as numbers.
    spec = routed_experts_spec(5, 8, "packed", 384)
    ids = np.random.default_rng(1).integers(0, 384, (3000, 5, 8)).astype(order)
    out = np.full(3000 * row_nbytes(spec) + 5, 0xAB, np.uint8)
    stored = canonicalize("k", spec, ids, out=out, layer_major=layer_major)
    assert stored.dtype == np.uint8 and np.shares_memory(stored, out) and (out[-5:] == 0xAB).all()
    token_major = stored.transpose(1, 0, 2) if layer_major else stored
    assert token_major.shape == (3000, 5, 9)
    np.testing.assert_array_equal(unpack_rows(np.ascontiguousarray(token_major), 8, 384), ids)


def test_canonicalize_names_a_bad_id_by_its_index_in_the_payload_not_its_chunk():
    spec = routed_experts_spec(5, 8, "packed", 100)
    ids = np.random.default_rng(2).integers(0, 100, (20_000, 5, 8), dtype=np.int32)
    ids[17_001, 4, 7] = 100
    for layer_major in (False, True):
        with pytest.raises(FieldValueError, match=r"^key 'k' field 'routed_experts': expert ID 100 at index "
                                                  r"\[17001, 4, 7\] is outside \[0, 100\)"):
            canonicalize("k", spec, ids, layer_major=layer_major)
    with pytest.raises(FieldValueError, match="expected an integer array"):
        canonicalize("k", spec, ids.astype(np.float32))
