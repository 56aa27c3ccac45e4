"""Space that always comes back: the unit's own timer expires leases and reservations
with no other activity; orphaned arena files that cannot be removed do not stop a unit."""

import gc
import logging
import os
import threading
import time
import weakref

import numpy as np
import pytest

from gputq.errors import InvalidInputError, UnknownKeyError
from gputq.unit import arena as arena_module
from gputq.unit.storage_unit import StorageUnit
from tests.waiting import wait_until

KIB = 1024


def _timer_threads(name):
    return [t for t in threading.enumerate() if t.name == f"gputq-unit-timer-{name}"]


def test_stalled_writer_reservation_is_aborted_by_the_timer():
    with StorageUnit("su-stall", 64 * KIB, reservation_timeout_s=0.3) as unit:
        offset = unit.begin_write("stalled", 8 * KIB, {"partition": "p"}, timeout=600)  # client timeout ignored
        assert unit.stats()["used"] == 8 * KIB and unit.stats()["reservations"] == 1
        # Nothing else happens on the unit: only the timer can free the space.
        wait_until(lambda: unit.stats()["used"] == 0, timeout=10, what="the stalled reservation is aborted")
        stats = unit.stats()
        assert stats["reservations"] == stats["reserved"] == 0 and stats["reservations_expired"] == 1
        assert stats["partitions"] == {}
        with pytest.raises(UnknownKeyError, match="no write in progress for key 'stalled'"):
            unit.commit_write("stalled")  # the writer wakes up too late
        unit.abort_write("stalled")  # its cleanup is harmless
        # The name and the region are free for a retry.
        assert unit.begin_write("stalled", 8 * KIB, {"partition": "p"}, timeout=0) == offset
        assert unit.commit_write("stalled")["nbytes"] == 8 * KIB


def test_a_commit_past_the_reservation_deadline_is_refused_before_the_timer_runs():
    with StorageUnit("su-late", 64 * KIB, reservation_timeout_s=0.2) as unit:
        unit._timer.stop()  # a timer running late: only the commit's own check stands
        unit.begin_write("late", 8 * KIB, {"partition": "p"}, timeout=0)
        reserved = time.monotonic()
        wait_until(lambda: time.monotonic() - reserved > 0.2, timeout=10, what="the reservation deadline passes")
        with pytest.raises(UnknownKeyError, match="no write in progress for key 'late'.*expired after 0.2 s"):
            unit.commit_write("late")
        stats = unit.stats()
        assert (stats["used"], stats["reserved"], stats["reservations"], stats["reservations_expired"]) == (0, 0, 0, 1)


def test_a_late_writer_cannot_commit_or_abort_the_next_write_of_its_key():
    """A writer whose reservation expired, the key reserved again by a retry, names its own write."""
    with StorageUnit("su-retry", 64 * KIB, reservation_timeout_s=0.2) as unit:
        first = unit.begin_write("k", 8 * KIB, {"partition": "p", "generation": 11}, timeout=0)
        wait_until(lambda: unit.stats()["reservations_expired"] == 1, timeout=10, what="the first write expires")
        # The retry gets the same key, very likely the same region.
        assert unit.begin_write("k", 8 * KIB, {"partition": "p", "generation": 22}, timeout=0) == first
        with pytest.raises(UnknownKeyError, match="no write in progress for key 'k'"):
            unit.commit_write("k", 11)  # the late first writer: the retry's bytes are not its to publish
        unit.abort_write("k", 11)  # nor its to drop
        assert unit.stats()["reservations"] == 1 and unit.stats()["keys"] == 0
        receipt = unit.commit_write("k", 22)
        assert receipt["generation"] == 22 and unit.stats()["keys"] == 1
        with pytest.raises(InvalidInputError, match="generation must be an int"):
            unit.commit_write("k", "22")


def test_committed_write_is_not_expired():
    with StorageUnit("su-commit", 64 * KIB, reservation_timeout_s=0.2, lease_timeout_s=0.2) as unit:
        unit.put("kept", np.full(100, 3, np.uint8))
        unit.begin_write("marker", 10, {}, 0)  # expires after "kept" would have
        wait_until(lambda: unit.stats()["reservations_expired"] == 1, timeout=10, what="the marker expires")
        assert np.array_equal(unit.read(["kept"])[0], np.full(100, 3, np.uint8))


def test_dead_reader_lease_is_ended_by_the_timer_with_no_other_activity():
    with StorageUnit("su-dead-reader", 64 * KIB, lease_timeout_s=0.3) as unit:
        unit.put("a", np.ones(16 * KIB, np.uint8), {"partition": "p"})
        lease_id, _ = unit.lease_regions(["a"])  # an rdma reader dies after leasing
        assert unit.release_partition("p") == 1
        assert unit.stats()["used"] == 16 * KIB and unit.stats()["pending_free_bytes"] == 16 * KIB
        wait_until(lambda: unit.stats()["used"] == 0, timeout=10, what="the dead reader's lease ends")
        stats = unit.stats()
        assert stats["leases"] == 0 and stats["leases_expired"] == 1 and stats["pending_free_bytes"] == 0
        assert unit.end_lease(lease_id) is False


def test_release_partition_frees_a_stalled_reservation_once_it_expires():
    with StorageUnit("su-part", 64 * KIB, reservation_timeout_s=0.4) as unit:
        unit.put("done", np.ones(4 * KIB, np.uint8), {"partition": "r0"})
        unit.begin_write("stalled", 8 * KIB, {"partition": "r0"}, timeout=None)
        assert unit.release_partition("r0") == 1  # the committed key; the writer may still be writing
        assert unit.stats()["used"] == 8 * KIB and unit.stats()["partitions"] == {}
        wait_until(lambda: unit.stats()["used"] == 0, timeout=10, what="the reservation expires")
        assert unit.stats()["reservations_expired"] == 1


