"""A unit's UCX listens only on the interface of its bind address; the operator's UCX_NET_DEVICES wins."""

from __future__ import annotations

import os

import pytest

from gputq.transport import ucx_devices
from gputq.transport.ucx_devices import NET_DEVICES_VAR, interface_of, ucx_bound_to, unit_net_devices
from tests.sockets import listening_sockets
from tests.transport.units import make_unit

pytestmark = pytest.mark.timeout(60)

TOKEN = "token-of-the-ucx-device-tests"


def test_the_interface_of_an_address_is_the_one_holding_it():
    addresses = ucx_devices._ipv4_addresses()
    assert addresses.get("127.0.0.1") == "lo"
    for address, interface in addresses.items():
        assert interface_of(address) == interface
    assert interface_of("127.0.0.9") == "lo"  # all of 127/8 is lo's
    assert interface_of("localhost") == "lo"


@pytest.mark.parametrize("host", ["0.0.0.0", "::1", "192.0.2.254.1", "198.51.100.77"])
def test_wildcards_ipv6_and_foreign_addresses_are_not_narrowed(host):
    assert interface_of(host) is None and unit_net_devices(host) is None


def test_the_variable_is_set_inside_the_block_only(monkeypatch):
    monkeypatch.delenv(NET_DEVICES_VAR, raising=False)
    with ucx_bound_to("127.0.0.1") as devices:
        assert devices.split(",")[0] == "lo" and os.environ[NET_DEVICES_VAR] == devices
    assert NET_DEVICES_VAR not in os.environ
    with ucx_bound_to("0.0.0.0") as devices:  # every interface, as asked
        assert devices is None and NET_DEVICES_VAR not in os.environ


def test_an_operators_setting_is_kept(monkeypatch):
    monkeypatch.setenv(NET_DEVICES_VAR, "eth7,mlx5_3:1")
    with ucx_bound_to("127.0.0.1") as devices:
        assert devices == "eth7,mlx5_3:1" == os.environ[NET_DEVICES_VAR]
    assert os.environ[NET_DEVICES_VAR] == "eth7,mlx5_3:1"


@pytest.mark.rdma
def test_an_rdma_unit_bound_to_loopback_listens_on_loopback_only(monkeypatch):
    nixl = pytest.importorskip("gputq.transport.nixl", reason="gputq.transport.nixl does not import")
    try:
        nixl.import_nixl()
    except Exception as exc:
        pytest.skip(f"nixl does not import: {exc}")
    monkeypatch.delenv(NET_DEVICES_VAR, raising=False)
    before = listening_sockets()
    with make_unit(1 << 20, name="su-ucx") as unit, \
            nixl.NixlTransport().serve(unit, host="127.0.0.1", token=TOKEN) as srv:
        opened = listening_sockets() - before
        control = srv.address["control"]
        # the control lane and UCX's own listener(s), all on the configured address
        assert ("127.0.0.1", control["port"]) in opened and len(opened) >= 2, opened
        assert {host for host, _ in opened} == {"127.0.0.1"}, opened
