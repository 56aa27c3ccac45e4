"""Run a command beside CPU-bound processes, as on a busy CI machine: ``python scripts/busy.py [-n N] -- CMD...``.

The burners spin until the command ends (or this script is interrupted) and
are then killed; the exit status is the command's. ``make test-busy`` runs
the fast suite this way: no fast test may depend on timing or free cores.
"""

from __future__ import annotations

import argparse
import multiprocessing
import subprocess
import sys


def _spin() -> None:
    while True:
        pass


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--burners", type=int, default=2, help="CPU-bound processes beside the command")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.burners < 0:
        parser.error("give a command after --, and a burner count >= 0")
    burners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.burners)]
    for burner in burners:
        burner.start()
    try:
        return subprocess.call(command)
    finally:
        for burner in burners:
            burner.kill()
            burner.join(10)


if __name__ == "__main__":
    sys.exit(main())
