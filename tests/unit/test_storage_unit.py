"""StorageUnit and Arena: storage, typed errors, back-pressure, lifecycle, leases, threads."""

import os
import random
import threading
import time

import msgpack
import numpy as np
import pytest

from gputq.errors import (
    CapacityError,
    ClosedError,
    DuplicateKeyError,
    InvalidInputError,
    RequestTooLargeError,
    UnknownKeyError,
)
from gputq.transport.handler import ArenaHandler, Lease
from gputq.unit.arena import Arena, default_shm_dir
from gputq.unit.storage_unit import DEFAULT_PARTITION, StorageUnit
from tests.sockets import descriptor_targets
from tests.waiting import wait_until

KIB = 1024


@pytest.fixture
def unit():
    with StorageUnit("su-test", 64 * KIB, put_timeout_s=0.2) as su:
        yield su


def blob(nbytes, seed=0):
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


# -- arena ---------------------------------------------------------------------------


def test_arena_is_shared_memory_file_removed_on_close():
    arena = Arena(8 * KIB, "a/b c")
    assert os.path.dirname(arena.path) == default_shm_dir() and os.path.exists(arena.path)
    assert "a_b_c" in os.path.basename(arena.path)
    assert arena.view.nbytes == arena.array.nbytes == 8 * KIB and not arena.view.readonly
    arena.array[100:104] = [1, 2, 3, 4]
    other = np.memmap(arena.path, dtype=np.uint8, mode="r")  # a second mapping by path
    assert other[100:104].tolist() == [1, 2, 3, 4]
    del other
    arena.close()
    arena.close()
    assert arena.closed and not os.path.exists(arena.path) and not arena.pinned


def test_arena_in_explicit_directory_unpinned(tmp_path):
    with Arena(4 * KIB, "dir", shm_dir=str(tmp_path), pin=False) as arena:
        assert os.path.dirname(arena.path) == str(tmp_path) and not arena.pinned
        assert os.path.getsize(arena.path) == 4 * KIB
    assert not os.listdir(tmp_path)


def test_arena_close_with_outside_view_keeps_memory_valid():
    arena = Arena(4 * KIB, "held")
    held = arena.array[:16]
    held[:] = 7
    arena.close()  # must not unmap under the outside view
    assert held.tolist() == [7] * 16 and not os.path.exists(arena.path)


def test_arena_rejects_empty_capacity():
    with pytest.raises(InvalidInputError):
        Arena(0, "empty")


def _cuda_usable():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@pytest.mark.gpu
def test_arena_is_pinned_with_cuda():
    if not _cuda_usable():
        pytest.skip("no usable CUDA device")
    import cupy
    with Arena(1 << 20, "pinned") as arena:
        assert arena.pinned
        attrs = cupy.cuda.runtime.pointerGetAttributes(arena.address)
        assert attrs.type == cupy.cuda.runtime.memoryTypeHost
        arena.array[:] = blob(1 << 20, seed=3)
        dev = cupy.empty(1 << 20, dtype=cupy.uint8)
        dev.set(arena.array)
        assert np.array_equal(dev.get(), arena.array)
    assert not arena.pinned


def test_arena_not_pinned_without_cuda():
    if _cuda_usable():
        pytest.skip("CUDA is usable here")
    with Arena(4 * KIB, "plain") as arena:
        assert arena.pinned is False


# -- storage -------------------------------------------------------------------------


def test_implements_arena_handler(unit):
    assert isinstance(unit, ArenaHandler)
    assert unit.arena.nbytes == 64 * KIB and unit.capacity == 64 * KIB
    assert os.path.exists(unit.arena_path)


