"""Run a command as on a busy CI machine: ``python scripts/busy.py [-n N] [--cpus C] -- CMD...``.

Two ways a CI machine is busy, either or both:

- ``-n N``: N CPU-bound processes beside the command (a shared runner). They
  spin until the command ends (or this script is interrupted) and are then
  killed.
- ``--cpus C``: the command and everything it starts get C cores' worth of
  CPU time (a container's CPU limit): a cgroup whose CFS quota is C times
  its 100 ms period. A throttled container stops every thread of the
  command for the rest of a period once the quota is spent, which burners
  beside it never do. Needs a writable cgroup ``cpu`` controller (root, v1
  or v2); the cgroup is removed once the command and what it left behind
  have ended.

The exit status is the command's. ``make test-busy`` runs the fast suite
beside burners: no fast test may depend on timing or free cores.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import subprocess
import sys
import time

#: The CFS period the quota of ``--cpus`` is a share of, in microseconds.
PERIOD_US = 100_000
#: Where the cgroup file systems are mounted.
CGROUP_ROOT = "/sys/fs/cgroup"
#: Seconds the processes a command left behind get to exit before its cgroup is left in place.
LEFT_BEHIND_S = 10.0


def _spin() -> None:
    while True:
        pass


def _limit_files(cpus: float, name: str) -> tuple[str, dict[str, str]]:
    """A new cgroup named ``name`` for ``cpus`` cores: its directory, and the files to write there (in order)."""
    quota = str(max(1000, round(cpus * PERIOD_US)))
    if os.path.exists(os.path.join(CGROUP_ROOT, "cgroup.controllers")):  # v2: one hierarchy
        return os.path.join(CGROUP_ROOT, name), {"cpu.max": f"{quota} {PERIOD_US}"}
    return os.path.join(CGROUP_ROOT, "cpu", name), {"cpu.cfs_period_us": str(PERIOD_US), "cpu.cfs_quota_us": quota}


@contextlib.contextmanager
def cpu_limit(cpus: float):
    """A cgroup allowing ``cpus`` cores; yields its ``cgroup.procs`` (write a pid there to limit that process and
    the processes it starts). Raises ``OSError`` where no cgroup can be made here."""
    path, files = _limit_files(cpus, f"gputq-busy-{os.getpid()}")
    os.mkdir(path)
    try:
        for name, value in files.items():
            with open(os.path.join(path, name), "w") as f:
                f.write(value)
        yield os.path.join(path, "cgroup.procs")
    finally:
        _remove(path)


def _remove(path: str) -> None:
    """Remove the cgroup at ``path`` once the processes the command left behind have left it (they may still
    be exiting: a test suite's servers), or say why not after :data:`LEFT_BEHIND_S`."""
    deadline = time.monotonic() + LEFT_BEHIND_S
    while True:
        try:
            os.rmdir(path)
            return
        except OSError as exc:  # EBUSY while a process is still in it
            if time.monotonic() >= deadline:
                print(f"busy.py: cgroup {path} not removed: {exc}", file=sys.stderr)
                return
            time.sleep(0.1)


def _run(command: list[str], procs: str | None) -> int:
    if procs is None:
        return subprocess.call(command)

    def enter() -> None:  # in the child, before exec: the command starts inside the cgroup
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    return subprocess.call(command, preexec_fn=enter)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--burners", type=int, default=2, help="CPU-bound processes beside the command")
    parser.add_argument("--cpus", type=float, default=None,
                        help="cores' worth of CPU time the command gets (a CFS quota; needs root)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.burners < 0:
        parser.error("give a command after --, and a burner count >= 0")
    if args.cpus is not None and not 0.01 <= args.cpus <= os.cpu_count():
        parser.error(f"--cpus must be between 0.01 and this machine's {os.cpu_count()} cores, got {args.cpus}")
    with contextlib.ExitStack() as stack:
        procs = None
        if args.cpus is not None:
            try:
                procs = stack.enter_context(cpu_limit(args.cpus))
            except OSError as exc:
                parser.exit(2, f"busy.py: --cpus needs a writable cgroup cpu controller (root): {exc}\n")
        burners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.burners)]
        for burner in burners:
            burner.start()
        try:
            return _run(command, procs)
        finally:
            for burner in burners:
                burner.kill()
                burner.join(10)


if __name__ == "__main__":
    sys.exit(main())
