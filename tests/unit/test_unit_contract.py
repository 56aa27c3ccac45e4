"""The StorageUnit's side of the cross-branch contract: incarnation, generations,
stale reads, non-expiring leases, exactly-once release, the keys method, typed control errors."""

import subprocess
import sys
import threading

import msgpack
import numpy as np
import pytest

from gputq.errors import (
    CapacityError,
    ClosedError,
    DuplicateKeyError,
    GputqError,
    InvalidInputError,
    PartialFailureError,
    StaleReadError,
    UnknownKeyError,
)
from gputq.transport.handler import ServerLimits
from gputq.transport.wire import error_from_wire, error_to_wire
from gputq.unit.storage_unit import CONTROL_METHODS, DEFAULT_PARTITION, StorageUnit
from tests.waiting import wait_until

KIB = 1024


@pytest.fixture
def unit():
    with StorageUnit("su-0", 64 * KIB, put_timeout_s=0.2) as su:
        yield su


def test_incarnation_is_new_per_unit_and_in_receipts_and_stats(unit):
    with StorageUnit("su-0", 4 * KIB) as twin:
        assert twin.incarnation != unit.incarnation
    assert len(unit.incarnation) == 16 and int(unit.incarnation, 16) >= 0
    receipt = unit.put("a", np.ones(10, np.uint8))
    assert receipt["incarnation"] == unit.incarnation == unit.stats()["incarnation"]
    assert set(receipt) == {"offset", "nbytes", "generation", "incarnation"}


def test_writer_chosen_generation_is_kept(unit):
    receipt = unit.put("a", np.ones(10, np.uint8), {"generation": 12345, "partition": "p"})
    assert receipt["generation"] == 12345
    looked = unit.lookup(["a"])[0]
    assert looked["generation"] == 12345 and "generation" not in looked["meta"]
    assert unit.put("b", np.ones(1, np.uint8), {"generation": 2**63 - 1})["generation"] == 2**63 - 1
    for bad in (0, -1, 2**63, "7", 1.5, True):
        with pytest.raises(InvalidInputError, match="generation"):
            unit.begin_write("c", 1, {"generation": bad}, 0)
    assert unit.stats()["reserved"] == 0


def test_begin_write_timeouts_of_any_size(unit):
    with pytest.raises(InvalidInputError, match="timeout"):
        unit.begin_write("a", 1, {}, "5")
    unit.begin_write("b", 64 * KIB, {}, float("inf"))
    with pytest.raises(CapacityError):
        unit.begin_write("a", 1, {}, float("nan"))  # NaN waits for nothing
    waiting = threading.Thread(target=lambda: pytest.raises(ClosedError, unit.begin_write, "c", 1, {},
                                                            float("inf")))
    waiting.start()
    wait_until(lambda: unit.stats()["writers_waiting"] == 1, timeout=10, what="an endless writer waits")
    unit.close()
    waiting.join(10)
    assert not waiting.is_alive()


def test_lease_checks_incarnation_then_generations(unit):
    gen_a = unit.put("a", np.full(10, 1, np.uint8), {"generation": 11})["generation"]
    unit.put("b", np.full(10, 2, np.uint8), {"generation": 22})
    lease = unit.lease(["a", "b"], [gen_a, 22], unit.incarnation)
    assert lease.generations == (11, 22) and unit.end_lease(lease.lease_id) is True
    lease_id, regions = unit.lease_regions(["a", "b"], [0, None], unit.incarnation)  # 0/None: unchecked
    assert regions.shape == (2, 2) and unit.end_lease(lease_id) is True

    with pytest.raises(StaleReadError, match=r"unit su-0 restarted: reference is for incarnation "
                                             r"0123456789abcdef, unit is incarnation " + unit.incarnation):
        unit.lease(["a"], incarnation="0123456789abcdef")
    with pytest.raises(StaleReadError, match=r"'b' is generation 22, the reference expects generation 23"):
        unit.lease_regions(["a", "b"], [11, 23])
    with pytest.raises(UnknownKeyError, match=r"unit su-0: unknown key 'gone'"):
        unit.lease(["a", "gone"], [11, 5])
    assert unit.stats()["leases"] == 0  # failed leases pin nothing

    # Deleted and written again under the same name: the old reference is stale, not the new bytes.
    unit.delete(["a"])
    unit.put("a", np.full(10, 9, np.uint8), {"generation": 99})
    with pytest.raises(StaleReadError, match="generation 99"):
        unit.lease(["a"], [gen_a])
    assert np.array_equal(unit.read(["a"])[0], np.full(10, 9, np.uint8))


@pytest.mark.parametrize("generations, incarnation", [
    ("11", None), ([11], None), ([11, "x"], None), ([11, True], None), ({"a": 1}, None), ([1, 2], 5)])
