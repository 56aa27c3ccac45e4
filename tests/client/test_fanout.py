"""Fan-out: one shared set of threads, entries in parallel, nested fan-outs, forks."""

from __future__ import annotations

import os
import threading

import pytest

from gputq.client import fanout
from gputq.client.fanout import fan_out
from gputq.errors import InvalidInputError, UnitLostError
from tests.waiting import child_exit_code

UNITS = [f"su-{i}" for i in range(4)]


def _together(parties: int):
    """A task that returns the thread it ran on once ``parties`` tasks run at once (else it fails)."""
    barrier = threading.Barrier(parties, timeout=20)

    def task(unit):
        barrier.wait()
        return threading.current_thread()

    return task


@pytest.mark.timeout(60)
def test_fan_outs_reuse_one_set_of_threads():
    first = fan_out(UNITS, _together(len(UNITS)))  # four at once: the caller and three threads
    workers = fanout._shared_workers()
    started = list(workers.threads)
    caller = threading.current_thread()
    used = {thread for thread in first.values() if thread is not caller}
    assert len(set(first.values())) == len(UNITS) and len(used) >= len(UNITS) - 1
    assert used <= set(started) and all(t.name.startswith("gputq-fanout-") and t.daemon for t in used)
    for _ in range(3):
        again = fan_out(UNITS, _together(len(UNITS)))
        assert fanout._shared_workers() is workers
        assert {t for t in again.values() if t is not caller} <= set(started)
        assert workers.threads == started  # no thread started: the idle ones took the entries


@pytest.mark.timeout(60)
def test_one_slow_unit_delays_only_its_own_entry():
    others_done = threading.Event()
    finished = []
    lock = threading.Lock()

    def task(unit):
        if unit == "su-0":  # a hung unit: answers only once the others are all done
            return others_done.wait(20)
        with lock:
            finished.append(unit)
            if len(finished) == len(UNITS) - 1:
                others_done.set()
        return unit

    assert fan_out(UNITS, task) == {"su-0": True, "su-1": "su-1", "su-2": "su-2", "su-3": "su-3"}


@pytest.mark.timeout(60)
def test_errors_are_entries_and_other_exceptions_raise_after_every_entry():
    lost = UnitLostError("unit su-1 is lost", unit="su-1")
    ran = []

    def task(unit):
        ran.append(unit)
        if unit == "su-1":
            raise lost
        if unit == "su-2":
            raise KeyError("a bug, not a unit's answer")
        return 1

    with pytest.raises(KeyError, match="a bug"):
        fan_out(UNITS, task)
    assert sorted(ran) == UNITS  # every entry ran before the bug surfaced
    done = fan_out(UNITS, lambda unit: task(unit) if unit != "su-2" else 2)
    assert done == {"su-0": 1, "su-1": lost, "su-2": 2, "su-3": 1}
    assert fan_out([], task) == {}
    with pytest.raises(InvalidInputError):
        fanout.tally({"su-0": InvalidInputError("bad keys"), "su-1": 1}, "op", "done")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("threads", [1, 2, fanout.FANOUT_THREADS])
def test_a_task_that_fans_out_itself_cannot_deadlock_the_pool(monkeypatch, threads):
    """Nested fan-outs finish whatever the bound: a caller runs the entries no thread took."""
    monkeypatch.setattr(fanout, "_workers", fanout._Workers(threads))
    inner = [f"k{i}" for i in range(6)]

    def outer(unit):
        return fan_out(inner, lambda key: fan_out(["a", "b"], lambda leaf: f"{unit}/{key}/{leaf}"))

    done = fan_out([f"su-{i}" for i in range(6)], outer)
    assert done == {u: {k: {leaf: f"{u}/{k}/{leaf}" for leaf in ("a", "b")} for k in inner}
                    for u in done} and len(done) == 6
    assert len(fanout._workers.threads) <= threads


@pytest.mark.timeout(60)
def test_concurrent_fan_outs_past_the_bound_all_finish(monkeypatch):
    monkeypatch.setattr(fanout, "_workers", fanout._Workers(2))
    results, errors = {}, []

    def caller(n):
        try:
            results[n] = fan_out(UNITS, lambda unit: fan_out(UNITS, lambda leaf: (n, unit, leaf)))
        except BaseException as exc:
            errors.append(exc)

    callers = [threading.Thread(target=caller, args=(n,)) for n in range(6)]
    for thread in callers:
        thread.start()
    for thread in callers:
        thread.join(30)
    assert not errors and sorted(results) == list(range(6))
    assert all(results[n][u][leaf] == (n, u, leaf) for n in results for u in UNITS for leaf in UNITS)


@pytest.mark.timeout(60)
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_fans_out_on_threads_of_its_own():
    fan_out(UNITS, _together(len(UNITS)))  # the parent's threads exist, idle, when it forks
    parent = fanout._shared_workers()
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            # The parent's idle threads are not in the child: entries handed to them would never
            # run, and four tasks waiting for each other would time out in one thread.
            done = fan_out(UNITS, _together(len(UNITS)))
            code = 0 if fanout._shared_workers() is not parent and len(set(done.values())) == len(UNITS) else 2
        finally:
            os._exit(code)

    assert child_exit_code(pid, 40, "the forked child's fan-out") == 0