def test_put_read_round_trip_is_bit_exact(unit):
    ids = np.random.default_rng(1).integers(0, 65536, (37, 5, 8), dtype=np.uint16)
    logp = np.random.default_rng(2).standard_normal(41).astype(np.float32)
    logp[3] = np.nan
    r1 = unit.put("s0/routed_experts", ids, {"field": "routed_experts", "partition": "r0"})
    r2 = unit.put("s0/logprobs", logp, {"field": "logprobs", "partition": "r0"})
    unit.put("empty", np.zeros((0, 5, 8), np.uint16))
    assert r1["nbytes"] == ids.nbytes and r2["nbytes"] == logp.nbytes and r1["offset"] % 256 == 0
    assert r1["incarnation"] == r2["incarnation"] == unit.incarnation
    assert r1["generation"] != r2["generation"]  # drawn at random without a writer's generation
    assert all(1 <= r["generation"] < 2**63 for r in (r1, r2))
    got_ids, got_logp, empty = unit.read(["s0/routed_experts", "s0/logprobs", "empty"])
    assert np.array_equal(got_ids.view(np.uint16).reshape(ids.shape), ids)
    assert got_logp.tobytes() == logp.tobytes()  # NaN included
    assert empty.size == 0
    meta = unit.lookup(["s0/logprobs"])[0]
    assert meta["meta"]["field"] == "logprobs" and meta["holders"] == {"r0": 1}
    assert meta["offset"] == r2["offset"] and meta["generation"] == r2["generation"]


def test_transport_style_write_lease_and_abort(unit):
    data = blob(1000)
    off = unit.begin_write("k", 1000, {"partition": 7}, timeout=None)
    with pytest.raises(UnknownKeyError):
        unit.lease(["k"])  # reserved, not readable yet
    unit.arena[off:off + 1000] = data
    receipt = unit.commit_write("k")
    assert receipt["offset"] == off and receipt["nbytes"] == 1000
    lease = unit.lease(["k", "k"])
    assert isinstance(lease, Lease) and len(lease.regions) == 2
    assert lease.regions[0].offset == off and lease.generations[0] == receipt["generation"]
    assert unit.end_lease(lease.lease_id) is True
    assert unit.end_lease(lease.lease_id) is False  # idempotent: no longer held
    off2 = unit.begin_write("aborted", 2000, {}, 0.1)
    used = unit.stats()["used"]
    unit.abort_write("aborted")
    unit.abort_write("aborted")
    assert unit.stats()["used"] == used - 2048
    with pytest.raises(UnknownKeyError):
        unit.commit_write("aborted")
    assert unit.begin_write("again", 2000, {}, 0.1) == off2
    with pytest.raises(InvalidInputError):
        unit.abort_write("k")  # committed keys are deleted, not aborted
    assert unit.lookup(["k"])[0]["holders"] == {"7": 1}


def test_typed_errors(unit):
    unit.put("a", blob(10))
    with pytest.raises(DuplicateKeyError) as dup:
        unit.put("a", blob(10))
    assert isinstance(dup.value, ValueError) and "'a'" in str(dup.value)
    with pytest.raises(RequestTooLargeError):
        unit.put("huge", blob(64 * KIB + 1))
    with pytest.raises(UnknownKeyError) as unknown:
        unit.lease(["a", "missing", "gone"])
    assert isinstance(unknown.value, KeyError) and "'missing'" in str(unknown.value)
    assert unit.stats()["leases"] == 0  # the failed lease pinned nothing
    for call in (lambda: unit.read(["nope"]), lambda: unit.lookup(["nope"]),
                 lambda: unit.release(["nope"]), lambda: unit.add_ref(["nope"], "p"),
                 lambda: unit.transfer(["nope"], "a", "b")):
        with pytest.raises(UnknownKeyError):
            call()
    with pytest.raises(InvalidInputError):
        unit.begin_write("", 1, {}, 0)
    with pytest.raises(InvalidInputError):
        unit.begin_write("neg", -1, {}, 0)
    with pytest.raises(InvalidInputError):
        unit.put("strided", np.arange(10)[::2])


# -- back-pressure -----------------------------------------------------------------------