def test_malformed_lease_arguments_are_invalid_input(unit, generations, incarnation):
    unit.put("a", np.ones(10, np.uint8), {"generation": 11})
    unit.put("b", np.ones(10, np.uint8), {"generation": 5})  # matches none of the malformed entries
    with pytest.raises(InvalidInputError):
        unit.lease(["a", "b"], generations, incarnation)
    assert unit.stats()["leases"] == 0


@pytest.mark.parametrize("keys", ["a", [["a"]], [1], [None], {"a": 1}, None])
def test_malformed_keys_are_invalid_input_everywhere(unit, keys):
    unit.put("a", np.ones(10, np.uint8))
    for call in (lambda: unit.lease(keys), lambda: unit.lease_regions(keys), lambda: unit.read(keys),
                 lambda: unit.release(keys), lambda: unit.lookup(keys), lambda: unit.delete(keys),
                 lambda: unit.add_ref(keys, "p"), lambda: unit.transfer(keys, "p", "q")):
        with pytest.raises(InvalidInputError, match="keys must be a list of str"):
            call()
    assert unit.lookup(["a"])[0]["holders"] == {DEFAULT_PARTITION: 1}


def test_non_expiring_lease_outlives_the_lease_timeout():
    with StorageUnit("su-hold", 8 * KIB, lease_timeout_s=0.05) as unit:
        unit.put("a", np.full(4 * KIB, 7, np.uint8))
        held = unit.lease(["a"], expires=False)
        expiring = unit.lease(["a"])
        unit.release(["a"])
        wait_until(lambda: unit.stats()["leases_expired"] == 1, timeout=10, what="the expiring lease ends")
        stats = unit.stats()
        assert stats["leases"] == 1 and stats["pending_free_bytes"] == 4 * KIB  # still pinned by `held`
        region = held.regions[0]
        assert np.array_equal(unit._arena.array[region.offset:region.offset + region.nbytes],
                              np.full(4 * KIB, 7, np.uint8))
        assert unit.end_lease(expiring.lease_id) is False  # expired: the reader must not trust its bytes
        assert unit.end_lease(held.lease_id) is True
        assert unit.end_lease(held.lease_id) is False  # idempotent
        assert unit.stats()["pending_free_bytes"] == 0 and unit.stats()["used"] == 0
        assert unit.end_lease(10**15) is False  # unknown
        for bad in ("1", 1.0, None, True):
            with pytest.raises(InvalidInputError, match="lease_id"):
                unit.end_lease(bad)
        with pytest.raises(InvalidInputError, match="expires"):
            unit.lease([], expires="no")


def test_release_id_makes_a_release_exactly_once(unit):
    for key in ("a", "b"):
        unit.put(key, np.ones(10, np.uint8), {"partition": "p"})
    unit.add_ref(["a", "b"], "p")  # two segments use each key
    assert unit.release(["a", "b"], "p", release_id="rank0-shard7") == 0
    assert unit.release(["a", "b"], "p", release_id="rank0-shard7") == 0  # a retry: no-op
    assert unit.lookup(["a"])[0]["holders"] == {"p": 1}
    assert unit.release(["a"], "p", release_id="rank1-shard7") == 1
    assert unit.release(["a"], "p", release_id="rank1-shard7") == 0  # not UnknownKeyError: a no-op
    with pytest.raises(UnknownKeyError):
        unit.release(["a"], "p", release_id="rank2-shard7")
    # A release that failed was not applied, so its id is not spent.
    with pytest.raises(InvalidInputError):
        unit.release(["b", "b"], "p", release_id="twice")
    assert unit.release(["b"], "p", release_id="twice") == 1
    # Ids are per partition, and forgotten when their partition is released.
    unit.put("c", np.ones(10, np.uint8), {"partition": "q"})
    unit.add_ref(["c"], "q")
    assert unit.release(["c"], "q", release_id="x") == 0
    assert unit.release(["c"], "q", release_id="x") == 0
    assert unit.lookup(["c"])[0]["holders"] == {"q": 1}
    assert unit.release_partition("q") == 1
    unit.put("c", np.ones(10, np.uint8), {"partition": "q"})
    assert unit.release(["c"], "q", release_id="x") == 1  # a new rollout may reuse the id
    for bad in ("", 5, ["x"], "x" * 257):
        with pytest.raises(InvalidInputError, match="release_id"):
            unit.release([], "p", release_id=bad)


def test_release_ids_are_bounded():
    from gputq.unit.keytable import ReleaseIds

    ids = ReleaseIds(limit=3)
    for i in range(5):
        ids.add("p", f"id{i}")
    assert len(ids) == 3 and not ids.seen("p", "id1") and ids.seen("p", "id4")
    ids.add("q", "id0")
    ids.forget_partition("p")
    assert len(ids) == 1 and ids.seen("q", "id0") and not ids.seen("p", "id4")


