"""Several writes in one request: tcp's WRITE_MANY frame and the same-host copies into the arena file."""

from __future__ import annotations

import numpy as np
import pytest

from gputq.errors import (
    CapacityError,
    DuplicateKeyError,
    GputqTimeoutError,
    InvalidInputError,
    ProtocolError,
    RequestTooLargeError,
    UnknownKeyError,
)
from gputq.transport import get_transport, reserved_writes
from gputq.transport.handler import ServerLimits
from gputq.transport.policy import nixl_import_error
from gputq.transport.wire import Op
from gputq.unit.storage_unit import StorageUnit
from tests.transport.test_wire import frame, serve_pair

TOKEN = "w" * 32
MAX = 8 << 20
#: The frame of the test that splits a request over several.
FRAME = 1 << 20
pytestmark = pytest.mark.timeout(60)


def blob(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.fixture(params=["tcp", "shm"])
def unit_channel(request, tmp_path):
    """A unit of 4 MiB, its tcp server, and a channel of the parametrised transport to it."""
    unit = StorageUnit("su-batch", 4 << 20, shm_dir=str(tmp_path), put_timeout_s=0.2)
    server = get_transport("tcp").serve(unit, host="127.0.0.1", port=0, token=TOKEN,
                                        limits=ServerLimits(max_frame_bytes=MAX))
    channel = get_transport(request.param).connect(server.address, token=TOKEN, max_frame_bytes=MAX, timeout=10)
    try:
        yield unit, channel
    finally:
        channel.close()
        server.close()
        unit.close()


def _stored(unit: StorageUnit, key: str) -> bytes:
    (array,) = unit.read([key])
    return array.tobytes()


def test_each_item_gets_its_receipt_or_its_own_error_in_order(unit_channel):
    unit, channel = unit_channel
    unit.put("taken", b"old", {})
    items = [("a", blob(1000, 1), {"generation": 11}), ("taken", b"new", {}), ("b", blob(70_000, 2), {}),
             ("empty", b"", {})]
    results = channel.write_many(items, timeout=5)
    assert [type(r) for r in results] == [dict, DuplicateKeyError, dict, dict]
    assert results[0]["generation"] == 11 and results[0]["nbytes"] == 1000 and results[3]["nbytes"] == 0
    assert "'taken'" in str(results[1])
    for key, payload, _ in items:
        expected = b"old" if key == "taken" else bytes(payload)
        assert _stored(unit, key) == expected
    assert unit.stats()["reserved"] == 0  # nothing left half written
    assert channel.write_many([("c", b"xyz", {})], timeout=5)[0]["nbytes"] == 3  # the lane is in sync


def test_a_full_arena_refuses_the_rest_of_the_request_after_one_wait(unit_channel):
    unit, channel = unit_channel
    items = [("fits", blob(2 << 20, 1), {}), ("too-big", blob(3 << 20, 2), {}), ("small", b"s", {})]
    results = channel.write_many(items, timeout=0.2)
    assert isinstance(results[0], dict)
    assert isinstance(results[1], CapacityError) and isinstance(results[2], CapacityError)
    assert "earlier write of the same request" in str(results[2])
    stats = unit.stats()
    assert stats["keys"] == 1 and stats["capacity_errors"] == stats["waits"] == 1 and stats["reserved"] == 0
    with pytest.raises(UnknownKeyError):
        unit.read(["small"])


def test_tcp_splits_items_over_frames_and_refuses_one_larger_than_a_frame(tmp_path):
    with StorageUnit("su-frames", 8 << 20, shm_dir=str(tmp_path)) as unit, \
            get_transport("tcp").serve(unit, host="127.0.0.1", port=0, token=TOKEN,
                                       limits=ServerLimits(max_frame_bytes=FRAME)) as server, \
            get_transport("tcp").connect(server.address, token=TOKEN, max_frame_bytes=FRAME, timeout=10) as channel:
        items = [(f"k{i}", blob(400_000, i), {}) for i in range(5)] + [("huge", blob(FRAME + 1, 9), {})]
        results = channel.write_many(items, timeout=5)
        assert all(isinstance(r, dict) for r in results[:5]) and isinstance(results[5], RequestTooLargeError)
        assert all(_stored(unit, f"k{i}") == items[i][1].tobytes() for i in range(5))


def test_a_malformed_write_many_gets_a_typed_error_and_the_connection_goes_on(tmp_path):
    with StorageUnit("su-0", 1 << 16, shm_dir=str(tmp_path)) as unit:
        bad_items = {"items": [["k", 3]], "timeout": None}
        wrong_length = {"items": [["k", 4, {}]], "timeout": None}
        good = {"items": [["k", 3, {}], ["l", 0, {}]], "timeout": None}
        out = serve_pair(frame(Op.WRITE_MANY, bad_items, b"abc") + frame(Op.WRITE_MANY, wrong_length, b"abc")
                         + frame(Op.WRITE_MANY, good, b"abc"), unit)
        _, malformed, short, written = out
        assert malformed[0] == Op.ERROR and malformed[1]["error"] == "InvalidInputError"
        assert short[0] == Op.ERROR and "announces 4 bytes but carries 3" in short[1]["message"]
        assert written[0] == Op.OK and [set(r) for r in written[1]["results"]] == [{"receipt"}, {"receipt"}]
        assert unit.read(["k"])[0].tobytes() == b"abc"


def test_shm_copies_into_the_arena_and_the_unit_receives_no_payload(tmp_path):
    with StorageUnit("su-shm", 4 << 20, shm_dir=str(tmp_path)) as unit, \
            get_transport("tcp").serve(unit, host="127.0.0.1", port=0, token=TOKEN,
                                       limits=ServerLimits(max_frame_bytes=MAX)) as server, \
            get_transport("shm").connect(server.address, token=TOKEN, max_frame_bytes=MAX, timeout=10) as channel:
        items = [(f"k{i}", blob(300_000, i), {"generation": 100 + i}) for i in range(3)]
        receipts = channel.write_many(items, timeout=5)
        assert [r["generation"] for r in receipts] == [100, 101, 102] and channel.writes_copied == 3
        assert all(_stored(unit, key) == payload.tobytes() for key, payload, _ in items)


def test_a_copy_that_would_start_past_the_reservation_window_is_aborted(tmp_path):
    """A reservation the unit may have let go of by now is never written into: the batch is given back."""
    with StorageUnit("su-window", 4 << 20, shm_dir=str(tmp_path), reservation_timeout_s=1e-9) as unit, \
            get_transport("tcp").serve(unit, host="127.0.0.1", port=0, token=TOKEN,
                                       limits=ServerLimits(max_frame_bytes=MAX)) as server, \
            get_transport("shm").connect(server.address, token=TOKEN, max_frame_bytes=MAX, timeout=10) as channel:
        with pytest.raises(GputqTimeoutError, match="copy of key 'late'.*would start .* past it; write aborted"):
            channel.write_many([("late", blob(1000, 1), {})], timeout=5)
        assert channel.writes_copied == 0
        stats = unit.stats()
        assert stats["keys"] == 0 and stats["reserved"] == 0


def test_an_arena_that_cannot_be_mapped_writable_is_written_over_tcp(tmp_path, monkeypatch):
    with StorageUnit("su-ro", 4 << 20, shm_dir=str(tmp_path)) as unit, \
            get_transport("tcp").serve(unit, host="127.0.0.1", port=0, token=TOKEN,
                                       limits=ServerLimits(max_frame_bytes=MAX)) as server, \
            get_transport("shm").connect(server.address, token=TOKEN, max_frame_bytes=MAX, timeout=10) as channel:
        real = reserved_writes.ArenaMapping

        def refuse_writable(path, nbytes, *, writable=False):
            if writable:
                raise PermissionError(13, "read-only file system")
            return real(path, nbytes)

        monkeypatch.setattr(reserved_writes, "ArenaMapping", refuse_writable)
        assert channel.write("k", b"abc", {}, timeout=5)["nbytes"] == 3
        assert channel.writes_copied == 0 and "read-only file system" in channel.write_fallback_reason
        assert _stored(unit, "k") == b"abc"


def test_bad_reservation_calls_are_typed(tmp_path):
    with StorageUnit("su-calls", 1 << 20, shm_dir=str(tmp_path)) as unit, \
            get_transport("tcp").serve(unit, host="127.0.0.1", port=0, token=TOKEN,
                                       limits=ServerLimits(max_frame_bytes=MAX)) as server, \
            get_transport("tcp").connect(server.address, token=TOKEN, max_frame_bytes=MAX, timeout=10) as channel:
        for method, args in [("reserve_writes", {"items": []}), ("reserve_writes", {"items": [["k", -1, {}]]}),
                             ("commit_writes", {"items": [["k"]]}), ("abort_writes", {"items": "k"})]:
            with pytest.raises(InvalidInputError):
                channel.call(method, timeout=5, **args)
        reply = channel.call("commit_writes", timeout=5, items=[["never-reserved", None]])
        assert set(reply["results"][0]) == {"error"}


@pytest.mark.rdma
@pytest.mark.skipif(nixl_import_error() is not None, reason=f"NIXL not importable: {nixl_import_error()}")
def test_rdma_sends_small_items_in_one_request_and_pushes_large_ones(tmp_path):
    from gputq.transport.nixl import NixlTransport
    from gputq.transport.nixl_push import PUSH_MIN_BYTES

    with StorageUnit("su-rdma", 8 << 20, shm_dir=str(tmp_path)) as unit, \
            NixlTransport().serve(unit, token=TOKEN, limits=ServerLimits(max_frame_bytes=MAX)) as server, \
            NixlTransport().connect(server.address, token=TOKEN, max_frame_bytes=MAX, timeout=30) as channel:
        items = [("small", blob(1000, 1), {}), ("large", blob(PUSH_MIN_BYTES, 2), {}), ("taken", b"x", {}),
                 ("taken", b"y", {})]
        results = channel.write_many(items, timeout=10)
        assert [type(r) for r in results] == [dict, dict, dict, DuplicateKeyError]
        assert _stored(unit, "small") == items[0][1].tobytes() and _stored(unit, "large") == items[1][1].tobytes()


@pytest.mark.parametrize("lifetime", ["soon", True, 0, -1.0, float("inf")])
def test_a_reservation_reply_stating_no_usable_lifetime_moves_nothing(lifetime):
    """A scripted unit's reply: without a lifetime to bound the moves by, none starts."""
    class Control:
        calls = []

        def request(self, method, args, timeout=None, *, keys=(), write=False):
            self.calls.append(method)
            return {"results": [{"offset": 0}], "reservation_s": lifetime}

    moved = []
    writes = reserved_writes.ReservedWrites(Control(), "su-x", 1 << 20, "copy")
    with pytest.raises(ProtocolError, match="reservation lifetime"):
        writes.write_many([("k", b"abc", {})], 5, lambda *args: moved.append(args))
    assert moved == [] and Control.calls == ["reserve_writes"]
