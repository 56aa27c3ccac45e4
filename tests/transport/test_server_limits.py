"""ServerLimits: the one set of server limits, its checks, and how a config's limits reach a unit's server."""

from __future__ import annotations

import dataclasses
import math
import socket
import time

import numpy as np
import pytest

from gputq.cluster.deploy import UnitService
from gputq.config import GputqConfig
from gputq.errors import (
    ConfigError,
    GputqTimeoutError,
    InvalidInputError,
    RequestTooLargeError,
    UnitBusyError,
)
from gputq.transport import get_transport
from gputq.transport.handler import ServerLimits
from gputq.transport.shm import ShmTransport
from gputq.transport.tcp import TcpTransport
from gputq.transport.wire import FrameReader, Op, error_from_wire
from tests.transport.units import make_unit

pytestmark = pytest.mark.timeout(60)

TOKEN = "token-of-the-server-limits-tests"
LIMIT_FIELDS = ("max_frame_bytes", "send_timeout_s", "max_connections", "handshake_timeout_s")


def test_the_defaults_are_the_documented_ones():
    limits = ServerLimits()
    assert dataclasses.astuple(limits) == (4 << 30, 60.0, 256, 5.0)
    assert tuple(f.name for f in dataclasses.fields(ServerLimits)) == LIMIT_FIELDS


def test_limits_are_a_frozen_value():
    limits = ServerLimits(max_connections=3)
    assert limits == ServerLimits(max_connections=3) and hash(limits) == hash(ServerLimits(max_connections=3))
    with pytest.raises(dataclasses.FrozenInstanceError):
        limits.max_connections = 4


def test_whole_seconds_are_kept_as_floats():
    limits = ServerLimits(send_timeout_s=2, handshake_timeout_s=1)
    assert (limits.send_timeout_s, limits.handshake_timeout_s) == (2.0, 1.0)
    assert type(limits.send_timeout_s) is float and type(limits.handshake_timeout_s) is float


@pytest.mark.parametrize("name, value", [
    ("max_frame_bytes", 0), ("max_frame_bytes", -1), ("max_frame_bytes", 1.5), ("max_frame_bytes", True),
    ("max_frame_bytes", "4096"), ("max_connections", 0), ("max_connections", 2.0), ("max_connections", None),
    ("send_timeout_s", 0), ("send_timeout_s", -1.0), ("send_timeout_s", math.nan), ("send_timeout_s", math.inf),
    ("send_timeout_s", True), ("send_timeout_s", "60"), ("handshake_timeout_s", 0.0),
    ("handshake_timeout_s", None),
])
def test_bad_limits_are_refused_naming_the_field(name, value):
    with pytest.raises(InvalidInputError, match=rf"^{name} must be .*, got {value!r}$".replace("(", r"\(")):
        ServerLimits(**{name: value})


def test_the_config_defaults_are_the_server_limits_defaults():
    config = GputqConfig()
    assert config.server_limits == ServerLimits()
    assert {name: getattr(config, name) for name in LIMIT_FIELDS} == dataclasses.asdict(ServerLimits())


def test_the_config_builds_its_server_limits_from_its_settings_of_the_same_names():
    config = GputqConfig.from_mapping({"max_frame_bytes": "65536", "send_timeout_s": "7.5",
                                       "max_connections": 3, "handshake_timeout_s": 0.25}, source="test")
    assert config.server_limits == ServerLimits(max_frame_bytes=65536, send_timeout_s=7.5, max_connections=3,
                                                handshake_timeout_s=0.25)
    assert config.to_dict()["max_connections"] == 3  # the settings keep their names


