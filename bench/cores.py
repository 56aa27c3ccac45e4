"""What a benchmark's passes keep busy: cores of this process and of the processes serving it, and time waiting
for a core.

A pass that is slower than its baseline either spends more CPU per byte
(:func:`kept_busy` counts it, :func:`us_per_mib` states it per MiB moved) or
waits for cores it does not get: more runnable threads than cores at
moments, idle cores at others (``*_waiting``, from Linux's ``schedstat``).
This process's share is also split by thread name (``own_threads``): a
pipeline is as fast as its busiest stage's thread.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass

__all__ = ["Cores", "kept_busy", "us_per_mib"]


def _cpu_seconds(pids) -> tuple[float, float]:
    """CPU seconds so far of this process, and of the child processes ``pids`` (units, a baseline's server)."""
    others = 0.0
    for pid in pids:
        # Linux's process-wide CPU clock of another process: (~pid << 3) | CPUCLOCK_SCHED. One call each,
        # in ns, where /proc/<pid>/stat counts clock ticks (10 ms: a pass takes tens).
        with contextlib.suppress(OSError):  # a child that just exited
            others += time.clock_gettime(((~pid) << 3) | 2)
    return time.process_time(), others


#: Wall seconds a :func:`kept_busy` measurement repeats its work for, at least.
_WINDOW_S = 0.25


def _thread_stats(pids) -> dict | None:
    """Each thread of ``pids`` by ``(pid, thread id)``: its nanoseconds on a core and runnable but waiting for one
    (Linux's ``schedstat``), or None where the kernel does not say."""
    stats = {}
    for pid in pids:
        try:
            threads = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return None
        for tid in threads:
            with contextlib.suppress(OSError):  # a thread that just exited
                with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                    ran, waited = f.read().split()[:2]
                    stats[(pid, tid)] = (int(ran), int(waited))
    return stats


def _waited(before: dict | None, after: dict | None, wall: float) -> float | None:
    """Cores' worth of waiting for a core between two :func:`_thread_stats` ``wall`` seconds apart: by the
    threads alive at the end (one that exited meanwhile, a unit's connection thread, takes its part along),
    those started meanwhile in whole."""
    if before is None or after is None:
        return None
    return sum(ns - before.get(thread, (0, 0))[1] for thread, (_, ns) in after.items()) / 1e9 / wall


def _by_thread(before: dict | None, after: dict | None, wall: float) -> dict | None:
    """This process's cores by thread name between two :func:`_thread_stats` ``wall`` seconds apart, counted as
    :func:`_waited` counts: a pool's threads as one (``gputq-restore_0`` counts as ``gputq-restore``), threads
    Python did not start as ``native``."""
    if before is None or after is None:
        return None
    names = {str(t.native_id): re.sub(r"_\d+$", "", t.name) for t in threading.enumerate()}
    cores = Counter()
    for (pid, tid), (ns, _) in after.items():
        cores[names.get(tid, "native")] += (ns - before.get((pid, tid), (0, 0))[0]) / 1e9 / wall
    return dict(sorted(cores.items()))


@dataclass(frozen=True)
class Cores:
    """What one side's passes kept busy: cores of this process and of ``pids`` (CPU seconds over wall
    seconds), cores' worth of their threads runnable but waiting for one (None where the kernel does not
    say), and the wall seconds of one pass."""

    own: float
    others: float
    own_waiting: float | None
    others_waiting: float | None
    pass_s: float
    #: This process's cores by thread name (see :func:`_by_thread`); None where the kernel does not say.
    own_threads: dict | None = None


def kept_busy(work, pids) -> Cores:
    """The cores ``work()`` keeps busy and waited for, in this process and in ``pids``, and its pass time.

    The work repeats for at least ``_WINDOW_S``. A process's CPU clock
    counts its threads running on other cores only up to their last
    scheduler tick (milliseconds): over a single pass of a fraction of a
    millisecond, CPU spent just before the window lands in it (a 2-core box
    read 19.7 cores). Only the processes that do the work count: the units
    idle through a baseline's pass. A thread that waits for a core while
    the box has cores to spare (more runnable threads than cores at
    moments, none at others) is what a busy side's CPU per byte does not
    show.
    """
    me = os.getpid()
    # The threads' schedstats are read outside the CPU clocks' window: reading every thread's file costs CPU.
    own_stats, others_stats = _thread_stats((me,)), _thread_stats(pids)
    passes, (own, others), started = 0, _cpu_seconds(pids), time.perf_counter()
    while not passes or time.perf_counter() - started < _WINDOW_S:
        work()
        passes += 1
    wall = time.perf_counter() - started
    own_after, others_after = _cpu_seconds(pids)
    own_stats_after = _thread_stats((me,))
    return Cores((own_after - own) / wall, (others_after - others) / wall, _waited(own_stats, own_stats_after, wall),
                 _waited(others_stats, _thread_stats(pids), wall), wall / passes,
                 _by_thread(own_stats, own_stats_after, wall))


def us_per_mib(cores: float, pass_s: float, nbytes: int) -> int:
    """CPU microseconds per MiB moved of a process that kept ``cores`` busy over passes of ``pass_s``."""
    return round(cores * pass_s / (nbytes / (1 << 20)) * 1e6)
