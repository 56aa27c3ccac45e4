"""Randomised release/lease/rewrite races against one small unit: a region is never
handed out while a live lease covers it, and a reader gets the key's bytes or a typed error."""

import random
import threading

import numpy as np
import pytest

from gputq.errors import CapacityError, DuplicateKeyError, StaleReadError, UnknownKeyError
from gputq.unit.storage_unit import StorageUnit

KIB = 1024
NAMES = [f"k{i}" for i in range(12)]  # few names: they are released and rewritten constantly


def pattern(generation: int, nbytes: int) -> np.ndarray:
    """The bytes stored under ``generation``: its 8 bytes, repeated."""
    unit = np.frombuffer(generation.to_bytes(8, "little"), np.uint8)
    return np.resize(unit, nbytes)


class _Ledger:
    """The leases a reader holds right now (registered after lease, removed before end)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.held: dict[int, tuple[int, int]] = {}
        self.overlaps: list[str] = []

    def check_reservation(self, key: str, offset: int, nbytes: int) -> None:
        with self.lock:
            for lease_id, (start, length) in self.held.items():
                if length and nbytes and offset < start + length and start < offset + nbytes:
                    self.overlaps.append(f"{key} at [{offset}, {offset + nbytes}) under lease {lease_id}")


def _race(ops_per_thread: int, threads: int, expiring: bool, seed: int) -> dict:
    # Expiring leases time out while their reader pauses: end_lease then says so.
    lease_timeout = 0.005 if expiring else 600.0
    tally = {"reads": 0, "bytes_checked": 0, "stale": 0, "unknown": 0, "writes": 0, "full": 0, "expired": 0}
    tally_lock = threading.Lock()
    ledger = _Ledger()
    known: dict[str, list[int]] = {}  # key -> generations written under it (most are stale by now)
    failures: list[str] = []

    with StorageUnit("su-race", 48 * KIB, put_timeout_s=0.01, lease_timeout_s=lease_timeout) as unit:
        arena = np.frombuffer(unit.arena, np.uint8)

        def write(rng, key):
            generation = rng.getrandbits(63) or 1
            nbytes = rng.randrange(0, 6 * KIB)
            try:
                offset = unit.begin_write(key, nbytes, {"partition": "p", "generation": generation}, 0.01)
            except (DuplicateKeyError, CapacityError):
                return "full"
            if not expiring:
                ledger.check_reservation(key, offset, nbytes)
            arena[offset:offset + nbytes] = pattern(generation, nbytes)
            unit.commit_write(key)
            known.setdefault(key, []).append(generation)
            return "writes"

        def read(rng, key):
            history = known.get(key, ())
            expected = rng.choice(history[-3:]) if history and rng.random() < 0.5 else None
            try:
                lease = unit.lease([key], None if expected is None else [expected], unit.incarnation,
                                   expires=expiring or rng.random() < 0.5)
            except StaleReadError:
                return "stale"
            except UnknownKeyError:
                return "unknown"
            region, generation = lease.regions[0], lease.generations[0]
            if expected is not None and generation != expected:
                failures.append(f"{key}: leased generation {generation}, asked for {expected}")
            with ledger.lock:
                ledger.held[lease.lease_id] = (region.offset, region.nbytes)
            if expiring and rng.random() < 0.3:
                threading.Event().wait(0.008)  # a slow reader: its lease expires meanwhile
            got = arena[region.offset:region.offset + region.nbytes].copy()
            with ledger.lock:
                del ledger.held[lease.lease_id]
            if not unit.end_lease(lease.lease_id):
                return "expired"  # what a one-sided reader turns into StaleReadError: bytes discarded
            if not np.array_equal(got, pattern(generation, region.nbytes)):
                failures.append(f"{key}: bytes under a held lease are not generation {generation}'s")
            with tally_lock:
                tally["bytes_checked"] += region.nbytes
            return "reads"

        def release(rng, key):
            if rng.random() < 0.5:
                unit.release([key], "p", missing_ok=True)
            else:
                unit.delete([key])
            return None

        def worker(n):
            rng = random.Random(seed * 100 + n)
            try:
                for _ in range(ops_per_thread):
                    op = rng.choices((write, read, release), (4, 5, 2))[0]
                    outcome = op(rng, rng.choice(NAMES))
                    if outcome:
                        with tally_lock:
                            tally[outcome] += 1
            except Exception as exc:  # noqa: BLE001 - any untyped error fails the test below
                failures.append(f"worker {n}: {type(exc).__name__}: {exc}")

        pool = [threading.Thread(target=worker, args=(n,)) for n in range(threads)]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join(300)
        assert not any(thread.is_alive() for thread in pool)
        assert not failures, failures[:5]
        assert not ledger.overlaps, ledger.overlaps[:5]
        unit.release(NAMES, missing_ok=True)
        stats = unit.stats()
        assert stats["keys"] == 0 and stats["leases"] == 0 and stats["used"] == 0
        assert stats["free_blocks"] == 1 and stats["pending_free_bytes"] == 0
    return tally


@pytest.mark.parametrize("expiring", [False, True], ids=["held-leases", "expiring-leases"])
def test_release_lease_rewrite_races(expiring):
    tally = _race(ops_per_thread=600, threads=4, expiring=expiring, seed=1)
    assert tally["reads"] > (50 if expiring else 200) and tally["writes"] > 200 and tally["bytes_checked"] > 0
    assert tally["stale"] > 0 and tally["unknown"] > 0  # the races did happen
    if expiring:
        assert tally["expired"] > 0


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("expiring", [False, True], ids=["held-leases", "expiring-leases"])
def test_release_lease_rewrite_races_many(expiring):
    for seed in range(10):  # 100,000 operations per lease kind
        tally = _race(ops_per_thread=2500, threads=4, expiring=expiring, seed=seed)
        assert tally["reads"] > 1000 and tally["stale"] > 0