def _fill(su, prefix="fill", partition="r0"):
    keys = []
    while su.stats()["largest_free"] >= 4 * KIB:
        keys.append(f"{prefix}{len(keys)}")
        su.put(keys[-1], blob(4 * KIB, len(keys)), {"partition": partition})
    return keys


def test_full_unit_waits_and_succeeds_after_release(unit):
    keys = _fill(unit)
    done = threading.Event()
    result = {}

    def writer():
        result["receipt"] = unit.put("late", blob(4 * KIB, 99), {"partition": "r1"}, timeout=30)
        done.set()

    thread = threading.Thread(target=writer)
    thread.start()
    wait_until(lambda: unit.stats()["writers_waiting"] == 1, timeout=10, what="the writer waits")
    assert not done.is_set()  # still waiting: the unit is full
    unit.release([keys[3]])
    assert done.wait(10)
    thread.join(10)
    assert result["receipt"]["offset"] == unit.lookup(["late"])[0]["offset"]
    assert np.array_equal(unit.read(["late"])[0], blob(4 * KIB, 99))
    stats = unit.stats()
    assert stats["waits"] == 1 and stats["wait_us"] > 0 and stats["writers_waiting"] == 0


def test_full_unit_raises_capacity_error_after_timeout(unit):
    keys = _fill(unit)
    before = unit.read(keys)
    t0 = time.monotonic()
    with pytest.raises(CapacityError) as err:
        unit.put("overflow", blob(5000))  # put_timeout_s = 0.2
    assert time.monotonic() - t0 >= 0.2  # it waited its whole timeout
    assert isinstance(err.value, TimeoutError)
    assert "'overflow'" in str(err.value) and "5000 bytes" in str(err.value)
    assert f"free {unit.stats()['free']} bytes" in str(err.value)
    with pytest.raises(UnknownKeyError):
        unit.lookup(["overflow"])
    assert all(np.array_equal(a, b) for a, b in zip(before, unit.read(keys)))  # nothing dropped
    assert unit.stats()["capacity_errors"] == 1


def test_close_wakes_waiting_writer(unit):
    _fill(unit)
    errors = []
    thread = threading.Thread(
        target=lambda: errors.append(pytest.raises(ClosedError, unit.put, "w", blob(8), None, 5)))
    thread.start()
    wait_until(lambda: unit.stats()["writers_waiting"] == 1, timeout=10, what="the writer waits")
    unit.close()
    unit.close()
    thread.join(10)
    assert not thread.is_alive() and len(errors) == 1
    with pytest.raises(ClosedError):
        unit.lease([])
    assert not os.path.exists(unit.arena_path)


# -- lifecycle ------------------------------------------------------------------------------


def test_shared_step_freed_once_at_last_reference(unit):
    unit.put("step", blob(300), {"partition": "r0"})
    unit.add_ref(["step"], "r1")  # async training: a second rollout shares it
    unit.add_ref(["step"], "r1")  # two segments of r1 use it
    assert unit.lookup(["step"])[0]["holders"] == {"r0": 1, "r1": 2}
    assert unit.release_partition("r0") == 0
    assert unit.release(["step"], "r1") == 0
    assert np.array_equal(unit.read(["step"])[0], blob(300))
    assert unit.release(["step"], "r1") == 1
    with pytest.raises(UnknownKeyError):
        unit.read(["step"])
    assert unit.stats()["used"] == 0


def test_transfer_survives_release_of_old_partition(unit):
    unit.put("done", blob(100, 1), {"partition": "r0"})
    unit.put("partial", blob(100, 2), {"partition": "r0"})
    offset = unit.lookup(["partial"])[0]["offset"]
    assert unit.transfer(["partial"], "r0", "r1") == 1
    assert unit.release_partition("r0") == 1
    meta = unit.lookup(["partial"])[0]
    assert meta["holders"] == {"r1": 1} and meta["offset"] == offset  # no bytes moved
    assert np.array_equal(unit.read(["partial"])[0], blob(100, 2))
    with pytest.raises(UnknownKeyError):
        unit.lookup(["done"])
    with pytest.raises(InvalidInputError):
        unit.transfer(["partial"], "r0", "r2")  # r0 holds nothing any more
    assert unit.release_partition("r1") == 1 and unit.stats()["used"] == 0