@pytest.mark.parametrize("var, raw, message", [
    ("GPUTQ_MAX_CONNECTIONS", "0", "max_connections must be an int >= 1, got 0"),
    ("GPUTQ_MAX_FRAME_BYTES", "-5", "max_frame_bytes must be an int >= 1, got -5"),
    ("GPUTQ_SEND_TIMEOUT_S", "inf", "send_timeout_s must be a finite number of seconds in (0, 604800], got inf"),
    ("GPUTQ_HANDSHAKE_TIMEOUT_S", "0", "handshake_timeout_s must be a finite number of seconds in (0, 604800], got 0.0"),
])
def test_a_bad_limit_setting_is_a_config_error_naming_its_source(var, raw, message):
    with pytest.raises(ConfigError) as caught:
        GputqConfig.load(env={var: raw})
    assert str(caught.value) == f"environment variable {var}={raw!r}: {message}"


@pytest.mark.parametrize("transport", [TcpTransport(), ShmTransport()])
def test_a_server_refuses_limits_that_are_not_server_limits(transport):
    with make_unit(1 << 16) as unit, pytest.raises(InvalidInputError, match="limits must be a ServerLimits"):
        transport.serve(unit, token=TOKEN, limits={"max_connections": 4})


def test_the_shm_backend_serves_with_the_limits_it_is_given():
    limits = ServerLimits(max_frame_bytes=1 << 20, send_timeout_s=3.0, max_connections=7, handshake_timeout_s=0.5)
    with make_unit(1 << 16) as unit, ShmTransport().serve(unit, token=TOKEN, limits=limits) as server:
        assert server.limits == limits


# -- a unit built from a config gets the config's limits -----------------------------------------

@pytest.fixture
def limited_unit(tmp_path):
    config = GputqConfig(transport="tcp", token=TOKEN, host="127.0.0.1", unit_capacity_bytes=1 << 20,
                         shm_dir=str(tmp_path), max_frame_bytes=64 << 10, max_connections=2,
                         handshake_timeout_s=1.5, send_timeout_s=10.0)
    with UnitService("su-limits", config) as service:
        yield config, service


def test_a_unit_service_serves_with_its_configs_frame_limit(limited_unit):
    config, service = limited_unit
    for key in ("a", "b"):
        service.unit.put(key, np.full(40 << 10, ord(key), np.uint8), {"partition": "p"})
    with get_transport("tcp").connect(service.address(), token=TOKEN, max_frame_bytes=1 << 20, timeout=5) as ch:
        dest = np.empty(80 << 10, np.uint8)
        with pytest.raises(RequestTooLargeError, match="81920 bytes, over max_frame_bytes=65536"):
            ch.read(["a", "b"], dest, timeout=5)
        assert ch.read(["a"], dest, timeout=5) == [40 << 10]  # under the limit, on the same connection
        assert (dest[:40 << 10] == ord("a")).all()


def test_a_unit_service_closes_a_silent_peer_after_its_configs_handshake_deadline(limited_unit):
    _, service = limited_unit
    address = service.address()
    with socket.create_connection((address["host"], address["port"]), timeout=10) as sock:
        start = time.monotonic()
        header, body = FrameReader(sock, 1 << 20).read_frame()
        waited = time.monotonic() - start
    assert header.opcode == Op.ERROR
    error = error_from_wire(body)
    assert isinstance(error, GputqTimeoutError) and "no valid HELLO within 1.5 s" in str(error)
    assert 1.0 < waited < 5.0


def test_a_unit_service_refuses_connections_over_its_configs_cap(limited_unit):
    _, service = limited_unit
    address = service.address()
    held = [get_transport("tcp").connect(address, token=TOKEN, max_frame_bytes=1 << 20, timeout=5)
            for _ in range(2)]  # authenticated: never closed for a newcomer
    try:
        with socket.create_connection((address["host"], address["port"]), timeout=10) as third:
            start = time.monotonic()
            header, body = FrameReader(third, 1 << 20).read_frame()
            # refused at once, with a reason: not by the 1.5 s handshake deadline ("no valid HELLO")
            assert time.monotonic() - start < 1.5
        assert header.opcode == Op.ERROR
        error = error_from_wire(body)
        assert isinstance(error, UnitBusyError) and "holds 2 connections (max_connections)" in str(error)
    finally:
        for ch in held:
            ch.close()