def test_keys_reports_partitions_holders_and_reservations(unit):
    unit.put("a", np.ones(10, np.uint8), {"partition": "r0"})
    unit.put("b", np.ones(10, np.uint8), {"partition": "r0"})
    unit.add_ref(["a"], "r1")
    unit.add_ref(["a"], "r1")
    unit.begin_write("c", 10, {"partition": "r1"}, 0)
    got = msgpack.unpackb(msgpack.packb(unit.control("keys")))
    assert got == {"unit": "su-0", "incarnation": unit.incarnation,
                   "partitions": {"r0": {"a": 1, "b": 1}, "r1": {"a": 2}}, "reserved": ["c"], "next": None}
    # Pages, for units whose key names would not fit one control frame.
    first = unit.control("keys", {"limit": 1})
    assert first["partitions"] == {"r0": {"a": 1}, "r1": {"a": 2}} and first["next"] == "a"
    second = unit.control("keys", {"after": first["next"], "limit": 1})
    assert second["partitions"] == {"r0": {"b": 1}} and second["next"] is None and second["reserved"] == ["c"]
    unit.abort_write("c")
    unit.release_partition("r0")
    unit.release_partition("r1")
    assert unit.keys() == {"unit": "su-0", "incarnation": unit.incarnation, "partitions": {}, "reserved": [],
                           "next": None}


def test_stats_keeps_its_keys_and_adds_the_new_ones(unit):
    stats = unit.stats()
    assert {"name", "capacity", "used", "free", "largest_free", "free_blocks", "keys", "reserved",
            "partitions", "leases", "pending_free_bytes", "writers_waiting", "pinned", "arena_path",
            "closed", "puts", "reads", "bytes_written", "bytes_read", "waits", "wait_us",
            "capacity_errors", "leases_expired"} <= set(stats)
    assert stats["incarnation"] == unit.incarnation
    assert stats["reservations"] == stats["reservations_expired"] == stats["leases_expired"] == 0
    unit.begin_write("w", 10, {}, 0)
    assert unit.stats()["reservations"] == 1 and unit.stats()["reserved"] == 1
    msgpack.packb(unit.stats())


@pytest.mark.parametrize("method, args, match", [
    ("close", {}, "unknown control method"),
    ("_table", {}, "unknown control method"),
    (["stats"], {}, "unknown control method"),
    ("stats", ["x"], "dict of named arguments"),
    ("stats", "x", "dict of named arguments"),
    ("stats", {1: 2}, "dict of named arguments"),
    ("stats", {"verbose": True}, "bad arguments for stats"),
    ("release", {"bogus": 1}, "bad arguments for release"),
    ("release", {}, "bad arguments for release"),
    ("release", {"keys": "ab"}, "keys must be a list of str"),
    ("release", {"keys": [["a"]]}, "keys must be a list of str"),
    ("release", {"keys": ["a"], "partition": ["p"]}, "partition must be a str or an int"),
    ("release", {"keys": ["a"], "missing_ok": "yes"}, "missing_ok must be a bool"),
    ("release", {"keys": ["a"], "release_id": {}}, "release_id"),
    ("release_partition", {"partition": None}, "partition must be a str or an int"),
    ("release_partition", {"partition": {"p": 1}}, "partition must be a str or an int"),
    ("add_ref", {"keys": ["a"], "partition": 1.5}, "partition must be a str or an int"),
    ("add_ref", {"keys": ["a"]}, "bad arguments for add_ref"),
    ("transfer", {"keys": ["a"], "from_partition": "p", "to_partition": [1]}, "partition"),
    ("delete", {"keys": {"a": 1}}, "keys must be a list of str"),
    ("lookup", {"keys": [b"a"]}, "keys must be a list of str"),
    ("keys", {"partition": "p"}, "bad arguments for keys"),
    ("keys", {"limit": 0}, "limit must be an int >= 1"),
    ("keys", {"limit": "5"}, "limit must be an int >= 1"),
    ("keys", {"after": 5}, "after must be a str"),
])
def test_every_malformed_control_call_is_invalid_input(unit, method, args, match):
    unit.put("a", np.ones(10, np.uint8), {"partition": "p"})
    with pytest.raises(InvalidInputError, match=match):
        unit.control(method, args)
    assert unit.lookup(["a"])[0]["holders"] == {"p": 1}  # nothing changed


