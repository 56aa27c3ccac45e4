"""One-sided reads confirmed by their lease's deadline: one round trip, ends in the background."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from gputq.errors import StaleReadError
from gputq.transport import get_transport, lease_ends
from gputq.transport.handler import ServerLimits
from gputq.transport.lease_ends import (
    CLOCK_RATE_SLACK,
    DEADLINE_MARGIN_S,
    LeaseEnds,
    expires_in_of,
    lease_covered,
)
from gputq.unit.storage_unit import StorageUnit
from tests.conftest import nixl_usable
from tests.waiting import wait_until

TOKEN = "e" * 32
ONE_SIDED = ["shm", pytest.param("rdma", marks=[
    pytest.mark.rdma, pytest.mark.skipif(nixl_usable() is not None, reason=str(nixl_usable()))])]


def test_a_lease_is_covered_only_well_inside_its_stated_lifetime():
    started = 100.0
    limit = started + 60.0 * (1 - CLOCK_RATE_SLACK) - DEADLINE_MARGIN_S
    assert lease_covered(started, 60.0, now=started + 1.0)
    assert lease_covered(started, 60.0, now=limit - 1e-6)
    assert not lease_covered(started, 60.0, now=limit + 1e-6)
    assert not lease_covered(started, 0.01, now=started)  # shorter than the margin: always ask the unit
    assert not lease_covered(started, None, now=started)  # a unit that states no lifetime


@pytest.mark.parametrize("reply, expected", [
    ({"expires_in": 60.0}, 60.0), ({"expires_in": 5}, 5.0), ({}, None), ({"expires_in": True}, None),
    ({"expires_in": "60"}, None), ({"expires_in": 0}, None), ({"expires_in": -1.0}, None),
    ({"expires_in": float("inf")}, None), ({"expires_in": float("nan")}, None), (None, None)])
def test_a_stated_lifetime_is_used_only_when_it_is_a_positive_finite_number(reply, expected):
    assert expires_in_of(reply) == expected


@pytest.mark.timeout(30)
def test_deferred_ends_are_sent_in_the_background_and_on_close():
    sent: list[list[int]] = []
    arrived = threading.Event()

    def send(ids):
        sent.append(list(ids))
        arrived.set()

    ends = LeaseEnds(send, "u")
    ends.defer(7)
    assert arrived.wait(5), "the ender thread never sent the deferred end"
    assert sent == [[7]]
    blocked = LeaseEnds(lambda ids: (_ for _ in ()).throw(ConnectionError("unit lost")), "lost")
    blocked.defer(1)  # a failed end is logged; the unit's own timeout ends the lease
    ends.close()
    ends.defer(8)  # after close: sent at once, on this thread
    assert sent[-1] == [8]
    ends.close()  # idempotent


@pytest.mark.timeout(30)
def test_close_waits_for_an_end_the_ender_thread_is_sending():
    sending, release = threading.Event(), threading.Event()
    sent = []

    def slow_send(ids):
        sending.set()
        release.wait(10)
        sent.append(list(ids))

    ends = LeaseEnds(slow_send, "u")
    ends.defer(3)
    assert sending.wait(5), "the ender thread never started sending"
    closed = threading.Event()
    threading.Thread(target=lambda: (ends.close(), closed.set()), daemon=True).start()
    assert not closed.wait(0.3)  # the end is still on its way: close() must not claim it is done
    release.set()
    assert closed.wait(5) and sent == [[3]]


@pytest.mark.timeout(30)
def test_a_dropped_unit_closes_at_once_though_the_ender_thread_is_sending_to_it():
    """A lost unit's channel closes without its ends: the one being sent (to a hung unit, say) is not
    waited for, those still pending are not sent, and later ones go at once."""
    sending, release = threading.Event(), threading.Event()
    sent = []

    def hung_send(ids):
        sent.append(list(ids))
        sending.set()
        release.wait(20)

    ends = LeaseEnds(hung_send, "u")
    ends.defer(3)
    assert sending.wait(5), "the ender thread never started sending"
    ends.defer(4)
    ends.drop()
    closed = threading.Event()
    threading.Thread(target=lambda: (ends.close(), closed.set()), daemon=True).start()
    try:
        assert closed.wait(5)  # the hung send is not waited for
        assert sent == [[3]] and ends.take() == []  # 4 was dropped, never sent
    finally:
        release.set()


@pytest.mark.timeout(30)
def test_a_hung_units_end_holds_up_no_other_units_ends():
    """One process sends the deferred ends of every channel: while one to a hung unit (its control call
    waiting out its timeout) is in flight, another unit's ends still go out within the send delay, and a
    later end of the hung unit waits for its own channel's send, not beside it."""
    hung, release, other = threading.Event(), threading.Event(), threading.Event()
    sent: dict[str, list] = {"hung": [], "live": []}

    def hung_send(ids):
        sent["hung"].append(list(ids))
        hung.set()
        release.wait(20)

    def live_send(ids):
        sent["live"].append(list(ids))
        other.set()

    stuck, live = LeaseEnds(hung_send, "hung"), LeaseEnds(live_send, "live")
    try:
        stuck.defer(1)
        assert hung.wait(5), "the hung unit's end never went out"
        stuck.defer(2)
        live.defer(3)
        assert other.wait(5), "the live unit's end waited behind the hung unit's"
        assert sent == {"hung": [[1]], "live": [[3]]}
    finally:
        release.set()
    wait_until(lambda: sent["hung"] == [[1], [2]], 5, "the hung unit's later end to go out once it answered")
    stuck.close()
    live.close()


