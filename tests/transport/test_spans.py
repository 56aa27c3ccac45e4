"""Spans of a read: their wire form, their checks, and a unit that sends and counts exactly them."""

from __future__ import annotations

import numpy as np
import pytest

from gputq.errors import InvalidInputError
from gputq.transport.spans import MAX_SPANS, as_spans, span_regions, spans_from_wire, spans_to_wire
from gputq.transport.tcp_connection import _coalesce
from gputq.unit.storage_unit import StorageUnit
from tests.conftest import TRANSPORT_PARAMS, local_units

pytestmark = pytest.mark.timeout(60)


def test_wire_form_is_little_endian_int64_rows():
    assert spans_to_wire([[1, 16, 8], [0, 0, 4]], 2) == bytes.fromhex(
        "0100000000000000" "1000000000000000" "0800000000000000"
        "0000000000000000" "0000000000000000" "0400000000000000")
    assert spans_from_wire(spans_to_wire([[1, 16, 8]], 2), 2).tolist() == [[1, 16, 8]]
    assert spans_from_wire(None, 3) is None


@pytest.mark.parametrize("spans, nkeys, message", [
    ([[2, 0, 4]], 2, "key index 2"),
    ([[-1, 0, 4]], 2, "key index -1"),
    ([[0, -8, 4]], 1, "negative"),
    ([[0, 1]], 1, r"shape \[m, 3\]"),
    ([[0.5, 1, 2]], 1, "integers"),
])
def test_bad_spans_are_refused(spans, nkeys, message):
    with pytest.raises(InvalidInputError, match=message):
        as_spans(spans, nkeys)


def test_too_many_spans_or_torn_wire_bytes_are_refused():
    with pytest.raises(InvalidInputError, match="split it"):
        as_spans(np.zeros((MAX_SPANS + 1, 3), np.int64), 1)
    with pytest.raises(InvalidInputError, match="little-endian"):
        spans_from_wire(b"\x00" * 23, 1)


def test_span_regions_stay_inside_their_key():
    regions = np.array([[100, 40], [300, 16]], np.int64)
    assert span_regions(regions, as_spans([[0, 8, 8], [1, 0, 16]], 2), ["a", "b"], "su").tolist() == \
        [[108, 8], [300, 16]]
    with pytest.raises(InvalidInputError, match=r"span 0 \(bytes \[36, 44\)\) is outside key 'a', which holds 40"):
        span_regions(regions, as_spans([[0, 36, 8]], 2), ["a", "b"], "su")


def test_the_unit_counts_the_spans_and_leases_nothing_for_a_bad_one():
    with StorageUnit("su", 1 << 20) as unit:
        unit.put("a", np.arange(64, dtype=np.uint8))
        lease_id, regions = unit.lease_regions(["a"], spans=as_spans([[0, 4, 8], [0, 32, 16]], 1))
        assert regions[:, 1].tolist() == [8, 16] and unit.stats()["bytes_read"] == 24
        unit.end_lease(lease_id)
        with pytest.raises(InvalidInputError, match="outside key 'a'"):
            unit.lease_regions(["a"], spans=as_spans([[0, 60, 8]], 1))
        assert unit.stats()["leases"] == 0 and unit.stats()["bytes_read"] == 24


@pytest.mark.parametrize("transport", TRANSPORT_PARAMS)
def test_a_read_of_spans_returns_and_moves_exactly_them(transport):
    with local_units(transport, units=1) as (config, units, clients):
        channel = clients.channel(units[0].name)
        payload = np.arange(4096, dtype=np.uint8)
        channel.write("k", payload, {})
        channel.write("j", payload[::-1].copy(), {})
        spans = np.array([[0, 100, 50], [1, 0, 10], [0, 4000, 96]], np.int64)
        before = units[0].stats()["bytes_read"]
        dest = np.zeros(156, np.uint8)
        assert channel.read(["k", "j"], dest, timeout=10, spans=spans) == [50, 10, 96]
        np.testing.assert_array_equal(dest, np.concatenate([payload[100:150], payload[::-1][:10], payload[4000:]]))
        assert units[0].stats()["bytes_read"] - before == 156
        with pytest.raises(InvalidInputError, match="outside key 'k'"):
            channel.read(["k"], dest, timeout=10, spans=np.array([[0, 4090, 10]]))


def test_a_reply_sends_regions_back_to_back_in_the_arena_as_one_buffer_in_their_order():
    arena = memoryview(bytes(range(64)))
    regions = np.array([[0, 4], [4, 4], [8, 0], [8, 2], [20, 4], [16, 4], [20, 4], [0, 0]], np.int64)
    views = _coalesce(arena, regions)
    assert [bytes(v) for v in views] == [bytes(range(10)), bytes(range(20, 24)), bytes(range(16, 24))]
    assert b"".join(views) == b"".join(bytes(arena[a:a + n]) for a, n in regions.tolist())
    assert _coalesce(arena, np.array([[3, 0]], np.int64)) == []
