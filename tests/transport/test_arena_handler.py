"""ArenaHandler is a declared interface: servers call exactly its members and serve nothing else."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from gputq.errors import InvalidInputError, UnknownKeyError
from gputq.transport.handler import ArenaHandler, Lease, Region, ServerLimits
from gputq.transport.nixl import NixlTransport
from gputq.transport.nixl_server import CONNECT, _NixlControl
from gputq.transport.shm import ShmTransport
from gputq.transport.tcp import TcpTransport, serve_connection
from gputq.unit.storage_unit import StorageUnit
from tests.transport.units import make_unit
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

TOKEN = "token-of-the-arena-handler-tests"
LIMITS = ServerLimits(max_frame_bytes=1 << 20)
#: Every member a server calls, as the interface declares them.
MEMBERS = {"name", "incarnation", "arena", "arena_path", "directory_file", "lease_timeout_s",
           "reservation_timeout_s", "begin_write", "commit_write", "abort_write", "lease", "end_lease", "control"}


class BytesHandler(ArenaHandler):
    """The smallest handler: a bytearray arena, keys laid out one after another, leases counted.

    Not a StorageUnit: it has no key directory and its leases and
    reservations never expire, which it says with ``None``.
    """

    def __init__(self, nbytes: int = 1 << 16, lease_timeout_s: float | None = None):
        self._bytes = bytearray(nbytes)
        self._lease_timeout_s = lease_timeout_s
        self._next = 0
        self._pending: dict = {}
        self._keys: dict = {}
        self._leases: dict = {}
        self.expires: list = []  # the ``expires`` of each lease, in order

    name = property(lambda self: "bytes-handler")
    incarnation = property(lambda self: "incarnation-1")
    arena = property(lambda self: memoryview(self._bytes))
    arena_path = property(lambda self: "/nonexistent/bytes-handler.arena")
    directory_file = property(lambda self: None)
    lease_timeout_s = property(lambda self: self._lease_timeout_s)
    reservation_timeout_s = property(lambda self: None)

    def begin_write(self, key, nbytes, meta, timeout):
        offset, self._next = self._next, self._next + nbytes
        self._pending[key] = Region(offset, nbytes)
        return offset

    def commit_write(self, key, generation=None):
        region = self._keys[key] = self._pending.pop(key)
        return {"offset": region.offset, "nbytes": region.nbytes, "generation": 1, "incarnation": self.incarnation}

    def abort_write(self, key, generation=None):
        self._pending.pop(key, None)

    def lease(self, keys, generations=None, incarnation=None, *, expires=True):
        missing = [k for k in keys if k not in self._keys]
        if missing:
            raise UnknownKeyError(f"no key {missing[0]!r}")
        self.expires.append(expires)
        lease_id = len(self.expires)
        self._leases[lease_id] = keys
        return Lease(lease_id, tuple(self._keys[k] for k in keys))

    def end_lease(self, lease_id):
        return self._leases.pop(lease_id, None) is not None

    def control(self, method, args):
        if method == "ping":
            return {"pong": args.get("n")}
        raise InvalidInputError(f"unknown control method {method!r}")


class Duck:
    """Every member of the interface, as plain attributes and methods, but not an ArenaHandler."""

    def __init__(self):
        self._handler = BytesHandler()

    def __getattr__(self, name):
        return getattr(self._handler, name)


def test_the_interface_declares_every_member_the_servers_call():
    assert ArenaHandler.__abstractmethods__ == MEMBERS
    assert issubclass(StorageUnit, ArenaHandler) and not StorageUnit.__abstractmethods__
    assert callable(ArenaHandler.lease_regions)  # declared with a default built on lease()


@pytest.mark.parametrize("missing", sorted(MEMBERS))
def test_a_handler_missing_a_member_cannot_be_made(missing):
    partial = type("Partial", (ArenaHandler,), {m: property(lambda self: None) for m in MEMBERS - {missing}})
    with pytest.raises(TypeError, match=f"abstract method.*{missing}"):
        partial()
    assert type("Whole", (ArenaHandler,), {m: property(lambda self: None) for m in MEMBERS})() is not None


@pytest.mark.parametrize("transport", [TcpTransport(), ShmTransport(), NixlTransport()], ids=["tcp", "shm", "rdma"])
def test_an_object_that_is_not_an_arena_handler_cannot_be_served(transport):
    # rdma checks before it loads NIXL, so this runs where NIXL is missing too
    with pytest.raises(InvalidInputError, match="Duck does not subclass gputq.transport.handler.ArenaHandler"):
        transport.serve(Duck(), token=TOKEN, limits=LIMITS)


def test_serve_connection_refuses_an_object_that_is_not_an_arena_handler():
    a, b = socket.socketpair()
    with a, b, pytest.raises(InvalidInputError, match="does not subclass"):
        serve_connection(a, Duck(), LIMITS)


def test_a_handler_that_is_not_a_storage_unit_is_served_through_the_interface_alone():
    handler = BytesHandler()
    with TcpTransport().serve(handler, token=TOKEN, limits=LIMITS) as server, \
            TcpTransport().connect(server.address, token=TOKEN, max_frame_bytes=1 << 20, timeout=5) as channel:
        assert server.address["incarnation"] == channel.incarnation == "incarnation-1"
        assert channel.unit == "bytes-handler"
        a, b = np.arange(100, dtype=np.uint8), np.full(30, 9, np.uint8)
        assert channel.write("a", a, {})["offset"] == 0
        assert channel.write("b", b, {})["offset"] == 100
        dest = np.zeros(130, np.uint8)
        assert channel.read(["a", "b"], dest, timeout=5) == [100, 30]
        assert np.array_equal(dest, np.concatenate([a, b]))
        assert handler.expires == [False]  # a server's own lease: it ends it itself, after sending
        wait_until(lambda: not handler._leases, 5, "the server to end its lease")

        # The one-sided readers' calls, on the default lease_regions.
        reply = channel.call("lease", keys=["b", "a"], timeout=5)
        assert handler.expires == [False, True] and "expires_in" not in reply  # leases never expire
        regions = np.frombuffer(reply["regions"], "<i8").reshape(2, 2).tolist()
        assert regions == [[100, 30], [0, 100]]
        assert channel.call("end_lease", lease_ids=[reply["lease_id"]], timeout=5) == {"held": [True]}
        assert channel.call("end_lease", lease_ids=[reply["lease_id"]], timeout=5) == {"held": [False]}
        arena_file = channel.call("arena_file", timeout=5)
        assert arena_file == {"path": "/nonexistent/bytes-handler.arena", "nbytes": 1 << 16}  # no directory
        assert channel.call("ping", n=3, timeout=5) == {"pong": 3}
        with pytest.raises(UnknownKeyError, match="no key 'c'"):
            channel.read(["c"], dest, timeout=5)


def test_a_handler_with_a_lease_lifetime_tells_one_sided_readers():
    with TcpTransport().serve(BytesHandler(lease_timeout_s=7), token=TOKEN, limits=LIMITS) as server, \
            TcpTransport().connect(server.address, token=TOKEN, max_frame_bytes=1 << 20, timeout=5) as channel:
        channel.write("a", np.ones(8, np.uint8), {})
        reply = channel.call("lease", keys=["a"], timeout=5)
        assert reply["expires_in"] == 7.0


def test_the_rdma_control_lane_forwards_every_member_to_its_handler():
    """_NixlControl implements the interface by forwarding (served over plain tcp: no NIXL needed)."""
    with make_unit(1 << 20, "su-control") as unit:
        control = _NixlControl(unit, {"agent_metadata": b"meta", "arena_base": 0})
        for member in ("name", "incarnation", "arena_path", "directory_file", "lease_timeout_s",
                       "reservation_timeout_s"):
            assert getattr(control, member) == getattr(unit, member), member
        assert control.arena.nbytes == unit.arena.nbytes
        with TcpTransport().serve(control, token=TOKEN, limits=LIMITS) as server, \
                TcpTransport().connect(server.address, token=TOKEN, max_frame_bytes=1 << 20, timeout=5) as channel:
            assert channel.incarnation == unit.incarnation and channel.unit == "su-control"
            assert channel.call(CONNECT, timeout=5) == {"agent_metadata": b"meta", "arena_base": 0}
            payload = np.arange(256, dtype=np.uint8)
            channel.write("k", payload, {"partition": "p"}, timeout=5)
            dest = np.zeros(256, np.uint8)
            assert channel.read(["k"], dest, timeout=5) == [256] and np.array_equal(dest, payload)
            wait_until(lambda: unit.stats()["leases"] == 0, 5, "the read's lease to end")
            reply = channel.call("lease", keys=["k"], timeout=5)
            assert reply["expires_in"] == unit.lease_timeout_s and unit.stats()["leases"] == 1
            assert channel.call("end_lease", lease_ids=[reply["lease_id"]], timeout=5) == {"held": [True]}
            assert channel.call("arena_file", timeout=5)["directory"] == unit.directory_file
            assert channel.call("stats", timeout=5)["keys"] == 1  # the unit's own control calls