def test_filtered_sample_released_at_once(unit):
    unit.put("shared", blob(64), {"partition": "r0"})
    unit.put("only-filtered", blob(64), {"partition": "r0"})
    unit.add_ref(["shared"], "r0")  # the kept sample also references it
    used = unit.stats()["used"]
    assert unit.release(["shared", "only-filtered"], "r0") == 1
    assert unit.stats()["used"] == used - 256
    assert unit.lookup(["shared"])[0]["holders"] == {"r0": 1}


def test_two_partitions_live(unit):
    unit.put("a", blob(10), {"partition": 1})
    unit.put("b", blob(20), {"partition": 2})
    unit.put("c", blob(30))
    parts = unit.stats()["partitions"]
    assert parts == {"1": {"keys": 1, "bytes": 10}, "2": {"keys": 1, "bytes": 20},
                     DEFAULT_PARTITION: {"keys": 1, "bytes": 30}}
    assert unit.release_partition(1) == 1
    assert unit.release_partition(1) == 0 and unit.release_partition("never") == 0
    assert [m["key"] for m in unit.lookup(["b", "c"])] == ["b", "c"]
    assert set(unit.stats()["partitions"]) == {"2", DEFAULT_PARTITION}


def test_release_validation_is_atomic(unit):
    unit.put("a", blob(10), {"partition": "r0"})
    with pytest.raises(UnknownKeyError):
        unit.release(["a", "missing"])
    with pytest.raises(InvalidInputError):
        unit.release(["a"], "r9")
    with pytest.raises(InvalidInputError):
        unit.release(["a", "a"], "r0")  # r0 holds one reference, not two
    assert unit.lookup(["a"])[0]["holders"] == {"r0": 1}
    assert unit.release(["a", "missing"], missing_ok=True) == 1


def test_delete_ignores_references(unit):
    unit.put("a", blob(10), {"partition": "r0"})
    unit.add_ref(["a"], "r1")
    assert unit.delete(["a", "unknown"]) == 1
    assert unit.stats()["partitions"] == {} and unit.stats()["used"] == 0


def test_partition_released_during_write_fails_the_commit(unit):
    off = unit.begin_write("inflight", 100, {"partition": "r0"}, 0.1)
    assert unit.release_partition("r0") == 0  # not a key yet
    unit.arena[off:off + 100] = blob(100)
    with pytest.raises(UnknownKeyError):
        unit.commit_write("inflight")
    assert unit.stats()["used"] == 0 and unit.stats()["reserved"] == 0


# -- leases ---------------------------------------------------------------------------------


def test_release_during_lease_keeps_bytes_until_lease_ends():
    with StorageUnit("lease", 8 * KIB + 256, put_timeout_s=0.1) as su:
        su.put("a", blob(4 * KIB, 1))
        lease = su.lease(["a"])
        region = lease.regions[0]
        assert su.release(["a"]) == 1
        with pytest.raises(UnknownKeyError):
            su.lease(["a"])  # the table forgets it at once
        assert su.stats()["pending_free_bytes"] == 4 * KIB
        receipt = su.put("b", blob(4 * KIB, 2))  # must not land on a's region
        assert receipt["offset"] != region.offset
        with pytest.raises(CapacityError):
            su.put("c", blob(4 * KIB, 3))
        leased = np.frombuffer(su.arena, np.uint8, region.nbytes, region.offset)
        assert np.array_equal(leased, blob(4 * KIB, 1))
        su.put("a", blob(16, 4))  # the key name may be reused; the region may not
        su.release(["a"])
        su.end_lease(lease.lease_id)
        assert su.stats()["pending_free_bytes"] == 0
        assert su.put("c", blob(4 * KIB, 3))["offset"] == region.offset  # space reused
        su.end_lease(lease.lease_id)
        assert np.array_equal(su.read(["b"])[0], blob(4 * KIB, 2))


