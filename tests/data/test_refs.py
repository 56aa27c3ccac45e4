import json

import numpy as np
import pytest

from gputq.data.refs import FieldRef, Fragment, Layout
from gputq.errors import InvalidInputError, LayoutError

L, K = 3, 2


def make_ref(key, rows, dtype="uint16", field="routed_experts", row_shape=(L, K)):
    return FieldRef(key, field, "su0", rows, dtype, row_shape, "rollout-0")


def store_for(*refs):
    """Distinct data per ref, so any wrong source row shows up."""
    store = {}
    for i, ref in enumerate(refs):
        base = np.arange(ref.rows * L * K, dtype=np.int64).reshape(ref.rows, L, K) % 200 + i * 50
        store[ref] = base.astype(ref.dtype)
    return store


def materialize(layout, store):
    out = np.full((layout.rows, *layout.row_shape), layout.fill, dtype=layout.dtype)
    for f in layout.fragments:
        out[f.dst_row:f.dst_row + f.rows] = store[f.ref][f.src_row:f.src_row + f.rows]
    return out


def fill_rows(n, fill=0):
    return np.full((n, L, K), fill, np.int32)


def test_fieldref_basics_and_roundtrip():
    ref = make_ref("p/s0/1/routed_experts", 10)
    assert ref.nbytes == 10 * L * K * 2 and ref.row_nbytes == 12
    assert (ref.incarnation, ref.generation) == ("", 0)  # unknown: the unit checks nothing
    d = ref.to_dict()
    assert d["schema"] == 2 and d["row_shape"] == [L, K]
    assert (d["incarnation"], d["generation"]) == ("", 0)
    assert FieldRef.from_dict(json.loads(json.dumps(d))) == ref
    assert hash(FieldRef.from_dict(d)) == hash(ref)
    with pytest.raises(InvalidInputError, match="schema version 3"):
        FieldRef.from_dict(d | {"schema": 3})
    with pytest.raises(InvalidInputError, match="schema version True"):
        FieldRef.from_dict(d | {"schema": True})
    missing = {k: v for k, v in d.items() if k != "unit"}
    with pytest.raises(InvalidInputError, match=r"missing \['unit'\]"):
        FieldRef.from_dict(missing)
    with pytest.raises(InvalidInputError, match="unexpected keys"):
        FieldRef.from_dict(d | {"color": "red"})
    with pytest.raises(InvalidInputError, match="rows"):
        make_ref("k", -1)


def test_fieldref_carries_incarnation_and_generation():
    ref = FieldRef("k", "logprobs", "su-0", 4, "float32", (), "p", "0123456789abcdef", 2**63 - 1)
    d = ref.to_dict()
    assert (d["incarnation"], d["generation"]) == ("0123456789abcdef", 2**63 - 1)
    back = FieldRef.from_dict(json.loads(json.dumps(d)))
    assert back == ref and (back.incarnation, back.generation) == ("0123456789abcdef", 2**63 - 1)
    assert back != FieldRef("k", "logprobs", "su-0", 4, "float32", (), "p", "0123456789abcdef", 7)
    for bad in (-1, 2**63, True, 1.0, "3"):
        with pytest.raises(InvalidInputError, match="generation"):
            FieldRef.from_dict(d | {"generation": bad})
    with pytest.raises(InvalidInputError, match="incarnation must be a str"):
        FieldRef.from_dict(d | {"incarnation": 5})


def test_schema_1_records_are_refused_with_the_reason():
    v1 = {"schema": 1, "key": "k", "field": "logprobs", "unit": "su-0", "rows": 4, "dtype": "float32",
          "row_shape": [], "partition": "p"}
    with pytest.raises(InvalidInputError,
                       match=r"FieldRef record has schema version 1; this gputq reads 2: .*incarnation"):
        FieldRef.from_dict(v1)
    layout_v1 = {"schema": 1, "field": "logprobs", "rows": 4, "fill": 0.0, "dtype": "float32", "row_shape": [],
                 "refs": [v1], "fragments": [[0, 0, 0, 4]]}
    with pytest.raises(InvalidInputError, match=r"Layout record has schema version 1; this gputq reads 2: "):
        Layout.from_dict(layout_v1)


def test_fragment_bounds():
    ref = make_ref("a", 5)
    with pytest.raises(LayoutError, match="outside ref 'a'"):
        Fragment(ref, 3, 0, 3)
    with pytest.raises(LayoutError, match="positive"):
        Fragment(ref, 0, 0, 0)
    with pytest.raises(LayoutError, match="non-negative"):
        Fragment(ref, -1, 0, 2)


