"""Many hosts on one machine: the harness leaves nothing behind, and what a unit exposes to other hosts.

Each host is a network namespace with its own address, hostname and
/dev/shm (:mod:`bench.hosts`); units and peers run on them as
processes. Needs root (CAP_NET_ADMIN): skipped otherwise.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile

import pytest

from bench.faults import UnitProcess
from bench.hosts import ROOT, Hosts, netns_names, unavailable, units_on_hosts
from gputq.config import GputqConfig
from gputq.transport.policy import nixl_import_error
from tests.cluster.probe import on_host
from tests.sockets import listening_sockets

pytestmark = [pytest.mark.skipif(unavailable() is not None, reason=str(unavailable())),
              pytest.mark.timeout(90)]


# A child builds two hosts, starts a process on each that leaves a file in its /dev/shm,
# says where everything is, and then ends as the parameter says.
_CHILD = r'''
import json, os, sys, time
from bench.hosts import Hosts
how = sys.argv[1]
with Hosts(2) as hosts:
    procs = [hosts.popen(i, ["sh", "-c", f"touch /dev/shm/{hosts.tag}-left && echo up && exec sleep 120"],
                         stdout=__import__("subprocess").PIPE) for i in range(2)]
    for proc in procs:
        assert proc.stdout.readline() == b"up\n"
    print(json.dumps({"tag": hosts.tag, "tmp": hosts.tmp, "pids": [p.pid for p in procs]}), flush=True)
    if how == "error":
        raise RuntimeError("a failing test")
    if how in ("sigint", "sigterm"):
        time.sleep(60)  # the parent signals us meanwhile
'''


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("how", ["exit", "error", "sigint", "sigterm"])
def test_hosts_leave_nothing_behind_on_exit_failure_and_signals(how):
    child = subprocess.Popen([sys.executable, "-c", _CHILD, how], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        built = json.loads(child.stdout.readline())
        assert netns_names() >= {f"{built['tag']}-h0", f"{built['tag']}-h1", f"{built['tag']}-sw"}
        assert all(_alive(pid) for pid in built["pids"])
        if how in ("sigint", "sigterm"):
            child.send_signal(signal.SIGINT if how == "sigint" else signal.SIGTERM)
        _, err = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    assert (child.returncode == 0) == (how == "exit"), err
    assert not [n for n in netns_names() if n.startswith(built["tag"])]
    assert not [pid for pid in built["pids"] if _alive(pid)]
    assert not os.path.exists(built["tmp"])
    shm_root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    assert not [f for f in os.listdir(shm_root) if built["tag"] in f]  # the hosts' /dev/shm were their own


def test_each_host_has_its_own_address_hostname_and_dev_shm():
    with Hosts(2) as hosts:
        hosts.run(0, ["touch", f"/dev/shm/{hosts.tag}-on-host0"], 10)  # one process of host 0 ...
        seen = [hosts.run(i, ["sh", "-c", "hostname; ls -A /dev/shm; "  # ... another one sees it there only
                                          f"{sys.executable} -c 'import socket; s=socket.socket(); "
                                          f"s.bind((\"{hosts.addresses[i]}\", 0)); print(\"bound\")'"], 30)
                for i in range(2)]
        assert [r.stdout.split() for r in seen] == [[hosts.hostnames[0], f"{hosts.tag}-on-host0", "bound"],
                                                   [hosts.hostnames[1], "bound"]], seen
        # host 1 is reachable (every port answered: refused) and nothing listens there
        assert on_host(hosts, 0, "scan", {"host": hosts.addresses[1], "last": 1024}) == {"open": [], "answered": 1024}


def _unit_on(hosts: Hosts, host: int, name: str, transport: str, bind: str) -> UnitProcess:
    config = GputqConfig(enabled=True, transport=transport, host=bind, unit_capacity_bytes=8 << 20,
                         max_connections=16, token="token-of-the-cross-host-exposure-test")
    return UnitProcess(name, config, wrap=lambda argv: hosts.command(host, argv))


@pytest.mark.parametrize("transport", ["tcp", pytest.param("rdma", marks=[
    pytest.mark.rdma, pytest.mark.skipif(nixl_import_error() is not None, reason=str(nixl_import_error()))])])
def test_from_another_host_only_the_units_own_sockets_answer_and_a_flood_leaves_token_holders_working(transport):
    with Hosts(2) as hosts:
        public = _unit_on(hosts, 1, "su-public", transport, hosts.addresses[1])
        private = _unit_on(hosts, 1, "su-private", transport, "127.0.0.1")
        try:
            address = public.address
            private.address
            listening = listening_sockets(public.pid)
            # every listening socket of the unit (UCX's too, for rdma) binds the configured address
            assert {host for host, _ in listening} == {hosts.addresses[1]}, listening
            assert len(listening) == (2 if transport == "rdma" else 1), listening
            assert {host for host, _ in listening_sockets(private.pid)} == {"127.0.0.1"}
            # every port answered, and only the unit's own accept
            assert on_host(hosts, 0, "scan", {"host": hosts.addresses[1]}) == {
                "open": sorted(port for _, port in listening), "answered": 65535}
            seen = on_host(hosts, 0, "exposure", {"address": address, "token": "token-of-the-cross-host-exposure-test",
                                                  "flood": 64, "rounds": 10}, 80)
        finally:
            public.close()
            private.close()
    assert seen["wrong_token"] == "AuthenticationError"
    refusals = {what: (answer["error"], answer["then"]) for what, answer in seen["without_hello"].items()}
    # an ERROR reply, then the close; a WRITE's payload breaks the pre-auth frame limit before the token check
    assert refusals == {"read": ("AuthenticationError", ""), "write": ("ProtocolError", ""),
                        "nixl_connect": ("AuthenticationError", "")}, refusals
    assert all(before == after for before, after in seen["stats_unchanged"].values()), seen["stats_unchanged"]
    flood = seen["flood"]
    print(f"\nflood ({transport}): {json.dumps(flood)}")
    assert flood["exact"] == flood["rounds"] and flood["errors"] == [] and flood["lost"] == [], flood
    assert flood["closed_by_unit"] > 0  # the flood did fill the unit: its oldest handshakes made way
    assert flood["longest_s"] < 5.0


def test_auto_picks_shm_on_the_units_host_and_tcp_across_hosts_and_every_read_is_bit_exact():
    token = "token-of-the-cross-host-path-test"
    with Hosts(3) as hosts:
        units = units_on_hosts(hosts, (1, 2), transport="auto", unit_capacity_bytes=16 << 20, token=token)
        try:
            addresses = {name: unit.address for name, unit in units.items()}
            assert {a["hostname"] for a in addresses.values()} == {hosts.hostnames[1], hosts.hostnames[2]}
            on_master = on_host(hosts, 0, "path", {"addresses": addresses, "token": token, "write": True,
                                                  "keys": 8})
            on_host1 = on_host(hosts, 1, "path", {"addresses": addresses, "token": token, "keys": 8,
                                                 "release": True})
            info = json.loads(hosts.run(1, [os.path.join(os.path.dirname(sys.executable), "gputq"), "info",
                                            "--json"], 60, cwd=ROOT).stdout)
        finally:
            for unit in units.values():
                unit.close()
    assert on_master["hostname"] == hosts.hostnames[0] and on_host1["hostname"] == hosts.hostnames[1]
    assert {u: c[0] for u, c in on_master["choices"].items()} == {"su-1": "tcp", "su-2": "tcp"}
    assert {u: c[0] for u, c in on_host1["choices"].items()} == {"su-1": "shm", "su-2": "tcp"}
    assert on_host1["choices"]["su-1"][2] is None  # mapped: no fallback to another lane
    assert on_host1["choices"]["su-1"][1] == info["transport"]["same_host"]["reason"]
    assert on_host1["choices"]["su-2"][1] == info["transport"]["remote"]["reason"]
    assert info["hostname"] == hosts.hostnames[1]
    for seen in (on_master, on_host1):
        assert seen["exact"] == seen["read"] == 16
    assert on_host1["keys_left"] == {"su-1": 0, "su-2": 0}
