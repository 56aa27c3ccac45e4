"""``python -m bench.cluster``: the whole path across namespace hosts, its checks, and a teardown that leaves nothing.

Needs root (CAP_NET_ADMIN) and Ray; skipped otherwise. The bench's job runs
on host 0; what it prints last is checked here value by value.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys

import pytest

from bench import cluster
from bench.hosts import ROOT, TEARDOWN_GRACE_S, netns_names, processes_naming, ray_pointer, run_torn_down, unavailable
from tests.waiting import wait_until

_TINY = ["--sessions", "2", "--steps", "2", "--tokens", "128", "--layers", "4", "--topk", "2", "--capacity-mib", "16"]
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="Ray not installed (pip install 'gputq[ray]')")
needs_hosts = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))


def on_ray_hosts(test):
    """Namespace hosts with a Ray node each: root and Ray needed."""
    return needs_hosts(needs_ray(pytest.mark.ray(test)))


def _bench(*args, timeout: float) -> dict:
    proc = run_torn_down([sys.executable, "-m", "bench.cluster", *args, "--json"], timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check(out: dict, hosts: int) -> None:
    assert out["verified"] is True and out["transports_as_promised"] is True
    assert len(out["units"]) == hosts and len(set(out["units"].values())) == hosts  # one unit per host
    assert len(out["ranks"]) == hosts - 1  # a rank on every host but the master
    master = sorted(out["units"].values())[0]
    assert master.endswith("host0") and all(r["hostname"] != master for r in out["ranks"])
    for rank in out["ranks"]:
        assert rank["exact"] == rank["samples"] > 0 and rank["bytes"] > 0
        assert {u: c[0] for u, c in rank["choices"].items()} == {
            u: "shm" if h == rank["hostname"] else "tcp" for u, h in out["units"].items()}, rank
    assert sum(r["samples"] for r in out["ranks"]) == out["samples"]
    assert out["keys_left"] == 0 and out["unreachable"] == {} and out["freed"] > 0
    assert out["leftovers"] == {"namespaces": [], "processes": [], "tmp": [], "ray_processes": [], "ray_pointer": []}


@on_ray_hosts
@pytest.mark.timeout(110 + TEARDOWN_GRACE_S + 20)
def test_two_hosts_restore_bit_exact_over_shm_and_tcp_and_leave_nothing():
    pointer = ray_pointer()
    out = _bench("--hosts", "2", *_TINY, timeout=110)
    _check(out, 2)
    assert ray_pointer() == pointer


@on_ray_hosts
@pytest.mark.slow
@pytest.mark.timeout(390 + TEARDOWN_GRACE_S + 20)
def test_three_hosts_at_the_default_size():
    _check(_bench("--hosts", "3", timeout=390), 3)


@on_ray_hosts
@pytest.mark.timeout(120)
def test_ctrl_c_mid_job_tears_every_host_down():
    pointer = ray_pointer()
    proc = subprocess.Popen([sys.executable, "-m", "bench.cluster", "--hosts", "2", *_TINY], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        while line and not line.startswith("bench.hosts: "):
            line = proc.stderr.readline()
        assert line, "the bench never said its hosts were up"
        tag, tmp = line.split("tag ")[1].split(",")[0], line.rsplit("temp folder ", 1)[1].strip()
        # Ray is starting on the hosts: interrupt then.
        wait_until(lambda: processes_naming(tmp) or proc.poll() is not None, 60, "Ray to start on the hosts")
        assert proc.poll() is None, "the bench ended before Ray started on the hosts"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted: the hosts are torn down" in err
    assert not [n for n in netns_names() if n.startswith(tag)]
    assert not processes_naming(tmp) and not os.path.exists(tmp)
    assert ray_pointer() == pointer


@pytest.mark.timeout(10)
def test_without_cap_net_admin_it_says_why_and_exits_zero(monkeypatch, capsys):
    reason = "needs CAP_NET_ADMIN (run as root) to create network namespaces and veth pairs"
    monkeypatch.setattr("bench.hosts.unavailable", lambda: reason)
    cluster.main(["--hosts", "2", "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    assert f"skipped: {reason}" in out
    assert json.loads(out[-1]) == {"bench": "cluster", "skipped": reason}


# A child that tears down on SIGTERM as Hosts do. SIGTERM arrives blocked (the parent's preexec_fn blocks it
# before exec) and is let through only once the handler is in place, so however late the child starts, a
# SIGTERM sent meanwhile reaches the handler, never the default action.
_TEARS_DOWN = ("import signal, sys, time\n"
               "def down(*_):\n"
               "    print('torn down', flush=True)\n"
               "    sys.exit(130)\n"
               "signal.signal(signal.SIGTERM, {handler})\n"
               "print('up', flush=True)\n"
               "signal.pthread_sigmask(signal.SIG_UNBLOCK, {{signal.SIGTERM}})\n"
               "time.sleep(600)\n")


def _blocked_sigterm():
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


@pytest.mark.timeout(60)
def test_a_command_past_its_timeout_is_stopped_with_sigterm_and_tears_down():
    argv = [sys.executable, "-c", _TEARS_DOWN.format(handler="down")]
    with pytest.raises(subprocess.TimeoutExpired) as info:
        run_torn_down(argv, 0.2, preexec_fn=_blocked_sigterm)
    assert info.value.output.split() == ["up", "torn", "down"] and info.value.timeout == 0.2


@pytest.mark.timeout(60)
def test_a_command_that_ignores_sigterm_is_killed_after_the_grace(monkeypatch):
    monkeypatch.setattr("bench.hosts.TEARDOWN_GRACE_S", 0.2)
    argv = [sys.executable, "-c", _TEARS_DOWN.format(handler="signal.SIG_IGN")]
    with pytest.raises(subprocess.TimeoutExpired) as info:
        run_torn_down(argv, 0.2, preexec_fn=_blocked_sigterm)
    assert "torn down" not in (info.value.output or "")  # killed: it never got to tear down


@pytest.mark.timeout(60)
def test_a_command_within_its_timeout_runs_as_subprocess_run_would():
    done = run_torn_down([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); "
                          "sys.exit(3)"], 50)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
