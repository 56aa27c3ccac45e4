"""The auto policy: which backend a channel uses, and why (probes monkeypatched)."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from gputq.client.clients import UnitClients
from gputq.config import GputqConfig, add_transfer_queue_arguments
from gputq.errors import InvalidInputError
from gputq.transport import get_transport, policy
from gputq.transport.handler import ServerLimits
from gputq.transport.tcp import TcpChannel
from tests.transport.units import make_unit

HERE = {"hostname": "node-a"}
REMOTE = {"hostname": "node-b"}


@pytest.fixture(autouse=True)
def machine(monkeypatch):
    """A host named node-a with NIXL and no InfiniBand, unless a test says otherwise."""
    monkeypatch.setattr(policy, "local_hostname", lambda: "node-a")
    monkeypatch.setattr(policy, "nixl_import_error", lambda: None)
    monkeypatch.setattr(policy, "infiniband_devices", lambda: [])
    return monkeypatch


def test_explicit_names_are_kept():
    assert policy.choose_transport("tcp", HERE)[0] == "tcp"
    assert policy.choose_transport("rdma", REMOTE)[0] == "rdma"
    assert policy.choose_transport(" RDMA ", None)[0] == "rdma"


def test_auto_same_host_maps_the_arena(machine):
    name, reason = policy.choose_transport("auto", HERE)
    assert name == "shm" and "same host" in reason and "mapped read-only" in reason
    # shm needs no NIXL
    machine.setattr(policy, "nixl_import_error", lambda: "ImportError: No module named 'nixl'")
    assert policy.choose_transport("auto", HERE)[0] == "shm"


def test_auto_same_host_without_shared_mappings_uses_rdma_over_cma(machine):
    machine.setattr(policy, "shm_supported", lambda: False)
    name, reason = policy.choose_transport("auto", HERE)
    assert name == "rdma" and "cma" in reason


def test_shm_is_forced_by_name(machine):
    assert policy.choose_transport("shm", REMOTE) == ("shm", "requested shm explicitly")
    assert "shm" in policy.TRANSPORT_NAMES


def test_auto_remote_without_infiniband_stays_on_tcp():
    name, reason = policy.choose_transport("auto", REMOTE)
    assert name == "tcp" and "InfiniBand" in reason
    assert policy.choose_transport("auto", None)[0] == "tcp"  # unknown peer counts as remote


def test_auto_remote_with_infiniband_uses_rdma(machine):
    machine.setattr(policy, "infiniband_devices", lambda: ["mlx5_0", "mlx5_1"])
    name, reason = policy.choose_transport("auto", REMOTE)
    assert name == "rdma" and "mlx5_0" in reason
    # ... unless the peer published that it has none
    assert policy.choose_transport("auto", dict(REMOTE, ib_devices=[]))[0] == "tcp"
    assert policy.choose_transport("auto", dict(REMOTE, ib_devices=["mlx5_0"]))[0] == "rdma"


def test_auto_without_nixl_is_tcp_everywhere(machine):
    machine.setattr(policy, "nixl_import_error", lambda: "ImportError: No module named 'nixl'")
    machine.setattr(policy, "infiniband_devices", lambda: ["mlx5_0"])
    name, reason = policy.choose_transport("auto", REMOTE)
    assert name == "tcp" and "nixl" in reason and "pip install" in reason


@pytest.mark.parametrize("env", ["tcp", "shm", "auto", "ib"])
def test_the_policy_reads_no_environment_variable(machine, env):
    """``GPUTQ_TRANSPORT`` is the config's to read (below the flag); the request is taken as given."""
    machine.setenv(policy.ENV_VAR, env)
    assert policy.choose_transport("rdma", HERE) == ("rdma", "requested rdma explicitly")
    assert policy.choose_transport("tcp", HERE) == ("tcp", "requested tcp explicitly")
    assert policy.choose_transport("auto", HERE)[0] == "shm"


def test_bad_names_are_typed_errors(machine):
    with pytest.raises(InvalidInputError, match="carrier"):
        policy.choose_transport("carrier", HERE)
    with pytest.raises(ValueError, match="'ib' is not one of auto, shm, rdma, tcp"):
        policy.choose_transport("ib", HERE)


def test_probes_answer_on_this_machine():
    # the real probes, whatever the machine has: typed answers, no exceptions
    assert isinstance(policy.is_same_host({"hostname": policy.local_hostname()}), bool)
    assert policy.is_same_host(None) is False


@pytest.mark.timeout(60)
def test_the_transport_flag_beats_the_environment_on_the_channel(monkeypatch):
    """``GPUTQ_TRANSPORT`` is read once, by the config, below the flag: a channel to a unit
    on this host opened with ``--transport tcp`` uses tcp even with ``GPUTQ_TRANSPORT=shm``."""
    monkeypatch.undo()  # this machine's real probes: the unit below is on this host
    monkeypatch.setenv("GPUTQ_TRANSPORT", "shm")
    args = add_transfer_queue_arguments(argparse.ArgumentParser()).parse_args(["--transport", "tcp"])
    config = GputqConfig.load(args=args).replace(token="t" * 32)
    assert config.transport == "tcp"
    assert GputqConfig.load().transport == "shm"  # without the flag the variable counts
    with make_unit(1 << 20, "su-flag") as unit:
        unit.put("a", np.arange(64, dtype=np.uint8), {"partition": "p"})
        server = get_transport("tcp").serve(unit, host="127.0.0.1", port=0, token=config.token,
                                            limits=ServerLimits(max_frame_bytes=1 << 20))
        try:
            assert policy.is_same_host(server.address)  # auto would map the arena: shm
            with UnitClients({"su-flag": server.address}, config) as clients:
                dest = np.zeros(64, np.uint8)
                assert clients.channel("su-flag").read(["a"], dest, timeout=10) == [64]
                assert np.array_equal(dest, np.arange(64, dtype=np.uint8))
                name, reason = clients.transport_of("su-flag")
                assert (name, reason) == ("tcp", "requested tcp explicitly")
                assert isinstance(clients._channels["su-flag"], TcpChannel)
        finally:
            server.close()