def test_take_hands_pending_ids_to_a_request_and_restore_gives_them_back():
    ends = LeaseEnds(lambda ids: None, "u")
    with ends._lock:  # queue without waking the ender, to look at take/restore alone
        ends._ids.extend(range(3000))
    first = ends.take()
    assert first == list(range(1024))  # bounded per request
    ends.restore(first)
    wait_until(lambda: not ends.take(), 5, "the ender thread to send the rest")


def test_a_lease_request_carries_pending_ends_and_gives_them_back_when_it_fails(monkeypatch):
    monkeypatch.setattr(lease_ends._Ender, "wake", lambda self, ends: None)  # keep them queued
    ends = LeaseEnds(lambda ids: None, "u")
    ends.defer(5)
    ends.defer(6)
    sent = []
    reply, started = ends.request_lease(lambda args: sent.append(args) or {"lease_id": 9}, {"keys": ["k"]})
    assert reply == {"lease_id": 9} and sent == [{"keys": ["k"], "end": [5, 6]}] and started > 0
    ends.defer(7)

    def lost(args):
        raise ConnectionError("unit lost")

    with pytest.raises(ConnectionError):
        ends.request_lease(lost, {"keys": ["k"]})
    assert ends.take() == [7]  # the failed request's ends are pending again


@pytest.fixture(params=ONE_SIDED)
def one_sided(request, tmp_path):
    """A real unit with one key, served for ``request.param``, and a channel of that kind."""
    kind = request.param
    unit = StorageUnit("su-ends", 4 << 20, shm_dir=str(tmp_path), lease_timeout_s=60.0)
    blob = np.random.default_rng(5).integers(0, 256, 300_000, dtype=np.uint8)
    unit.put("k", blob, {"partition": "p"})
    serving = "rdma" if kind == "rdma" else "tcp"
    server = get_transport(serving).serve(unit, host="127.0.0.1", port=0, token=TOKEN,
                                          limits=ServerLimits(max_frame_bytes=1 << 26))
    channel = get_transport(kind).connect(server.address, token=TOKEN, max_frame_bytes=1 << 26, timeout=10)
    try:
        yield unit, blob, channel
    finally:
        channel.close()
        server.close()
        unit.close()


