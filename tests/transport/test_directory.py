"""The key directory: a hint table in shared memory, never trusted without the lease."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from gputq.transport.directory import PROBE, DirectoryView, KeyDirectory, directory_nbytes, directory_slots, key_hash
from gputq.unit.storage_unit import StorageUnit


def _pair(slots: int = 16):
    buffer = np.zeros(directory_nbytes(slots), np.uint8)
    return KeyDirectory(buffer, slots), DirectoryView(buffer, slots), buffer


def test_key_hash_is_pinned_and_spreads():
    # golden values: a reader in another process (another interpreter run) computes the unit's hash
    assert [key_hash(k) for k in ("a", "step/7")] == [0x17A1332D9CCF7C20, 0x17576E09176F1EBA]
    assert len({key_hash(f"k{i}") for i in range(1000)}) == 1000
    assert min(key_hash(f"k{i}") for i in range(1000)) > 0


@pytest.mark.parametrize("arena_bytes, slots", [(1, 4096), (64 << 20, 4096), (1 << 30, 65536),
                                                (3 << 30, 262144), (1 << 50, 1 << 20)])
def test_slots_grow_with_the_arena_as_a_power_of_two(arena_bytes, slots):
    assert directory_slots(arena_bytes) == slots
    assert directory_nbytes(slots) == slots * 32


def test_published_keys_are_found_at_their_generation_only():
    directory, view, _ = _pair()
    directory.publish("a", 5, 256, 1000)
    directory.publish("b", 6, 1280, 24)
    assert view.lookup(["b", "a"], [6, 5]).tolist() == [[1280, 24], [256, 1000]]
    assert view.lookup(["a"], [4]) is None  # another generation of the key
    assert view.lookup(["a", "ghost"], [5, 1]) is None  # every key or none
    assert view.lookup(["a"], [0]) is None  # unknown generation: nothing to compare
    assert view.lookup([], []) is None
    directory.withdraw("a", 4)  # not the published generation: kept
    assert view.lookup(["a"], [5]) is not None
    directory.withdraw("a", 5)
    assert view.lookup(["a"], [5]) is None
    directory.publish("b", 7, 4096, 24)  # the key written again: its slot is reused
    assert view.lookup(["b"], [7]).tolist() == [[4096, 24]] and view.lookup(["b"], [6]) is None



def test_regions_outside_the_bound_are_no_hints():
    directory, view, _ = _pair()
    directory.publish("a", 1, 4096, 1000)
    assert view.lookup(["a"], [1], within=5096).tolist() == [[4096, 1000]]  # up to the last byte
    assert view.lookup(["a"], [1], within=5095) is None
    for key, offset, nbytes in (("b", -8, 8), ("c", 0, -1), ("d", 2**62, 2**62)):  # the sum passes 2**63
        directory.publish(key, 2, offset, nbytes)
        assert view.lookup([key], [2], within=1 << 30) is None
    assert view.lookup(["d"], [2]).tolist() == [[2**62, 2**62]]  # no bound, no check

def test_a_full_probe_overwrites_the_home_slot():
    directory, view, _ = _pair(slots=PROBE)  # every key probes every slot
    keys = [f"k{i}" for i in range(PROBE + 3)]
    for i, key in enumerate(keys):
        directory.publish(key, i + 1, i * 256, 8)
    found = [view.lookup([key], [i + 1]) is not None for i, key in enumerate(keys)]
    assert found[-1] and sum(found) == PROBE  # lost entries only cost a round trip


def test_garbage_in_the_table_is_at_worst_a_wrong_hint():
    directory, view, buffer = _pair()
    rng = np.random.default_rng(0)
    buffer[:] = rng.integers(0, 256, buffer.size, dtype=np.uint8)
    assert view.lookup(["a"], [1]) is None
    directory.publish("a", 1, 0, 8)
    assert view.lookup(["a"], [1]).tolist() == [[0, 8]]


def test_the_buffer_must_hold_a_power_of_two_table():
    with pytest.raises(ValueError, match="power of two"):
        KeyDirectory(np.zeros(1024, np.uint8), 12)
    with pytest.raises(ValueError, match="needs 512 bytes"):
        DirectoryView(np.zeros(100, np.uint8), 16)


@pytest.mark.timeout(30)
def test_a_unit_publishes_commits_and_withdraws_what_it_forgets(tmp_path):
    with StorageUnit("su-dir", 1 << 20, shm_dir=str(tmp_path)) as unit:
        info = unit.directory_file
        assert stat.S_IMODE(os.stat(info["path"]).st_mode) == 0o600  # the unit's user alone
        mapped = np.memmap(info["path"], np.uint8, "r", shape=(directory_nbytes(info["slots"]),))
        view = DirectoryView(mapped, info["slots"])
        begun = unit.begin_write("k", 100, {"partition": "p", "generation": 9}, timeout=1)
        assert view.lookup(["k"], [9]) is None  # reserved, not yet readable
        unit.commit_write("k", 9)
        assert view.lookup(["k"], [9]).tolist() == [[begun, 100]]
        unit.release(["k"], "p")
        assert view.lookup(["k"], [9]) is None
        unit.begin_write("r", 10, {"generation": 3}, timeout=1)
        unit.abort_write("r", 3)
        assert view.lookup(["r"], [3]) is None
    assert not list(tmp_path.iterdir())  # both files removed on close