# -- control -------------------------------------------------------------------------------


def test_control_dispatch_is_msgpack_able(unit):
    unit.put("a", blob(10), {"partition": "r0", "row_shape": (2, 5)})
    unit.put("b", blob(10), {"partition": "r0"})
    assert unit.control("add_ref", {"keys": ["a"], "partition": "r1"}) is None
    looked = msgpack.unpackb(msgpack.packb(unit.control("lookup", {"keys": ["a"]})))
    assert looked[0]["meta"]["row_shape"] == [2, 5] and looked[0]["holders"] == {"r0": 1, "r1": 1}
    stats = msgpack.unpackb(msgpack.packb(unit.control("stats", {})))
    assert stats["keys"] == 2 and stats["partitions"]["r1"] == {"keys": 1, "bytes": 10}
    assert unit.control("release_partition", {"partition": "r0"}) == 1
    assert unit.control("release", {"keys": ["a"], "partition": "r1"}) == 1
    with pytest.raises(InvalidInputError):
        unit.control("close", {})
    with pytest.raises(InvalidInputError):
        unit.control("release", {"bogus": 1})


# -- threads -------------------------------------------------------------------------------


def test_concurrent_put_lease_release_accounting():
    with StorageUnit("threads", 2048 * KIB, put_timeout_s=10) as su:
        errors = []

        def worker(w):
            rng = random.Random(w)
            try:
                for i in range(60):
                    key, data = f"w{w}/{i}", blob(rng.randrange(0, 8 * KIB), seed=w * 1000 + i)
                    su.put(key, data, {"partition": f"p{w % 2}"})
                    lease = su.lease([key])
                    region = lease.regions[0]
                    released = rng.random() < 0.5
                    if released:
                        su.release([key])  # released while leased: bytes must stay
                    got = np.frombuffer(su.arena, np.uint8, region.nbytes, region.offset).copy()
                    su.end_lease(lease.lease_id)
                    assert np.array_equal(got, data), key
                    if not released and rng.random() < 0.3:
                        su.add_ref([key], "shared")
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        for partition in list(su.stats()["partitions"]):
            su.release_partition(partition)
        stats = su.stats()
        assert stats["used"] == 0 and stats["keys"] == 0 and stats["leases"] == 0
        assert stats["largest_free"] == stats["capacity"] and stats["free_blocks"] == 1


def test_lease_regions_matches_lease_and_pins():
    with StorageUnit("su-regions", 1 << 20) as unit:
        for i in range(5):
            unit.put(f"k{i}", np.full(1000 + i, i, np.uint8), {"partition": "p"})
        keys = ["k3", "k0", "k4"]
        lease = unit.lease(keys)
        lease_id, regions = unit.lease_regions(keys)
        assert regions.dtype == np.int64 and regions.shape == (3, 2)
        assert [tuple(r) for r in regions.tolist()] == [(r.offset, r.nbytes) for r in lease.regions]
        unit.release(["k3"])
        unit.end_lease(lease.lease_id)
        assert unit.stats()["pending_free_bytes"] == 1003  # still pinned by the second lease
        unit.end_lease(lease_id)
        assert unit.stats()["pending_free_bytes"] == 0
        with pytest.raises(UnknownKeyError, match="k3"):
            unit.lease_regions(["k3"])