def test_timer_wakes_early_for_a_deadline_sooner_than_its_sleep():
    # The reservation deadline (60 s) is what the timer sleeps toward; a later lease that
    # expires in 0.2 s must still end on time.
    with StorageUnit("su-poke", 64 * KIB, lease_timeout_s=0.2, reservation_timeout_s=60) as unit:
        unit.begin_write("slow", 10, {}, 0)
        unit.put("a", np.ones(10, np.uint8))
        unit.lease(["a"])
        wait_until(lambda: unit.stats()["leases_expired"] == 1, timeout=5, what="the lease expires")
        assert unit.stats()["reservations"] == 1


def test_close_stops_the_timer_and_is_idempotent():
    unit = StorageUnit("su-close-timer", 4 * KIB)
    assert len(_timer_threads("su-close-timer")) == 1
    unit.close()
    unit.close()
    assert _timer_threads("su-close-timer") == []
    assert unit.stats()["closed"] is True


def test_unclosed_unit_is_collected_and_its_timer_ends():
    unit = StorageUnit("su-forgotten", 4 * KIB)
    path, ref = unit.arena_path, weakref.ref(unit)
    del unit
    gc.collect()
    # The timer holds the unit only while it runs an expiry pass, never while it sleeps.
    wait_until(lambda: ref() is None, timeout=10, what="the unit is collected")
    assert not os.path.exists(path)
    wait_until(lambda: _timer_threads("su-forgotten") == [], timeout=10, what="the timer thread ends")


def test_configured_reservation_timeout_and_write_aging_reach_the_units():
    """``GPUTQ_RESERVATION_TIMEOUT_S`` / ``GPUTQ_WRITE_AGING_S`` end up in every unit a config builds."""
    from gputq.cluster.deploy import local_cluster
    from gputq.config import GputqConfig

    config = GputqConfig.load(env={"GPUTQ_RESERVATION_TIMEOUT_S": "0.3", "GPUTQ_WRITE_AGING_S": "0.25"})
    assert (config.reservation_timeout_s, config.write_aging_s) == (0.3, 0.25)
    with local_cluster(config.replace(num_units=1, unit_capacity_bytes=64 * KIB, transport="tcp",
                                      host="127.0.0.1")) as (_, (service,), clients):
        unit = service.unit
        assert (unit.reservation_timeout_s, unit.write_aging_s) == (0.3, 0.25)
        started = time.monotonic()
        unit.begin_write("stalled", 8 * KIB, {"partition": "p"}, timeout=600)
        # The default (60 s) would hold it for the whole test timeout.
        wait_until(lambda: unit.stats()["reservations_expired"] == 1, timeout=10,
                   what="the stalled reservation expires after the configured 0.3 s")
        assert 0.3 <= time.monotonic() - started < 10 and unit.stats()["used"] == 0


@pytest.mark.parametrize("param", ["lease_timeout_s", "reservation_timeout_s"])
def test_expiry_timeouts_must_be_positive(param):
    with pytest.raises(InvalidInputError, match=param):
        StorageUnit("su-bad", 4 * KIB, **{param: 0})


def test_orphan_sweep_skips_files_it_cannot_remove(tmp_path, monkeypatch, caplog):
    foreign = tmp_path / "gputq-999999998-su-0-abc.arena"  # a dead unit's file of another user
    foreign.write_bytes(b"x")
    removable = tmp_path / "gputq-999999997-su-1-def.arena"
    removable.write_bytes(b"x")
    real_unlink = os.unlink

    def unlink(path, *args, **kwargs):
        if os.fspath(path) == str(foreign):
            raise PermissionError(1, "Operation not permitted", str(path))
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    monkeypatch.setattr(arena_module, "_last_sweep_warning", -float("inf"))
    with caplog.at_level(logging.WARNING, logger="gputq.unit.arena"):
        with StorageUnit("su-starts", 4 * KIB, shm_dir=str(tmp_path)) as unit:
            assert unit.put("a", np.ones(10, np.uint8))["nbytes"] == 10
        with StorageUnit("su-starts-again", 4 * KIB, shm_dir=str(tmp_path)):
            pass
    assert foreign.exists() and not removable.exists()
    warnings = [r for r in caplog.records if "cannot remove" in r.getMessage()]
    assert len(warnings) == 1  # rate-limited: the second start does not repeat it
    assert str(foreign) in warnings[0].getMessage() and "Operation not permitted" in warnings[0].getMessage()


def test_paused_one_sided_reader_learns_its_bytes_are_stale():
    """A reader paused past its lease: the region is reused, and end_lease says so."""
    with StorageUnit("su-paused", 8 * KIB, lease_timeout_s=0.2) as unit:
        unit.put("victim", np.full(8 * KIB, 1, np.uint8), {"partition": "p"})
        lease_id, regions = unit.lease_regions(["victim"])  # the reader posts its READ, then stalls
        offset, nbytes = (int(v) for v in regions[0])
        unit.release(["victim"])
        wait_until(lambda: unit.stats()["leases_expired"] == 1, timeout=10, what="the paused reader's lease expires")
        assert unit.put("intruder", np.full(8 * KIB, 2, np.uint8), {"partition": "p"})["offset"] == offset
        landed = np.frombuffer(unit.arena, np.uint8, nbytes, offset).copy()  # the READ lands late
        assert (landed == 2).all()  # another key's bytes...
        assert unit.end_lease(lease_id) is False  # ...which the confirmation refuses