@pytest.mark.timeout(60)
def test_a_read_inside_its_lease_returns_without_waiting_for_the_end(one_sided, monkeypatch):
    unit, blob, channel = one_sided
    release_end = threading.Event()
    real_end = unit.end_lease

    def slow_end(lease_id):
        release_end.wait(30)
        return real_end(lease_id)

    monkeypatch.setattr(unit, "end_lease", slow_end)
    dest = np.empty(blob.size, np.uint8)
    done = threading.Event()
    reader = threading.Thread(target=lambda: (channel.read(["k"], dest, timeout=10), done.set()), daemon=True)
    reader.start()
    assert done.wait(10), "the read waited for its lease to end"
    assert np.array_equal(dest, blob)
    assert unit.stats()["leases"] == 1  # the end is held up on the unit, not on the reader
    release_end.set()
    wait_until(lambda: unit.stats()["leases"] == 0, 10, "the deferred lease to end")
    assert unit.stats()["leases_expired"] == 0  # ended by the reader, not by the unit's timer


@pytest.mark.timeout(60)
def test_the_next_lease_carries_the_ends_still_pending(one_sided, monkeypatch):
    unit, blob, channel = one_sided
    monkeypatch.setattr(lease_ends._Ender, "wake", lambda self, ends: None)  # no background sends
    dest = np.empty(blob.size, np.uint8)
    for reads in range(1, 4):
        channel.read(["k"], dest, timeout=10)
        assert np.array_equal(dest, blob)
        assert unit.stats()["leases"] == 1, f"after read {reads}"  # only the last read's lease is held


@pytest.mark.timeout(60)
def test_a_read_past_its_window_asks_the_unit_and_an_expired_lease_is_stale(one_sided, monkeypatch):
    unit, blob, channel = one_sided
    # what unit.lease_timeout_s states: a lifetime no read can be proven inside
    monkeypatch.setattr(unit, "_lease_timeout_s", 0.01)
    asked = []
    real_end = unit.end_lease

    def expired_end(lease_id):
        asked.append(lease_id)
        real_end(lease_id)
        return False

    monkeypatch.setattr(unit, "end_lease", expired_end)
    with pytest.raises(StaleReadError, match="expired"):
        channel.read(["k"], np.empty(blob.size, np.uint8), timeout=10)
    assert len(asked) == 1
    monkeypatch.setattr(unit, "end_lease", real_end)
    dest = np.empty(blob.size, np.uint8)
    assert channel.read(["k"], dest, timeout=10) == [blob.size] and np.array_equal(dest, blob)
    assert unit.stats()["leases"] == 0  # confirmed synchronously: ended before the read returned


@pytest.mark.timeout(60)
def test_closing_the_channel_ends_the_leases_it_deferred(one_sided, monkeypatch):
    unit, blob, channel = one_sided
    monkeypatch.setattr(lease_ends._Ender, "wake", lambda self, ends: None)  # no background sends
    channel.read(["k"], np.empty(blob.size, np.uint8), timeout=10)
    assert unit.stats()["leases"] == 1  # deferred, and nothing sent it yet
    channel.close()
    assert unit.stats()["leases"] == 0  # close() sent the end before returning


def test_deferred_ends_wake_the_ender_once_until_it_has_sent_them(monkeypatch):
    # Reads that follow each other must not each pay for waking a thread: the ender wakes
    # once, and by the time it sends, the next lease request has usually carried the ends.
    woken, sent = [], []
    monkeypatch.setattr(lease_ends._Ender, "wake", lambda self, ends: woken.append(ends))
    ends = LeaseEnds(sent.append, "u")
    for lease_id in (1, 2, 3):
        ends.defer(lease_id)
    assert woken == [ends] and sent == []
    ends.request_lease(lambda args: {"lease_id": 4}, {"keys": ["k"]})  # carries 1, 2, 3
    ends.defer(4)
    assert len(woken) == 1  # still scheduled: the ender has not had its turn
    ends.send_scheduled()
    assert sent == [[4]]
    ends.defer(5)
    assert len(woken) == 2  # scheduled anew once the ender sent what it had
