"""The soak's invariants and its fault schedule, on the evidence of runs that broke them (no hosts needed)."""

from __future__ import annotations

import random
import re
import subprocess
import sys

import pytest

from bench import soak_job
from bench.hosts import ROOT
from bench.soak import KINDS, Deck, _serve
from bench.soak_checks import Bounds, drift, key_violations, late_surface, untyped_errors, wrong_samples

pytestmark = pytest.mark.timeout(30)


def test_a_sample_that_digests_otherwise_is_named_and_one_not_consumed_is_not():
    expected = ["a", "b", "c", "d"]
    assert wrong_samples(expected, {0: "a", 1: "b", 3: "d"}) == []
    assert wrong_samples(expected, {0: "a", 2: "x", 3: "y"}) == [2, 3]


def test_an_error_outside_gputqs_tree_is_a_violation():
    typed = {"type": "UnitLostError", "typed": True, "message": "su-1 lost", "at": 1.0}
    untyped = {"type": "KeyError", "typed": False, "message": "'x'", "at": 2.0}
    assert untyped_errors([typed]) == []
    assert untyped_errors([typed, untyped]) == ["untyped error KeyError: 'x'"]


def test_a_fault_surfaces_within_its_deadline_or_is_named():
    assert late_surface("unit-stop", 10.0, 12.0, 3.0) == []
    assert late_surface("unit-stop", 10.0, 13.5, 3.0) == ["unit-stop surfaced after 3.50 s, past its 3.0 s deadline"]
    assert late_surface("link-cut", 10.0, None, 3.0) == ["link-cut did not surface as a typed error within 3.0 s"]
    assert late_surface("slow-link", 10.0, None, None) == []  # a slow link need not fail


def test_keys_of_a_released_rollout_an_unreachable_unit_and_a_lease_left_behind_are_violations():
    clean = {"violations": [], "unreachable": {}}
    idle = {"su-0": {"leases": 0, "reservations": 0, "writers_waiting": 0}}
    assert key_violations(clean, idle) == []
    leaked = {"violations": ["unit su-0 stores 1 keys of partition 'r3', which is not live: ['r3/s0/0']"],
              "unreachable": {"su-2": "ping timed out"}}
    found = key_violations(leaked, {"su-0": {"leases": 1, "reservations": 0, "writers_waiting": 0}})
    assert found == ["unit su-0 stores 1 keys of partition 'r3', which is not live: ['r3/s0/0']",
                     "unit su-2 unreachable after the faults healed: ping timed out",
                     "unit su-0 holds 1 leases after the iteration"]


def test_drift_past_any_bound_is_named_and_drift_within_them_is_not():
    bounds = Bounds(rss_bytes=64 << 20, fds=8, threads=4)
    base = {"rss": 100 << 20, "fds": 40, "threads": 10}
    assert drift("master", base, {"rss": 160 << 20, "fds": 48, "threads": 14}, bounds) == []
    found = drift("unit:su-1", base, {"rss": 170 << 20, "fds": 49, "threads": 15}, bounds)
    assert [v.split(": ")[1].split()[0] for v in found] == ["rss", "fds", "threads"]
    assert found[1] == "unit:su-1: fds 49 against a baseline of 40 (bound +8)"


def test_the_deck_deals_every_kind_once_per_round_a_kind_first_and_the_same_for_a_seed():
    kinds = list(KINDS)
    dealt = [Deck(kinds, random.Random(7)).draw() for _ in range(1)]
    deck = Deck(kinds, random.Random(7))
    round_size = len(kinds) + len(kinds) // 4
    first = [deck.draw() for _ in range(round_size)]
    assert sorted(k for k in first if k) == sorted(kinds) and first.count(None) == len(kinds) // 4
    assert first[0] is not None and first[0] == dealt[0]
    second = [deck.draw() for _ in range(round_size)]
    assert sorted(k for k in second if k) == sorted(kinds)
    again = Deck(kinds, random.Random(7))
    assert [again.draw() for _ in range(2 * round_size)] == first + second
    assert [Deck(kinds, random.Random(8)).draw() for _ in range(round_size)] != first


_JOB = """
from bench.soak_job import Harness
harness = Harness()
print("a line of Ray's own", flush=True)
harness.tell("iteration", iteration=3, verified=12, faults={"unit-kill": 1})
harness.tell("done", report={"iterations": 4})
"""


def test_the_harness_shows_each_iteration_on_stderr_and_returns_the_jobs_report(capsys):
    # A real job process speaking the job's side of the line protocol; its Ray lines are skipped.
    with subprocess.Popen([sys.executable, "-c", _JOB], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as job:
        report = _serve(job, None, 0.5)
        assert job.wait(20) == 0
    assert report == {"iterations": 4}
    captured = capsys.readouterr()
    assert captured.out == ""  # stdout is left to the report (--json)
    assert re.fullmatch(r"soak: iteration 3 done at \d+\.\d of 0\.5 min, 12 samples verified, "
                        r"faults \{'unit-kill': 1\}\n", captured.err)


def test_a_job_that_ends_without_its_report_is_an_error():
    with subprocess.Popen([sys.executable, "-c", "print('@gputq-soak ' + '{\"event\": \"iteration\", "
                           "\"iteration\": 0, \"verified\": 0, \"faults\": {}}')"], cwd=ROOT,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as job:
        with pytest.raises(RuntimeError, match="ended or went silent"):
            _serve(job, None, 0.5)


def test_each_message_to_the_harness_starts_the_jobs_hang_watchdog_over(monkeypatch, capsys):
    # Armed once for the whole run, it printed every thread's stack every period of a healthy soak.
    armed = []
    monkeypatch.setattr(soak_job.faulthandler, "dump_traceback_later",
                        lambda timeout, repeat=False: armed.append((timeout, repeat)))
    harness = soak_job.Harness()
    harness.tell("iteration", iteration=0, verified=0, faults={})
    harness.tell("iteration", iteration=1, verified=2, faults={})
    assert armed == [(2 * soak_job.PHASE_S, True)] * 2
    assert capsys.readouterr().out.count(soak_job.MARK) == 2
