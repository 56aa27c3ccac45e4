"""The auto policy: which backend a channel uses, and why (probes monkeypatched)."""

from __future__ import annotations

import pytest

from gputq.errors import InvalidInputError
from gputq.transport import policy

HERE = {"hostname": "node-a"}
REMOTE = {"hostname": "node-b"}


@pytest.fixture(autouse=True)
def machine(monkeypatch):
    """A host named node-a with NIXL and no InfiniBand, unless a test says otherwise."""
    monkeypatch.delenv(policy.ENV_VAR, raising=False)
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


def test_shm_is_forced_by_name_or_environment(machine):
    assert policy.choose_transport("shm", REMOTE) == ("shm", "requested shm explicitly")
    machine.setenv(policy.ENV_VAR, "shm")
    name, reason = policy.choose_transport("tcp", REMOTE)
    assert name == "shm" and policy.ENV_VAR in reason
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


def test_env_var_overrides_the_request(machine):
    machine.setenv(policy.ENV_VAR, "tcp")
    name, reason = policy.choose_transport("rdma", HERE)
    assert name == "tcp" and policy.ENV_VAR in reason
    machine.setenv(policy.ENV_VAR, "auto")
    assert policy.choose_transport("tcp", HERE)[0] == "shm"


def test_bad_names_are_typed_errors(machine):
    with pytest.raises(InvalidInputError, match="carrier"):
        policy.choose_transport("carrier", HERE)
    machine.setenv(policy.ENV_VAR, "ib")
    with pytest.raises(ValueError, match=policy.ENV_VAR):
        policy.choose_transport("auto", HERE)


def test_probes_answer_on_this_machine():
    # the real probes, whatever the machine has: typed answers, no exceptions
    assert isinstance(policy.is_same_host({"hostname": policy.local_hostname()}), bool)
    assert policy.is_same_host(None) is False
