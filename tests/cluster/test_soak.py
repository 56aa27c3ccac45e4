"""The soak (``python -m bench.soak``) on namespace hosts: every fault kind injected, every invariant held,
and each invariant shown to catch a run that breaks it.

Both runs end with three sabotaged iterations (a flipped bit in what a
trainer consumed, a key stored under no live rollout, descriptors the
master never closes): a soak whose byte, key or drift check were removed
would not catch them, and these tests fail. The tiny run widens every
detection deadline: in ``make test`` the machine may be busy, and a hang
is still caught.
"""

from __future__ import annotations

import json
import sys

import pytest

from bench.hosts import ROOT, TEARDOWN_GRACE_S, run_torn_down, unavailable
from bench.soak import KINDS

pytest.importorskip("ray", reason="Ray not installed (pip install 'gputq[ray]')")

pytestmark = [pytest.mark.skipif(unavailable() is not None, reason=str(unavailable())), pytest.mark.ray]

SABOTAGE = ["bytes", "leak", "fds"]


def _soak(*flags: str, limit_s: float) -> dict:
    done = run_torn_down([sys.executable, "-m", "bench.soak", "--json", "--sabotage", ",".join(SABOTAGE), *flags],
                         limit_s, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _check(report: dict, kinds) -> None:
    assert report["violation"] is None, report["violation"]
    assert {kind for kind, n in report["faults"].items() if n} == set(kinds)
    assert report["wrong_bytes"] == 0 and report["leaked_keys"] == 0
    assert report["samples_verified"] > 0 and report["bytes_verified"] > 0
    assert report["dropped_samples"] > 0  # the split-kill's samples, named before the split
    caught = report["sabotage"]
    assert "restored wrong bytes" in caught["bytes"]
    assert "partition 'leaked', which is not live" in caught["leak"]
    assert "master: fds" in caught["fds"]
    assert all(d["fds"] <= 8 and d["threads"] <= 4 for d in report["drift"].values()), report["drift"]


@pytest.mark.timeout(560 + TEARDOWN_GRACE_S + 20)
def test_a_tiny_soak_meets_each_fault_once_and_holds_every_invariant():
    kinds = list(KINDS)
    # One round of the deck: every kind once, and the fault-free turns; packed IDs (the 1-minute soak
    # and the logged runs store uint16).
    report = _soak("--iterations", str(len(kinds) + len(kinds) // 4), "--hold-s", "2", "--slack-s", "20",
                   "--sessions", "4", "--tokens", "512", "--seed", "3", "--dtype", "packed", limit_s=560)
    _check(report, kinds)


@pytest.mark.slow
@pytest.mark.timeout(850 + TEARDOWN_GRACE_S + 20)
def test_a_one_minute_soak_holds_every_invariant():
    report = _soak("--minutes", "1", "--seed", "11", limit_s=850)
    _check(report, KINDS)
    assert report["iterations"] >= len(KINDS)