def test_release_missing_ok_skips_references_moved_away():
    with StorageUnit("su-moved", 1 << 20) as unit:
        for key in ("a", "b"):
            unit.put(key, np.ones(10, np.uint8), {"partition": "p0"})
        unit.transfer(["b"], "p0", "p1")  # a partial rollout carried b forward
        assert unit.release(["a", "b"], "p0", missing_ok=True) == 1
        assert unit.lookup(["b"])  # still held by p1
        with pytest.raises(InvalidInputError):
            unit.release(["b"], "p0")


def test_arena_that_does_not_fit_its_folder_is_a_config_error(monkeypatch, tmp_path):
    import errno

    from gputq.errors import ConfigError

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(ConfigError, match="lower unit_capacity_bytes"):
        Arena(1 << 20, "too-big", shm_dir=str(tmp_path), pin=False)
    assert list(tmp_path.iterdir()) == []  # the backing file was removed


def test_orphaned_arena_files_are_swept(tmp_path):
    from gputq.unit.arena import sweep_orphans

    dead = tmp_path / "gputq-999999999-su-0-abc.arena"  # no such pid
    dead.write_bytes(b"x")
    mine = tmp_path / f"gputq-{os.getpid()}-su-1-def.arena"
    mine.write_bytes(b"x")
    other = tmp_path / "unrelated.arena"
    other.write_bytes(b"x")
    with Arena(1 << 16, "fresh", shm_dir=str(tmp_path), pin=False) as arena:
        assert not dead.exists() and mine.exists() and other.exists()
        assert os.path.basename(arena.path).startswith(f"gputq-{os.getpid()}-fresh-")
    assert sweep_orphans(str(tmp_path)) == []


def test_lease_of_a_dead_reader_expires_and_frees_released_space():
    with StorageUnit("su-expire", 4096, lease_timeout_s=0.3, alignment=256) as unit:
        unit.put("a", np.ones(4096, np.uint8), {"partition": "p"})
        lease = unit.lease(["a"])  # the reader dies before end_lease
        unit.release(["a"])
        assert unit.stats()["pending_free_bytes"] == 4096
        unit.put("b", np.full(4096, 2, np.uint8), {"partition": "p"}, timeout=10)  # space comes back
        stats = unit.stats()
        assert stats["leases_expired"] == 1 and stats["pending_free_bytes"] == 0 and stats["leases"] == 0
        assert unit.end_lease(lease.lease_id) is False  # the late reader learns its bytes are not a's
        assert np.array_equal(unit.read(["b"])[0], np.full(4096, 2, np.uint8))


def test_waiting_writer_gets_space_when_a_stale_lease_expires():
    with StorageUnit("su-expire-wait", 4096, lease_timeout_s=0.2) as unit:
        unit.put("a", np.ones(4096, np.uint8), {"partition": "p"})
        unit.lease(["a"])
        unit.release(["a"])
        started = time.monotonic()
        unit.put("b", np.ones(4096, np.uint8), {"partition": "p"}, timeout=30)  # waits, then fits
        assert time.monotonic() - started >= 0.15  # not before the lease's deadline
        assert unit.stats()["leases_expired"] == 1


def test_a_closed_unit_leaves_no_open_descriptor_behind():
    """Its key directory's view used to keep the mapping, and a descriptor, until garbage collection.

    The test looks for the units' own files (arena and key directory): a count of all
    descriptors also moves when an earlier test's sockets are collected meanwhile.
    """
    closed = []  # still referenced, as tests and services keep closed units
    for i in range(20):
        unit = StorageUnit(f"fd-{i}", 1 << 16)
        unit.put("a", np.zeros(16, np.uint8))
        files = (unit.arena_path, unit.directory_file["path"])
        assert sum(t.startswith(files) for t in descriptor_targets()) == 2  # each mapping holds one
        unit.close()
        closed.append(unit)
    paths = [path for unit in closed for path in (unit.arena_path, unit.directory_file["path"])]
    assert [t for t in descriptor_targets() if t.startswith(tuple(paths))] == []
    with open("/proc/self/maps") as maps:
        assert [line for line in maps if any(path in line for path in paths)] == []
