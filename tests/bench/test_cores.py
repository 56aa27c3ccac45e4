"""bench.cores: the cores a pass keeps busy, and the cores' worth of its threads' waiting for one, read from
processes whose load the test sets (spinning children pinned to one core)."""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from bench.cores import kept_busy, us_per_mib


@pytest.mark.timeout(30)
@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="the kernel's schedstat is Linux's")
def test_kept_busy_splits_this_process_by_thread_name():
    # The work runs on a pool's thread while this one waits for it: the CPU is the pool thread's, under the
    # pool's name without its thread number. CPU time, not wall time: a busy machine changes neither share.
    with ThreadPoolExecutor(1, thread_name_prefix="bench-burn") as pool:
        cores = kept_busy(lambda: pool.submit(sum, range(300_000)).result(), ())
    threads = cores.own_threads
    assert "bench-burn_0" not in threads and threads["bench-burn"] > 0
    assert threads["bench-burn"] > 0.6 * cores.own and threads["bench-burn"] > 5 * threads["MainThread"], threads
    assert sum(threads.values()) <= 1.05 * cores.own + 0.01, (threads, cores.own)


@pytest.mark.timeout(10)
def test_us_per_mib_states_a_pass_s_cpu_per_mib_moved():
    # 1.5 cores over a 2 ms pass is 3 ms of CPU; over 4 MiB, 750 microseconds each.
    assert us_per_mib(1.5, 2e-3, 4 << 20) == 750
    assert us_per_mib(0.0, 1.0, 1 << 20) == 0


def _spin(spinning, cpu):
    os.sched_setaffinity(0, {cpu})
    spinning.set()
    while True:
        pass


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores: the child spins on one")
def test_kept_busy_counts_a_busy_child_as_a_core_though_its_clock_trails_by_a_tick():
    """Slow, not fast: it measures the machine (the child must get a whole core), so a busy machine fails it."""
    # A spinning process's CPU clock, read from another, moves only at scheduler ticks (4 ms at
    # HZ=250): over one pass of a few microseconds it reads no core of the child's or thousands,
    # over a quarter second one. This process's own loop keeps the other core busy: two in all.
    # On cores of their own, so that no wake-up of this process preempts the child and updates its clock.
    ours, theirs, *_ = sorted(os.sched_getaffinity(0))
    context = multiprocessing.get_context("spawn")
    spinning = context.Event()
    child = context.Process(target=_spin, args=(spinning, theirs), daemon=True)
    child.start()
    affinity = os.sched_getaffinity(0)
    try:
        assert spinning.wait(30), "the spinning child never started"
        os.sched_setaffinity(0, {ours})
        readings = []
        for _ in range(12):
            cores = kept_busy(lambda: None, (child.pid,))
            readings.append(cores.own + cores.others)
    finally:
        os.sched_setaffinity(0, affinity)
        child.kill()
        child.join(10)
    assert all(1.4 < cores < 2.6 for cores in readings), readings


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores: the children share one")
@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="the kernel's schedstat is Linux's")
def test_kept_busy_counts_the_waiting_for_a_core_of_two_children_sharing_one():
    """Slow, not fast: it measures the machine (a core of its own for this process), so a busy machine fails it."""
    # Two spinning children on one core: one runs while the other waits, a core's worth of waiting
    # between them; this process, alone on another core, waits for none.
    ours, theirs, *_ = sorted(os.sched_getaffinity(0))
    context = multiprocessing.get_context("spawn")
    spinning = [context.Event() for _ in range(2)]
    children = [context.Process(target=_spin, args=(event, theirs), daemon=True) for event in spinning]
    for child in children:
        child.start()
    affinity = os.sched_getaffinity(0)
    try:
        assert all(event.wait(30) for event in spinning), "a spinning child never started"
        os.sched_setaffinity(0, {ours})
        cores = kept_busy(lambda: None, [child.pid for child in children])
    finally:
        os.sched_setaffinity(0, affinity)
        for child in children:
            child.kill()
            child.join(10)
    assert 0.7 < cores.others_waiting < 1.3 and 0.7 < cores.others < 1.3, cores
    assert cores.own_waiting < 0.2, cores
