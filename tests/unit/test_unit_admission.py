"""Write admission: a small write that fits passes a large waiting one, until the large
one has waited ``write_aging_s``; from then on nobody passes it, so no write waits forever.
Through the unit, and the line itself (``gputq.unit.admission.WriteQueue``)."""

import threading
import time
from collections import Counter

import numpy as np
import pytest

from gputq.errors import CapacityError, ClosedError
from gputq.unit.admission import WriteQueue
from gputq.unit.storage_unit import StorageUnit
from tests.waiting import wait_until

KIB = 1024


def _full_unit(write_aging_s):
    """A 16 KiB unit holding four 4 KiB keys q0..q3 at offsets 0, 4, 8, 12 KiB."""
    unit = StorageUnit("su-admit", 16 * KIB, write_aging_s=write_aging_s)
    for i in range(4):
        assert unit.put(f"q{i}", np.full(4 * KIB, i, np.uint8), {"partition": "p"})["offset"] == i * 4 * KIB
    return unit


class _Put(threading.Thread):
    """A put in its own thread; ``done`` is set with ``receipt`` or ``error``."""

    def __init__(self, unit, key, nbytes, timeout):
        super().__init__(daemon=True)
        self.unit, self.key, self.nbytes, self.timeout = unit, key, nbytes, timeout
        self.done = threading.Event()
        self.receipt = self.error = None
        self.start()

    def run(self):
        try:
            self.receipt = self.unit.put(self.key, np.full(self.nbytes, 0xAB, np.uint8), {"partition": "p"},
                                         timeout=self.timeout)
        except Exception as exc:  # noqa: BLE001 - asserted by the test
            self.error = exc
        self.done.set()


def test_small_write_that_fits_passes_a_young_large_one():
    with _full_unit(write_aging_s=60) as unit:
        large = _Put(unit, "large", 8 * KIB, timeout=60)
        wait_until(lambda: unit.stats()["writers_waiting"] == 1, timeout=10, what="the large write waits")
        unit.release(["q1"])  # 4 KiB free: not enough for the large write
        receipt = unit.put("small", np.ones(4 * KIB, np.uint8), {"partition": "p"}, timeout=10)
        assert receipt["offset"] == 4 * KIB  # it passed the large write, which is still waiting
        assert not large.done.is_set() and unit.stats()["writers_waiting"] == 1
        unit.release(["q2", "q3"])
        assert large.done.wait(10) and large.error is None
        assert large.receipt["offset"] == 8 * KIB


def test_no_one_passes_a_write_that_has_waited_write_aging_s():
    with _full_unit(write_aging_s=0.05) as unit:
        large = _Put(unit, "large", 8 * KIB, timeout=60)
        wait_until(lambda: unit.stats()["first_writer_wait_s"] > 0.05, timeout=10, what="the large write ages")
        unit.release(["q1"])  # 4 KiB free: the small write fits but must not pass
        with pytest.raises(CapacityError, match="'small'.*1 other writers waiting"):
            unit.put("small", np.ones(4 * KIB, np.uint8), {"partition": "p"}, timeout=0.3)
        assert unit.stats()["free"] == 4 * KIB and not large.done.is_set()
        unit.release(["q2"])  # 8 KiB contiguous: it goes to the large write first
        assert large.done.wait(10) and large.error is None and large.receipt["offset"] == 4 * KIB


def test_an_aged_write_gets_in_while_smaller_writes_keep_coming():
    """Small writers cycling put/release would keep part of the arena busy for ever; the
    whole-arena write waiting behind them gets in once it has aged."""
    with StorageUnit("su-starve", 16 * KIB, write_aging_s=0.05) as unit:
        stop = threading.Event()
        cycles = [0, 0]

        def cycler(n):
            i = 0
            while not stop.is_set():
                key = f"c{n}/{i}"
                try:
                    unit.put(key, np.ones(4 * KIB, np.uint8), {"partition": "p"}, timeout=0.05)
                except CapacityError:
                    continue  # the aged writer holds the line
                unit.release([key])
                cycles[n] += 1
                i += 1

        threads = [threading.Thread(target=cycler, args=(n,), daemon=True) for n in range(2)]
        for thread in threads:
            thread.start()
        wait_until(lambda: min(cycles) > 10, timeout=10, what="the small writers cycle")
        whole = _Put(unit, "whole", 16 * KIB, timeout=60)
        assert whole.done.wait(30), "the whole-arena write waited behind smaller ones"
        assert whole.error is None and whole.receipt["offset"] == 0
        unit.release(["whole"])
        before = list(cycles)
        wait_until(lambda: min(c - b for c, b in zip(cycles, before)) > 0, timeout=10, what="the small writers resume")
        stop.set()
        for thread in threads:
            thread.join(10)
        assert unit.stats()["used"] == 0


class _Head(threading.Thread):
    """A writer first in line since ``since``, that finds no space until ``stop`` is set (then its check
    raises ``ClosedError``, as a closed unit's does)."""

    def __init__(self, queue: WriteQueue, space: threading.Condition, since: float):
        super().__init__(daemon=True)
        self.queue, self.space, self.since = queue, space, since
        self.stop, self.error = threading.Event(), None
        self.start()

    def check(self):
        if self.stop.is_set():
            raise ClosedError("stopped")

    def run(self):
        with self.space:
            try:
                self.queue.allocate(lambda: None, self.check, self.since, time.monotonic() + 30)
            except ClosedError as exc:
                self.error = exc

    def finish(self):
        with self.space:
            self.stop.set()
            self.space.notify_all()
        self.join(10)
        assert self.error is not None and len(self.queue) == 0


@pytest.mark.parametrize("aging_s, passes", [(60.0, True), (1.0, False)])
def test_the_queue_lets_a_writer_pass_the_first_in_line_only_until_it_has_aged(aging_s, passes):
    """The first writer has waited 10 s: with 60 s of aging a later writer that fits passes it; with 1 s it
    may not even try (its allocation is never called), and it gets None at its deadline."""
    space, counters = threading.Condition(), Counter()
    queue = WriteQueue(space, aging_s, counters)
    head = _Head(queue, space, time.monotonic() - 10)
    wait_until(lambda: len(queue) == 1, timeout=10, what="the first writer waits")
    assert queue.first_wait_s(time.monotonic()) >= 10
    tried = []
    with space:
        now = time.monotonic()
        offset = queue.allocate(lambda: tried.append(1) or 4096, lambda: None, now, now)
        assert len(queue) == 1  # the first writer still waits, the other left the line
    assert (offset, tried) == ((4096, [1]) if passes else (None, []))
    head.finish()
    assert counters["waits"] == 1 and counters["wait_us"] >= 10e6  # the first writer's wait, none of the other's
    assert queue.first_wait_s(time.monotonic()) == 0.0
