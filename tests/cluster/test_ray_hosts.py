"""The whole path on a Ray cluster of namespace hosts, and a host lost with its raylet and unit.

Host 0 (the master) runs the Ray head, the controller, the writer and a
trainer rank; hosts 1 and 2 each run a Ray node, their unit and a trainer
rank (``tests.cluster.ray_driver``). Slow: three Ray nodes take ~15 s to start.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time

import pytest

pytest.importorskip("ray", reason="Ray not installed (pip install 'gputq[ray]')")

from bench.hosts import (  # noqa: E402
    GCS_PORT,
    ROOT,
    Hosts,
    processes_naming,
    ray_logs,
    ray_pointer,
    start_ray,
    unavailable,
)
from tests.cluster.ray_driver import MARK  # noqa: E402

pytestmark = [pytest.mark.skipif(unavailable() is not None, reason=str(unavailable())),
              pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]

VICTIM = 2


def _line(proc: subprocess.Popen, limit_s: float) -> dict:
    """The driver's next line of its own (Ray writes some lines to its stdout too)."""
    deadline = time.monotonic() + limit_s
    while True:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        line = proc.stdout.readline() if ready else ""
        if not line:
            proc.kill()
            proc.wait(10)
            with open(proc.stderr_path) as err:
                raise AssertionError(f"no line from the driver within {limit_s} s: {err.read()[-4000:]}")
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])


def test_cluster_mode_across_hosts_restores_bit_exact_and_survives_a_lost_host():
    pointer_before = ray_pointer()
    with Hosts(3) as hosts:
        env = start_ray(hosts)
        driver = hosts.popen(0, [sys.executable, "-m", "tests.cluster.ray_driver", json.dumps(
            {"address": f"{hosts.addresses[0]}:{GCS_PORT}", "hosts": 3, "samples": 24, "victim": VICTIM})],
            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            stderr=open(os.path.join(hosts.tmp, "driver.err"), "w"))
        driver.stderr_path = os.path.join(hosts.tmp, "driver.err")
        try:
            ready = _line(driver, 200)
        except AssertionError:
            print(ray_logs(hosts))
            raise
        killed_at = time.monotonic()
        assert hosts.kill(VICTIM)  # the victim's raylet, its unit and its rank, at once
        driver.stdin.write(f"{killed_at}\n")
        driver.stdin.flush()
        done = _line(driver, 90)
        driver.wait(30)
        tmp = hosts.tmp
        assert processes_naming(tmp)  # the check below can see the nodes' processes
        assert os.path.exists(os.path.join(tmp, "ray0", "ray_current_cluster"))  # the head's pointer went there
    assert not os.path.exists(tmp)  # and with it
    assert not processes_naming(tmp)  # no Ray process of the cluster outlived it
    assert ray_pointer() == pointer_before  # the machine's own pointer untouched

    unit_host = ready["units"]  # unit -> hostname: one unit per host
    assert sorted(unit_host.values()) == sorted(hosts.hostnames)
    for rank in ready["ranks"]:  # every (reader, unit) pair: shm on the same host, tcp across (no InfiniBand)
        assert rank["exact"] == ready["samples"] == 24
        assert {u: c[0] for u, c in rank["choices"].items()} == {
            u: "shm" if h == rank["hostname"] else "tcp" for u, h in unit_host.items()}, rank
    print(f"\nnode dead after {done['node_dead_after_s']:.2f} s; removed {done['removed']}; "
          f"{done['lost_refs']} of 24 references lost; controller: {done['controller_violations']}")
    victim_unit = next(u for u, h in unit_host.items() if h == hosts.hostnames[VICTIM])
    assert done["removed"] == [victim_unit] and victim_unit not in done["live"]
    assert done["lost_refs"] == done["lost_on_removed"] > 0
    assert done["controller_violations"] == [
        f"{done['lost_refs']} referenced key uses name unit {victim_unit}, not a member"]
    assert done["survivors_exact"] == [done["kept"]] * 2 and done["kept"] == 24 - done["lost_refs"]
    assert done["keys_left"] == 0 and done["node_dead_after_s"] < 30
