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


def _thread_waits(pids) -> dict | None:
    """Nanoseconds each thread of ``pids`` has spent runnable but waiting for a core (Linux's ``schedstat``),
    by ``(pid, thread id)``, or None where the kernel does not say."""
    waits = {}
    for pid in pids:
        try:
            threads = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return None
        for tid in threads:
            with contextlib.suppress(OSError):  # a thread that just exited
                with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                    waits[(pid, tid)] = int(f.read().split()[1])
    return waits


def _thread_cpu() -> Counter | None:
    """On-CPU nanoseconds so far of this process's threads, by name (Linux's ``schedstat``; a pool's threads
    as one: ``gputq-restore_0`` counts as ``gputq-restore``; threads Python did not start as ``native``), or
    None where the kernel does not say."""
    names = {str(t.native_id): re.sub(r"_\d+$", "", t.name) for t in threading.enumerate()}
    try:
        threads = os.listdir("/proc/self/task")
    except OSError:
        return None
    ns = Counter()
    for tid in threads:
        with contextlib.suppress(OSError):  # a thread that just exited
            with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
                ns[names.get(tid, "native")] += int(f.read().split()[0])
    return ns


def _waited(before: dict | None, after: dict | None, wall: float) -> float | None:
    """Cores' worth of waiting for a core between two :func:`_thread_waits` ``wall`` seconds apart: by the
    threads alive at the end (one that exited meanwhile, a unit's connection thread, takes its part along),
    those started meanwhile in whole."""
    if before is None or after is None:
        return None
    return sum(ns - before.get(thread, 0) for thread, ns in after.items()) / 1e9 / wall


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
    #: This process's cores by thread name (see :func:`_thread_cpu`): its threads alive at the end, those
    #: started meanwhile in whole; None where the kernel does not say.
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
    # The waits are read outside the CPU clocks' window: reading every thread's file costs CPU of its own.
    own_wait, others_wait, threads = _thread_waits((me,)), _thread_waits(pids), _thread_cpu()
    passes, (own, others), started = 0, _cpu_seconds(pids), time.perf_counter()
    while not passes or time.perf_counter() - started < _WINDOW_S:
        work()
        passes += 1
    wall = time.perf_counter() - started
    own_after, others_after = _cpu_seconds(pids)
    threads_after = _thread_cpu()
    by_thread = None if threads is None or threads_after is None else \
        {name: max(0, ns - threads.get(name, 0)) / 1e9 / wall for name, ns in sorted(threads_after.items())}
    return Cores((own_after - own) / wall, (others_after - others) / wall,
                 _waited(own_wait, _thread_waits((me,)), wall), _waited(others_wait, _thread_waits(pids), wall),
                 wall / passes, by_thread)


def us_per_mib(cores: float, pass_s: float, nbytes: int) -> int:
    """CPU microseconds per MiB moved of a process that kept ``cores`` busy over passes of ``pass_s``."""
    return round(cores * pass_s / (nbytes / (1 << 20)) * 1e6)