def test_every_control_method_answers_msgpack(unit):
    unit.put("a", np.ones(10, np.uint8), {"partition": "p"})
    calls = {"lookup": {"keys": ["a"]}, "stats": None, "keys": {}, "add_ref": {"keys": ["a"], "partition": "q"},
             "transfer": {"keys": ["a"], "from_partition": "q", "to_partition": 3},
             "release": {"keys": ["a"], "partition": 3, "release_id": "r"},
             "release_partition": {"partition": "p"}, "delete": {"keys": ["a"]}}
    assert set(calls) == CONTROL_METHODS
    results = {m: msgpack.unpackb(msgpack.packb(unit.control(m, calls[m]))) for m in
               ("lookup", "stats", "keys", "add_ref", "transfer", "release", "release_partition", "delete")}
    assert results["add_ref"] is None and results["transfer"] == 1 and results["release"] == 0
    assert results["release_partition"] == 1 and results["delete"] == 0
    assert results["keys"]["partitions"] == {"p": {"a": 1}}


def test_partial_failure_error_carries_its_result_and_crosses_the_wire():
    result = {"freed": 3, "unreachable": {"su-2": "PeerLostError: gone"}}
    err = PartialFailureError("1 of 3 units unreachable", result)
    assert isinstance(err, GputqError) and err.result is result
    back = error_from_wire(error_to_wire(err))
    assert type(back) is PartialFailureError and str(back) == "1 of 3 units unreachable" and back.result is None


def test_contract_over_a_real_tcp_server(unit):
    """The control surface as a remote client sees it: typed errors, receipts, keys."""
    from gputq.transport import get_transport

    token = "t" * 32
    tcp = get_transport("tcp")
    with tcp.serve(unit, host="127.0.0.1", port=0, token=token,
                   limits=ServerLimits(max_frame_bytes=1 << 20)) as server, \
            tcp.connect(server.address, token=token, max_frame_bytes=1 << 20, timeout=10) as channel:
        receipt = channel.write("a", np.arange(10, dtype=np.uint8), {"partition": "p", "generation": 77})
        assert receipt["generation"] == 77 and receipt["incarnation"] == unit.incarnation
        assert channel.call("keys") == unit.keys() == {
            "unit": "su-0", "incarnation": unit.incarnation, "partitions": {"p": {"a": 1}}, "reserved": [],
            "next": None}
        with pytest.raises(InvalidInputError, match="keys must be a list of str"):
            channel.call("release", keys="a")
        with pytest.raises(InvalidInputError, match="bad arguments for release_partition"):
            channel.call("release_partition")
        unit.add_ref(["a"], "p")
        assert channel.call("release", keys=["a"], partition="p", release_id="r7") == 0
        assert channel.call("release", keys=["a"], partition="p", release_id="r7") == 0
        assert unit.lookup(["a"])[0]["holders"] == {"p": 1}
        dest = np.zeros(10, np.uint8)
        assert channel.read(["a"], dest) == [10] and dest.tolist() == list(range(10))
        assert channel.call("release", keys=["a"], partition="p", release_id="r8") == 1
        # The server ends its lease right after sending; the region comes back then.
        wait_until(lambda: unit.stats()["used"] == 0, timeout=10, what="the server's lease ends")


def test_unit_errors_are_defined_in_gputq_and_cross_tcp_with_their_class():
    """The unit's own errors live in gputq.errors; a tcp client rebuilds them as those classes."""
    from gputq.transport import get_transport

    for cls in (CapacityError, DuplicateKeyError, UnknownKeyError):
        assert cls.__module__ == "gputq.errors"
    token = "t" * 32
    tcp = get_transport("tcp")
    with StorageUnit("su-full", 4 * KIB, put_timeout_s=0.0) as unit, \
            tcp.serve(unit, host="127.0.0.1", port=0, token=token,
                      limits=ServerLimits(max_frame_bytes=1 << 20)) as server, \
            tcp.connect(server.address, token=token, max_frame_bytes=1 << 20, timeout=10) as channel:
        channel.write("a", np.zeros(4 * KIB, np.uint8))
        with pytest.raises(CapacityError, match="su-full: no space for key 'b'") as full:
            channel.write("b", np.zeros(KIB, np.uint8), timeout=0)
        with pytest.raises(DuplicateKeyError, match="'a' already exists") as duplicate:
            channel.write("a", np.zeros(1, np.uint8))
        with pytest.raises(UnknownKeyError, match="unknown key 'c'") as unknown:
            channel.read(["c"], np.zeros(1, np.uint8))
    assert [type(e.value) for e in (full, duplicate, unknown)] == [CapacityError, DuplicateKeyError,
                                                                    UnknownKeyError]


def test_transport_imports_nothing_above_it():
    """The transport layer stands alone: importing every backend loads no gputq module above it.

    Only the package itself (whose names load lazily) and the exception tree come along.
    """
    code = ("import sys, gputq.transport, gputq.transport.tcp, gputq.transport.shm, gputq.transport.nixl\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'gputq'\n"
            "             and not m.startswith('gputq.transport')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['gputq', 'gputq.errors']"