def test_layout_validation():
    a, b = make_ref("a", 5), make_ref("b", 5)
    with pytest.raises(LayoutError, match="overlap at target row 3"):
        Layout("routed_experts", 10, 0, (Fragment(a, 0, 0, 4), Fragment(b, 0, 3, 2)), "int32", (L, K))
    with pytest.raises(LayoutError, match="past the layout's 6 rows"):
        Layout("routed_experts", 6, 0, (Fragment(a, 0, 2, 5),), "int32", (L, K))
    other = make_ref("lp", 5, "float32", "logprobs", ())
    with pytest.raises(LayoutError, match="field 'logprobs'"):
        Layout("routed_experts", 10, 0, (Fragment(a, 0, 0, 5), Fragment(other, 0, 5, 5)), "int32", (L, K))
    wide = make_ref("w", 5, row_shape=(L, K + 1))
    with pytest.raises(LayoutError, match="rows"):
        Layout("routed_experts", 10, 0, (Fragment(wide, 0, 0, 5),), "int32", (L, K))
    big = make_ref("big", 5, "int32")
    with pytest.raises(LayoutError, match="widen"):
        Layout("routed_experts", 10, 0, (Fragment(big, 0, 0, 5),), "uint16", (L, K))
    # Unsorted but disjoint fragments are fine and come back sorted by target row.
    ok = Layout("routed_experts", 10, 0, (Fragment(b, 0, 5, 5), Fragment(a, 0, 0, 5)), "int32", (L, K))
    assert [f.dst_row for f in ok.fragments] == [0, 5] and ok.covered_rows == 10


def test_from_ref_refs_and_fill():
    a, b = make_ref("a", 4, "uint8"), make_ref("b", 3, "uint8")
    la = Layout.from_ref(a)
    assert (la.rows, la.dtype, la.fill, len(la.fragments)) == (4, "int32", 0, 1)
    lp = Layout.from_ref(make_ref("lp", 4, "float32", "logprobs", ()))
    assert lp.dtype == "float32" and lp.fill == 0.0 and isinstance(lp.fill, float)
    gap = Layout.empty("routed_experts", 2, fill=0, dtype="int32", row_shape=(L, K))
    cat = Layout.concat([Layout.from_ref(b), gap, la, Layout.from_ref(b)])
    assert cat.refs() == [b, a] and cat.rows == 3 + 2 + 4 + 3 and cat.covered_rows == 10
    store = store_for(a, b)
    expected = np.concatenate([store[b], fill_rows(2), store[a], store[b]]).astype(np.int32)
    got = materialize(cat, store)
    assert got.dtype == np.int32 and np.array_equal(got, expected)


def test_concat_rejects_mismatch():
    a = make_ref("a", 4)
    with pytest.raises(LayoutError, match="at least one"):
        Layout.concat([])
    with pytest.raises(LayoutError, match="different"):
        Layout.concat([Layout.from_ref(a), Layout.from_ref(a, fill=7)])


def test_slice_shift_concat_algebra():
    a, b, c = make_ref("a", 6), make_ref("b", 4), make_ref("c", 5)
    store = store_for(a, b, c)
    gap = Layout.empty("routed_experts", 3, fill=0, dtype="int32", row_shape=(L, K))
    # A layout that uses partial refs too: c's rows [1, 4).
    part = Layout("routed_experts", 3, 0, (Fragment(c, 1, 0, 3),), "int32", (L, K))
    lay = Layout.concat([Layout.from_ref(a), gap, part, Layout.from_ref(b)])
    dense = np.concatenate([store[a], fill_rows(3), store[c][1:4], store[b]]).astype(np.int32)
    assert np.array_equal(materialize(lay, store), dense)
    n = lay.rows
    for start in range(n + 1):
        for stop in range(start, n + 1):
            sl = lay.slice(start, stop)
            assert sl.rows == stop - start
            assert np.array_equal(materialize(sl, store), dense[start:stop])
    for k in range(n + 1):
        rejoined = Layout.concat([lay.slice(0, k), lay.slice(k, n)])
        assert np.array_equal(materialize(rejoined, store), dense)
    shifted = lay.slice(2, 11).shift(4, 15)
    expected = np.concatenate([fill_rows(4), dense[2:11], fill_rows(2)])
    assert np.array_equal(materialize(shifted, store), expected)
    assert shifted.slice(4, 13) == lay.slice(2, 11)
    with pytest.raises(LayoutError, match="outside"):
        lay.slice(3, n + 1)
    with pytest.raises(LayoutError, match="cannot place"):
        lay.shift(2, n + 1)


def test_to_dict_roundtrip_is_compact():
    a = make_ref("a", 100, "uint8")
    frags = tuple(Fragment(a, i, 2 * i, 1) for i in range(100))
    lay = Layout("routed_experts", 200, 0, frags, "int32", (L, K))
    d = json.loads(json.dumps(lay.to_dict()))
    assert d["schema"] == 2 and len(d["refs"]) == 1 and len(d["fragments"]) == 100
    assert Layout.from_dict(d) == lay
    lp = Layout.concat([Layout.empty("logprobs", 2, fill=0.0, dtype="float32", row_shape=()),
                        Layout.from_ref(make_ref("lp", 3, "float32", "logprobs", ()))])
    assert Layout.from_dict(json.loads(json.dumps(lp.to_dict()))) == lp


def test_from_dict_rejects_bad_records():
    d = Layout.from_ref(make_ref("a", 4)).to_dict()
    with pytest.raises(InvalidInputError, match="schema version 3"):
        Layout.from_dict(d | {"schema": 3})
    with pytest.raises(InvalidInputError, match=r"missing \['fragments'\]"):
        Layout.from_dict({k: v for k, v in d.items() if k != "fragments"})
    with pytest.raises(LayoutError, match="bad fragment"):
        Layout.from_dict(d | {"fragments": [[1, 0, 0, 4]]})
    with pytest.raises(InvalidInputError, match="FieldRef record has schema"):
        Layout.from_dict(d | {"refs": [d["refs"][0] | {"schema": 0}]})
