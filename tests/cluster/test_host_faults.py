"""The faults only a cluster has, on namespace hosts: a link cut mid-read and restored, a partition
between the controller and a unit, a slow link.

The reader and the controller run on host 0 (``tests.cluster.probe faults``),
unit ``su-1`` on host 1 (whose link breaks) and ``su-2`` on host 2 (a
survivor); a trainer on host 2 reads across the partition. Each step's
figures are printed (``pytest -s``): docs/RELIABILITY.md tabulates them.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time

import pytest

from bench.hosts import ROOT, Hosts, unavailable, units_on_hosts
from tests.cluster.probe import on_host

pytestmark = [pytest.mark.skipif(unavailable() is not None, reason=str(unavailable())),
              pytest.mark.timeout(120)]

TOKEN = "token-of-the-cross-host-fault-tests"
TIMEOUT_S = 2.0
KEY_BYTES = 256 << 10  # each key the probe writes (tests.cluster.probe)


def _next(proc: subprocess.Popen, event: str, limit_s: float = 40.0) -> dict:
    """The probe's next JSON line, which must be ``event``."""
    ready, _, _ = select.select([proc.stdout], [], [], limit_s)
    line = proc.stdout.readline() if ready else ""
    assert line, f"no {event!r} from the probe within {limit_s} s (exit code {proc.poll()})"
    seen = json.loads(line)
    assert seen["event"] == event, seen
    return seen


def _tell(proc: subprocess.Popen) -> None:
    proc.stdin.write("go\n")
    proc.stdin.flush()


def test_link_faults_give_typed_errors_in_time_and_cost_the_survivors_nothing():
    with Hosts(3) as hosts:
        units = units_on_hosts(hosts, (1, 2), transport="tcp", unit_capacity_bytes=32 << 20, token=TOKEN)
        try:
            addresses = {name: unit.address for name, unit in units.items()}
            hosts.shape(1, "200mbit")  # 8 MiB take ~0.35 s: the cut lands inside a read
            probe = hosts.popen(0, [sys.executable, "-m", "tests.cluster.probe", "faults", json.dumps(
                {"addresses": addresses, "token": TOKEN, "lossy": "su-1", "timeout": TIMEOUT_S})], cwd=ROOT,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert _next(probe, "reading")["exact"] is True
            cut_at = time.monotonic()
            hosts.cut(1)
            failed = _next(probe, "failed")
            restored_at = time.monotonic()
            hosts.restore(1)
            _tell(probe)
            readmitted = _next(probe, "readmitted")
            parted_at = time.monotonic()
            hosts.partition(0, 1)
            _tell(probe)
            partitioned = _next(probe, "partitioned")
            trainer = on_host(hosts, 2, "path", {"addresses": addresses, "token": TOKEN, "keys": 8})
            healed_at = time.monotonic()
            hosts.partition(0, 1, heal=True)
            _tell(probe)
            healed = _next(probe, "healed")
            hosts.shape(1, "10mbit")  # 8 MiB would take ~7 s, against a 2 s timeout
            _tell(probe)
            slow = _next(probe, "slow")
            probe.wait(30)
        finally:
            for unit in units.values():
                unit.close()
    # fault: (detected after, longest wait, keys checked bit-exact elsewhere, keys lost of those)
    rows = {
        "link cut mid-read": (failed["at"] - cut_at, failed["waited"], failed["survivors_keys"],
                              failed["survivors_keys"] - failed["survivors_exact"]),
        "link restored: re-admitted (the cut unit's keys)": (readmitted["at"] - restored_at, None,
                                                             readmitted["keys"],
                                                             readmitted["keys"] - readmitted["exact"]),
        "controller-unit partition (a trainer elsewhere reads)": (partitioned["at"] - parted_at, None,
                                                                  trainer["read"], trainer["read"] - trainer["exact"]),
        "partition healed": (healed["at"] - healed_at, None, 0, 0),
        "slow link (10 mbit/s)": (None, slow["waited"], slow["survivors_keys"],
                                  slow["survivors_keys"] - slow["survivors_exact"]),
    }
    print("\nfault | detected after (s) | longest wait (s) | bytes checked | bytes lost")
    for fault, (detected, waited, checked, lost) in rows.items():
        print(f"{fault} | {'-' if detected is None else f'{detected:.2f}'} | "
              f"{'-' if waited is None else f'{waited:.2f}'} | {checked * KEY_BYTES} | {lost * KEY_BYTES}")
    # the cut: the read in flight (or, when that one finished just before the cut, the next) gets a
    # typed error within its timeout, counted from the cut, and the unit is marked lost
    assert failed["at"] - cut_at < TIMEOUT_S + 0.5
    assert failed["error"] == "UnitTimeoutError" and failed["lost"] == ["su-1"]
    assert failed["waited"] < TIMEOUT_S + 0.5 and failed["survivors_exact"] == failed["survivors_keys"] == 8
    # restored: the reader's prober and the controller's heartbeat re-admit it, and it kept its keys
    assert readmitted["at"] - restored_at < 5 and readmitted["controller_at"] - restored_at < 5
    assert readmitted["exact"] == readmitted["keys"] == 8
    # the partition: the controller sees the unit lost, a trainer elsewhere still reads it whole
    assert partitioned["at"] - parted_at < 5 and partitioned["reason"]
    assert trainer["exact"] == trainer["read"] == 16 and trainer["hostname"] == hosts.hostnames[2]
    assert healed["at"] - healed_at < 5
    # the slow link: a typed timeout within the timeout, not a hang; the survivors are whole
    assert slow["error"] == "UnitTimeoutError" and slow["waited"] < TIMEOUT_S + 0.5
    assert slow["survivors_exact"] == slow["survivors_keys"] == 8
