"""The tcp backend over real loopback sockets, served by a real StorageUnit."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time

import numpy as np
import pytest

from gputq import transport
from gputq.errors import (
    CapacityError,
    ClosedError,
    DuplicateKeyError,
    GputqError,
    GputqTimeoutError,
    InvalidInputError,
    MissingDependencyError,
    PeerLostError,
    RequestTooLargeError,
    StaleReadError,
    UnitBusyError,
    UnknownKeyError,
)
from gputq.transport.handler import ServerLimits
from gputq.transport.staging import StagingPool, cuda_available
from gputq.transport.tcp import TcpChannel, TcpTransport
from gputq.transport.tcp_pool import Connection, ConnectionPool
from gputq.transport.wire import FrameReader, FrameWriter, Op, encode_header, pack_body
from tests.transport.test_wire import frame
from tests.transport.units import ContractUnit, hung_control, make_unit
from tests.waiting import wait_until

TOKEN = "t0ken-for-the-tcp-tests"
MAX = 32 << 20
LIMITS = ServerLimits(max_frame_bytes=MAX)
MiB = 1 << 20


class Gathering:
    """Holds each caller of ``with gathering:`` until ``parties`` of them are inside at once, or ``timeout``
    seconds pass; ``most`` is the most that were inside at once."""

    def __init__(self, parties: int, timeout: float):
        self._parties, self._timeout = parties, timeout
        self._changed = threading.Condition()
        self.inside = self.most = 0

    def __enter__(self):
        with self._changed:
            self.inside += 1
            self.most = max(self.most, self.inside)
            self._changed.notify_all()
            self._changed.wait_for(lambda: self.most >= self._parties, self._timeout)

    def __exit__(self, *exc):
        with self._changed:
            self.inside -= 1


class SlowUnit(ContractUnit):
    """A real unit plus a ``sleep`` control call, an optional delay in leases, and an optional
    :class:`Gathering` each lease passes through."""

    lease_delay = 0.0
    lease_gathering: Gathering | None = None

    def control(self, method, args=None):
        if method == "sleep":
            time.sleep(args["seconds"])
            return "slept"
        if method == "object":
            return {"bad": object()}
        return super().control(method, args)

    def lease_regions(self, keys, *args, **kwargs):
        with self.lease_gathering or contextlib.nullcontext():
            time.sleep(self.lease_delay)
        return super().lease_regions(keys, *args, **kwargs)


@pytest.fixture
def handler():
    with SlowUnit("su-tcp", 48 * MiB) as unit:
        yield unit


@pytest.fixture
def server(handler):
    with TcpTransport().serve(handler, token=TOKEN, limits=LIMITS) as srv:
        yield srv


@pytest.fixture
def channel(server):
    with TcpTransport().connect(server.address, token=TOKEN, max_frame_bytes=MAX, timeout=5) as ch:
        yield ch


def random_bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_registry_and_address(server, handler):
    tcp = transport.get_transport("tcp")
    assert isinstance(tcp, TcpTransport) and tcp.name == "tcp"
    address = server.address
    assert set(address) == {"transport", "unit", "incarnation", "host", "port", "hostname"}
    assert address["transport"] == "tcp" and address["port"] > 0
    assert address["unit"] == "su-tcp" and address["incarnation"] == handler.incarnation
    with pytest.raises(InvalidInputError, match="unknown transport"):
        transport.get_transport("carrier-pigeon")
    try:
        rdma = transport.get_transport("rdma")
    except MissingDependencyError:
        pass  # gputq.transport.nixl or nixl itself not installed
    else:
        assert rdma.name == "rdma"
    assert set(transport.__all__) >= {"get_transport", "Channel", "Server", "Region", "TRANSPORTS"}


@pytest.mark.parametrize("nbytes", [0, 1, MiB, 20 * MiB])
def test_write_read_round_trip(channel, handler, nbytes):
    data = random_bytes(nbytes, nbytes)
    receipt = channel.write("k", data, {"field": "logprobs"})
    assert receipt["nbytes"] == nbytes and receipt["generation"] >= 1
    dest = np.full(nbytes + 16, 0xAB, np.uint8)
    assert channel.read(["k"], dest) == [nbytes]
    np.testing.assert_array_equal(dest[:nbytes], data)
    assert (dest[nbytes:] == 0xAB).all()  # nothing written past the read
    assert wait_until(lambda: handler.stats()["leases"] == 0)


def test_many_keys_back_to_back(channel):
    rng = np.random.default_rng(7)
    blobs = {f"key-{i}": random_bytes(int(rng.integers(0, 40_000)), i) for i in range(60)}
    for key, blob in blobs.items():
        channel.write(key, blob)
    order = list(blobs)[::-3] + list(blobs)[1:10]  # out of order, with repeats
    dest = np.zeros(sum(blobs[k].size for k in order), np.uint8)
    lengths = channel.read(order, memoryview(dest))
    assert lengths == [blobs[k].size for k in order]
    np.testing.assert_array_equal(dest, np.concatenate([blobs[k] for k in order]))


def test_typed_errors_cross_the_wire_and_connection_survives(channel, handler):
    channel.write("a", b"abc")
    with pytest.raises(UnknownKeyError, match="'missing'") as info:
        channel.read(["a", "missing"], bytearray(16))
    assert isinstance(info.value, KeyError)
    with pytest.raises(DuplicateKeyError, match="'a'"):
        channel.write("a", b"again")
    with pytest.raises(InvalidInputError, match="unknown control"):
        channel.call("no-such-method")
    with pytest.raises(InvalidInputError, match="unserialisable"):
        channel.call("object")
    assert channel.call("stats")["keys"] == 1
    assert channel.connections["requests_open"] == 1  # every error left the single connection in sync
    assert channel.connections["writes_open"] == 1
    assert wait_until(lambda: handler.stats()["leases"] == 0)


def test_call_passes_arguments(channel):
    channel.write("x", b"1")
    channel.write("y", b"22")
    with pytest.raises(UnknownKeyError, match="'nope'"):
        channel.call("release", keys=["x", "nope"])
    assert channel.call("release", keys=["x", "nope"], missing_ok=True) == 1
    assert channel.call("stats")["keys"] == 1


def test_pipelined_reads_hand_over_their_replies_in_order_in_chunks_of_one_buffer(channel, handler):
    blobs = {"a": random_bytes(300_000, 1), "b": random_bytes(17, 2), "c": random_bytes(65_536, 3)}
    for key, blob in blobs.items():
        channel.write(key, blob)
    spans = np.array([[0, 1000, 200_000], [1, 0, 17], [2, 16, 65_504], [0, 0, 64]], np.int64)
    reads = [(list(blobs), {"spans": spans}, [200_000, 17, 65_504, 64],
              np.concatenate([blobs["a"][1000:201_000], blobs["b"], blobs["c"][16:65_520], blobs["a"][:64]])),
             (["c"], {}, [65_536], blobs["c"]), (["b", "a"], {}, [17, 300_000], np.concatenate([blobs["b"], blobs["a"]]))]
    pipe = channel.pipeline()
    for keys, kwargs, _, _ in reads:  # all three sent before any reply is read
        pipe.send(keys, 10, **kwargs)
    assert pipe.pending == 3
    buffers = set()
    for chunk, (_, _, lengths, want) in zip((16, 64 << 10, 1 << 20), reads):
        got = []

        def sink(offset, view):
            assert view.dtype == np.uint8 and view.nbytes == min(chunk, want.nbytes - offset)
            got.append((offset, view.copy()))
            buffers.add(view.ctypes.data)

        assert pipe.receive(sink, 10, chunk_bytes=chunk) == lengths
        assert [offset for offset, _ in got] == list(range(0, want.nbytes, chunk))
        np.testing.assert_array_equal(np.concatenate([view for _, view in got]), want)
    assert pipe.pending == 0 and len(buffers) == 3  # the connection's one buffer, resized per chunk size
    pipe.close()
    pipe.close()
    assert channel.connections["pipelines_open"] == 1  # handed back in sync: the next pipeline reuses it
    assert channel.read(["b"], bytearray(17)) == [17]
    assert wait_until(lambda: handler.stats()["leases"] == 0)


def test_a_reply_is_cut_at_its_breaks_as_well_as_every_chunk_bytes(channel):
    blob = random_bytes(100_000, 4)
    channel.write("k", blob)
    pipe = channel.pipeline()
    for bad in ([0], [32, 32], [48, 16], [40], [16.0]):
        with pytest.raises(InvalidInputError, match="increasing positive multiples of 16"):
            pipe.receive(lambda offset, view: None, chunk_bytes=64 << 10, breaks=bad)
    pipe.send(["k"], 10)
    got = []
    # A chunk ends at 1,024 and at 40,000, then every 32 KiB from there; a break past the payload changes nothing.
    assert pipe.receive(lambda offset, view: got.append((offset, view.copy())), 10, chunk_bytes=32 << 10,
                        breaks=[1024, 40_000, 200_000]) == [100_000]
    assert [(offset, view.nbytes) for offset, view in got] == [(0, 1024), (1024, 32768), (33792, 6208),
                                                              (40_000, 32768), (72_768, 27_232)]
    np.testing.assert_array_equal(np.concatenate([view for _, view in got]), blob)
    pipe.close()


def test_a_typed_error_stays_with_its_read_and_a_failure_mid_reply_drops_every_read_in_flight(channel):
    channel.write("k", random_bytes(1 << 20))
    pipe = channel.pipeline()
    for bad in (0, 8, 100):
        with pytest.raises(InvalidInputError, match="multiple of 16"):
            pipe.receive(lambda offset, view: None, chunk_bytes=bad)
    with pytest.raises(ClosedError, match="no read"):
        pipe.receive(lambda offset, view: None, chunk_bytes=64 << 10)
    for keys in (["k"], ["nope"], ["k"], ["k"]):
        pipe.send(keys, 10)
    whole = []
    pipe.receive(lambda offset, view: whole.append(view.copy()), 10, chunk_bytes=64 << 10)
    np.testing.assert_array_equal(np.concatenate(whole), random_bytes(1 << 20))
    with pytest.raises(UnknownKeyError, match="'nope'"):  # the unit's answer to that read only
        pipe.receive(lambda offset, view: None, 10, chunk_bytes=64 << 10)
    assert pipe.pending == 2

    def failing(offset, view):
        if offset:
            raise RuntimeError("consumer failed")

    with pytest.raises(RuntimeError, match="consumer failed"):
        pipe.receive(failing, 10, chunk_bytes=64 << 10)
    # Mid-reply: dropped, with the read behind it.
    assert pipe.pending == 0 and channel.connections["pipelines_open"] == 0
    with pytest.raises(ClosedError, match="no read"):
        pipe.receive(lambda offset, view: None, 10, chunk_bytes=64 << 10)
    pipe.send(["k"], 10)  # a new connection
    assert pipe.receive(lambda offset, view: None, 10, chunk_bytes=64 << 10) == [1 << 20]
    pipe.send(["k"], 10)
    pipe.close()  # a reply pending: the connection goes too
    assert channel.connections["pipelines_open"] == 0


def test_pipelines_hold_connections_of_their_own_and_a_request_kept_waiting_is_busy_not_lost(server, handler):
    """A pipeline holds its connection until it closes (a stream's, for the stream's life), so pipelines take
    connections outside the lane's cap: three of them with replies pending leave a channel of one pooled
    connection free for calls. A request that then waits its whole timeout behind another caller's gets
    UnitBusyError (nothing was sent: the unit is not implicated). Pipelines once took the lane's connections,
    and the next request waited for one and raised a bare timeout, which takes the unit for lost."""
    channel = TcpChannel(server.address, token=TOKEN, max_frame_bytes=MAX, timeout=5, max_connections=1)
    with channel:
        channel.write("k", random_bytes(4096, 5))
        pipes = [channel.pipeline() for _ in range(3)]
        for pipe in pipes:
            pipe.send(["k"], 5)
        assert channel.call("stats", timeout=5)["keys"] == 1
        answered = threading.Event()
        caller = threading.Thread(target=lambda: channel.call("stats", timeout=10) and answered.set())
        with hung_control(handler):
            caller.start()
            assert wait_until(lambda: channel.connections["requests_busy"] == 1,
                              what="the caller's request in flight")
            started = time.monotonic()
            with pytest.raises(UnitBusyError, match=r"unit su-tcp: all 1 connections .* in use for 0.3 s") as info:
                channel.call("stats", timeout=0.3)
            assert 0.25 <= time.monotonic() - started < 5.0  # its own timeout, not the hung call's 10 s
            assert isinstance(info.value, TimeoutError) and not isinstance(info.value, ConnectionError)
        caller.join(10)
        assert answered.is_set()
        for pipe in pipes:
            got = []
            assert pipe.receive(lambda offset, view: got.append(view.copy()), 5, chunk_bytes=64 << 10) == [4096]
            np.testing.assert_array_equal(np.concatenate(got), random_bytes(4096, 5))
            pipe.close()
        assert channel.connections == {"requests_open": 1, "requests_busy": 0, "pipelines_open": 3,
                                       "pipelines_busy": 0, "writes_open": 1, "writes_busy": 0}
        again = channel.pipeline()  # an idle pipeline connection is reused
        again.send(["k"], 5)
        assert again.receive(lambda offset, view: None, 5, chunk_bytes=64 << 10) == [4096]
        again.close()
        assert channel.connections["pipelines_open"] == 3


def test_closing_a_pool_ends_a_handshake_under_way_as_closed_not_busy_and_not_at_its_timeout():
    """A unit whose process is stopped still has its connections accepted (by its kernel) and never answers
    HELLO. A request connecting to it when its channel closes (the unit was marked lost by another request's
    timeout) fails then with ClosedError: not at its own timeout, which made a hung unit cost a caller two
    timeouts, and not as the UnitBusyError a connection cut before its HELLO reply reads as (a unit at its cap)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        address = listener.getsockname()
        pool = ConnectionPool(lambda timeout, watch: Connection(address, "su-mute", TOKEN, MAX, timeout, watch), 1,
                              "su-mute")
        outcome: dict = {}

        def request():
            started = time.monotonic()
            try:
                with pool.checkout(10, 10):
                    pass
            except GputqError as exc:
                outcome["error"] = exc
            outcome["seconds"] = time.monotonic() - started

        caller = threading.Thread(target=request)
        caller.start()
        listener.settimeout(10)
        accepted, _ = listener.accept()
        with accepted:
            assert FrameReader(accepted, MAX).read_frame()[0].opcode == Op.HELLO  # the caller awaits the reply
            assert pool.counts == (1, 0)
            pool.close()
            caller.join(10)
        assert isinstance(outcome["error"], ClosedError), repr(outcome["error"])
        assert "closed while connecting" in str(outcome["error"]) and outcome["seconds"] < 5
        with pytest.raises(ClosedError):
            with pool.checkout(1, 1):
                pass


@pytest.mark.parametrize("closed", ["before its handshake", "after its handshake"])
def test_a_connection_made_as_its_pool_closes_is_closed_not_lent(server, closed):
    """The channel closed just before a new connection's handshake (to a unit that would never answer it),
    or just as it completed: the request fails at once with ClosedError, and nothing goes out on a channel
    whose unit was marked lost."""
    def connect(timeout, watch):
        if closed == "before its handshake":
            pool.close()
            return Connection(mute.getsockname(), "su-tcp", TOKEN, MAX, timeout, watch)
        conn = Connection((server.address["host"], server.address["port"]), "su-tcp", TOKEN, MAX, timeout, watch)
        pool.close()
        return conn

    pool = ConnectionPool(connect, 1, "su-tcp")
    with socket.create_server(("127.0.0.1", 0)) as mute:
        started = time.monotonic()
        with pytest.raises(ClosedError, match="closed"):
            with pool.checkout(5, 5):
                pytest.fail("a connection was lent from a closed pool")
    assert time.monotonic() - started < 4 and pool.counts == (0, 0)


def test_a_lost_unit_fails_every_pipelined_read_in_flight_as_lost(handler):
    with TcpTransport().serve(handler, token=TOKEN, limits=LIMITS) as server, \
            TcpTransport().connect(server.address, token=TOKEN, max_frame_bytes=MAX, timeout=5) as channel:
        channel.write("k", random_bytes(24 << 20))  # more than the socket buffers hold: the unit is mid-send
        pipe = channel.pipeline()
        for _ in range(3):
            pipe.send(["k"], 10)
        first = []

        def stop_the_unit(offset, view):
            first.append(offset)
            if offset == 0:
                server.close()

        with pytest.raises(PeerLostError, match="unit su-tcp: read of keys"):
            pipe.receive(stop_the_unit, 10, chunk_bytes=64 << 10)
        for _ in range(2):  # the reads behind it went with the connection: the same failure, not a hang
            with pytest.raises(PeerLostError, match="in flight on that connection"):
                pipe.receive(lambda offset, view: None, 10, chunk_bytes=64 << 10)


@contextlib.contextmanager
def _unit_that_stalls_mid_reply(sent: int, promised: int):
    """A peer that answers HELLO on each of its first two connections (a channel's, then its pipeline's), then
    a READ on either with a header promising ``promised`` bytes, sends ``sent`` and stops (alive, connection
    open) until the block ends."""
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def answer(conn):
        with conn, contextlib.suppress(GputqTimeoutError, PeerLostError, OSError):
            reader = FrameReader(conn, MAX)
            reader.read_frame()
            conn.sendall(frame(Op.OK, {"unit": "su-stalls", "incarnation": ""}))
            reader.read_frame()
            conn.sendall(frame(Op.OK, {"lengths": [promised]}, bytes(sent), payload_len=promised))
            done.wait(30)

    def serve():
        with contextlib.suppress(OSError):  # the listener closed before a second connection came
            for _ in range(2):
                threading.Thread(target=answer, args=(listener.accept()[0],), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield {"transport": "tcp", "host": "127.0.0.1", "port": listener.getsockname()[1]}
    finally:
        done.set()
        listener.close()
        thread.join(10)


def test_a_pipelined_reply_that_stalls_mid_payload_times_out_at_its_deadline():
    with _unit_that_stalls_mid_reply(sent=100_000, promised=1 << 20) as address, \
            TcpTransport().connect(address, token=TOKEN, max_frame_bytes=MAX, timeout=5) as channel:
        pipe = channel.pipeline()
        pipe.send(["k"], 5)
        landed = []
        started = time.monotonic()
        with pytest.raises(GputqTimeoutError, match="su-stalls"):
            pipe.receive(lambda offset, view: landed.append(view.nbytes), 0.4, chunk_bytes=16 << 10)
        waited = time.monotonic() - started
        assert 0.35 <= waited < 0.4 * 1.1 + 0.2, waited  # the deadline, give or take a tenth (and scheduling)
        assert sum(landed) == 100_000 // (16 << 10) * (16 << 10)  # whole chunks of what came, then the wait
        assert pipe.pending == 0 and channel.connections["pipelines_open"] == 0  # dropped mid-reply


def test_dest_too_small_keeps_connection_in_sync(channel):
    channel.write("k", random_bytes(1000))
    with pytest.raises(RequestTooLargeError, match="1000 bytes"):
        channel.read(["k"], bytearray(999))
    dest = bytearray(1000)
    assert channel.read(["k"], dest) == [1000]
    assert bytes(dest) == random_bytes(1000).tobytes()
    assert channel.connections["requests_open"] == 1


def test_size_limits(server, channel):
    with pytest.raises(RequestTooLargeError, match="max_frame_bytes"):
        channel.write("huge", np.zeros(MAX + 1, np.uint8))
    # A client allowing more than the server is cut off by the server only.
    with TcpTransport().connect(server.address, token=TOKEN, max_frame_bytes=2 * MAX, timeout=5) as big:
        big.write("a", np.zeros(20 * MiB, np.uint8))
        big.write("b", np.zeros(20 * MiB, np.uint8))
        with pytest.raises(RequestTooLargeError, match="split it"):
            big.read(["a", "b"], np.empty(40 * MiB, np.uint8))
        with pytest.raises(ConnectionError):
            big.write("c", np.zeros(MAX + 1, np.uint8))
        assert big.call("stats")["keys"] == 2  # a fresh connection replaced the one cut off


def test_read_rejects_read_only_dest(channel):
    channel.write("k", b"abc")
    with pytest.raises(InvalidInputError, match="read-only"):
        channel.read(["k"], b"xxx")


def test_timeout_discards_connection_and_recovers(channel, handler):
    with hung_control(handler, methods=("stats",)):
        start = time.monotonic()
        with pytest.raises(GputqTimeoutError):
            channel.call("stats", timeout=0.15)
        assert time.monotonic() - start < 0.5  # its own timeout, not the hung call's (until this block ends)
        assert channel.connections["requests_open"] == 0  # the connection mid-reply was dropped
        assert channel.call("sleep", timeout=5, seconds=0.0) == "slept"


def test_write_back_pressure_expires_as_capacity_error():
    with make_unit(1024) as small, TcpTransport().serve(small, token=TOKEN, limits=LIMITS) as srv, \
            TcpTransport().connect(srv.address, token=TOKEN, max_frame_bytes=MAX, timeout=5) as ch:
        ch.write("a", bytes(800))
        with pytest.raises(CapacityError, match="no space") as info:
            ch.write("b", bytes(300), timeout=0.2)
        assert isinstance(info.value, TimeoutError)
        releaser = threading.Timer(0.2, lambda: ch.call("release", keys=["a"]))
        releaser.start()
        assert ch.write("b", bytes(300), timeout=5)["nbytes"] == 300  # waited for the release
        releaser.join()


def test_concurrent_reads_run_in_parallel(channel, handler):
    """Four reads from four threads are served at once: each one's lease takes 0.3 s, then waits until all four
    are under way (up to 5 s, which reads served one after another would each spend)."""
    blobs = {f"t{i}": random_bytes(2 * MiB + i, i) for i in range(4)}
    for key, blob in blobs.items():
        channel.write(key, blob)
    handler.lease_delay = 0.3
    handler.lease_gathering = Gathering(len(blobs), timeout=5)
    errors, results = [], {}

    def reader(key):
        try:
            dest = np.empty(blobs[key].size, np.uint8)
            channel.read([key], dest, timeout=10)
            results[key] = dest
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(k,)) for k in blobs]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    elapsed = time.monotonic() - start
    assert not errors
    for key, blob in blobs.items():
        np.testing.assert_array_equal(results[key], blob)
    assert elapsed < 1.0, f"4 reads with a 0.3 s lease each took {elapsed:.2f} s: not parallel"
    assert handler.lease_gathering.most == len(blobs), "the reads were not leased at once"
    assert channel.connections["requests_open"] == 4


def test_close_is_idempotent_and_use_after_close_fails(server):
    ch = TcpTransport().connect(server.address, token=TOKEN, max_frame_bytes=MAX, timeout=5)
    ch.write("k", b"v")
    ch.close()
    ch.close()
    with pytest.raises(ClosedError):
        ch.read(["k"], bytearray(1))
    with pytest.raises(ClosedError):
        ch.call("stats")
    server.close()
    server.close()


def test_server_close_while_connected_raises_peer_lost(handler):
    srv = TcpTransport().serve(handler, token=TOKEN, limits=LIMITS)
    with TcpTransport().connect(srv.address, token=TOKEN, max_frame_bytes=MAX, timeout=5) as ch:
        ch.write("k", b"v")
        srv.close()
        with pytest.raises(PeerLostError, match=r"unit su-tcp: read of keys \['k'\]") as info:
            ch.read(["k"], bytearray(1), timeout=5)
        assert info.value.unit == "su-tcp" and info.value.keys == ("k",)
        with pytest.raises(PeerLostError, match="unit su-tcp"):  # reconnecting fails too: nobody listens
            ch.call("stats", timeout=5)


def test_connect_to_nothing_raises_peer_lost(server):
    address = dict(server.address)
    server.close()
    with pytest.raises(PeerLostError, match="cannot connect to unit su-tcp at"):
        TcpTransport().connect(address, token=TOKEN, max_frame_bytes=MAX, timeout=5)
    with pytest.raises(InvalidInputError, match="not a tcp address"):
        TcpTransport().connect({"transport": "rdma"}, token=TOKEN, max_frame_bytes=MAX)


# ------------------------------------------------------------------ staging ring

class FakeDeviceBuffer:
    """A host array posing as CUDA memory, to drive the staging ring on CPU."""

    def __init__(self, nbytes: int):
        self.host = np.zeros(nbytes, np.uint8)
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "strides": None,
                                         "data": (self.host.ctypes.data, False), "version": 3}


class HostCopier:
    """Copier whose "device copy" is a host copy; records the order of events."""

    def __init__(self, dest, nchunks, chunk_bytes):
        self.slots = [memoryview(bytearray(chunk_bytes)) for _ in range(nchunks)]
        self.log: list[tuple] = []
        HostCopier.last = self

    def target(self, dest):
        self.dest = dest.host

    def wait(self, slot):
        self.log.append(("wait", slot))

    def copy_async(self, slot, offset, nbytes):
        self.dest[offset:offset + nbytes] = np.frombuffer(self.slots[slot][:nbytes], np.uint8)
        self.log.append(("copy", slot, offset, nbytes))

    def synchronize(self):
        self.log.append(("sync",))


def test_staging_ring_chunks_into_device_offsets(server, channel):
    blobs = [random_bytes(n, n) for n in (2500, 1, 0, 4096)]
    for i, blob in enumerate(blobs):
        channel.write(f"g{i}", blob)
    staging = StagingPool(chunk_bytes=1000, nchunks=3, make_copier=HostCopier)
    with TcpChannel(server.address, token=TOKEN, max_frame_bytes=MAX, timeout=5, staging=staging) as ch:
        dest = FakeDeviceBuffer(8000)
        assert ch.read([f"g{i}" for i in range(4)], dest) == [2500, 1, 0, 4096]
        np.testing.assert_array_equal(dest.host[:6597], np.concatenate(blobs))
        assert (dest.host[6597:] == 0).all()
        log = HostCopier.last.log
        copies = [e for e in log if e[0] == "copy"]
        assert [c[1:] for c in copies[:4]] == [(0, 0, 1000), (1, 1000, 1000), (2, 2000, 1000), (0, 3000, 1000)]
        assert copies[-1][2:] == (6000, 597) and log[-1] == ("sync",)
        # each slot is waited on before being refilled
        assert log.index(("wait", 0), 2) < log.index(("copy", 0, 3000, 1000))
        with pytest.raises(RequestTooLargeError):
            ch.read(["g3"], FakeDeviceBuffer(4095))


def _cuda_zeros(library: str, nbytes: int):
    """A zeroed CUDA uint8 buffer and a function copying it back to numpy; skips without a device."""
    if library == "cupy":
        try:
            import cupy
            if cupy.cuda.runtime.getDeviceCount() < 1:
                raise RuntimeError("no device")
        except Exception as exc:
            pytest.skip(f"CuPy cannot use a CUDA device: {exc}")
        return cupy.zeros(nbytes, cupy.uint8), cupy.asnumpy
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    return torch.zeros(nbytes, dtype=torch.uint8, device="cuda"), lambda t: t.cpu().numpy()


@pytest.mark.gpu
@pytest.mark.parametrize("library", ["cupy", "torch"])
def test_read_into_gpu_buffer(channel, library):
    if not cuda_available():
        pytest.skip("no usable CUDA device (CuPy and torch see none)")
    sizes = [20 * MiB + 3, 1, 0, 5 * MiB]
    blobs = [random_bytes(n, i) for i, n in enumerate(sizes)]
    keys = [f"gpu{i}" for i in range(len(sizes))]
    for key, blob in zip(keys, blobs):
        channel.write(key, blob)
    expected = np.concatenate(blobs)
    dest, to_numpy = _cuda_zeros(library, expected.size + 5)
    assert channel.read(keys, dest) == sizes
    got = to_numpy(dest)
    np.testing.assert_array_equal(got[:expected.size], expected)
    assert (got[expected.size:] == 0).all()
    # the staging ring is reused: a second read with another layout is exact too
    dest, to_numpy = _cuda_zeros(library, sizes[3])
    assert channel.read(keys[3:], dest) == sizes[3:]
    np.testing.assert_array_equal(to_numpy(dest), blobs[3])
    with pytest.raises(RequestTooLargeError):
        channel.read(keys[:1], _cuda_zeros(library, 10)[0])


def test_oversized_control_body_is_refused_before_sending(channel, handler):
    keys = [f"rollout-0/session-{i:06d}/step-0000/routed_experts-padding" for i in range(25_000)]
    with pytest.raises(RequestTooLargeError, match="split the request"):
        channel.read(keys, np.empty(16, np.uint8))
    channel.write("after", b"still in sync", {})  # the connection was never desynchronised
    dest = np.empty(13, np.uint8)
    assert channel.read(["after"], dest) == [13] and dest.tobytes() == b"still in sync"


def test_transient_accept_error_does_not_stop_the_server(server):
    class FlakyListener:
        """Fails one accept() as a full file table would, then behaves."""

        def __init__(self, real):
            self.real, self.failed = real, False

        def accept(self):
            if not self.failed:
                self.failed = True
                raise OSError(24, "Too many open files")
            return self.real.accept()

        def __getattr__(self, name):
            return getattr(self.real, name)

    server._listener = FlakyListener(server._listener)
    with TcpTransport().connect(server.address, token=TOKEN, max_frame_bytes=MAX, timeout=5) as ch:
        assert ch.call("stats")["keys"] == 0
    assert server._listener.failed  # the pending connection was accepted on the next round


# ------------------------------------------------------------------ references, leases, generic calls

def test_read_checks_generations_and_incarnation(channel, handler):
    receipt = channel.write("k", b"first")
    assert channel.incarnation == handler.incarnation and channel.unit == "su-tcp"
    dest = bytearray(5)
    gen = receipt["generation"]
    assert channel.read(["k"], dest, generations=[gen], incarnation=handler.incarnation) == [5]
    assert dest == b"first"
    assert channel.read(["k"], dest, generations=[0]) == [5]  # 0: not checked
    with pytest.raises(StaleReadError, match="restarted"):
        channel.read(["k"], dest, incarnation="0123456789abcdef")
    channel.call("release", keys=["k"])
    channel.write("k", b"again")  # the same key, rewritten: a new generation
    with pytest.raises(StaleReadError, match="'k'"):
        channel.read(["k"], dest, generations=[gen])
    with pytest.raises(InvalidInputError, match="generations for"):
        channel.read(["k"], dest, generations=[1, 2])
    assert wait_until(lambda: handler.stats()["leases"] == 0) and channel.connections["requests_open"] == 1


def test_generic_one_sided_calls(channel, handler):
    channel.write("a", b"abc")
    channel.write("b", b"defgh")
    lease = channel.call("lease", keys=["a", "b"])
    regions = np.frombuffer(lease["regions"], "<i8").reshape(2, 2)
    assert regions[:, 1].tolist() == [3, 5]
    arena = np.frombuffer(handler.arena, np.uint8)
    assert arena[regions[1, 0]:regions[1, 0] + 5].tobytes() == b"defgh"
    assert handler.stats()["leases"] == 1
    assert channel.call("end_lease", lease_ids=[lease["lease_id"]]) == {"held": [True]}
    assert channel.call("end_lease", lease_ids=[lease["lease_id"]]) == {"held": [False]}  # idempotent
    second = channel.call("lease", keys=["a"], end=[])
    third = channel.call("lease", keys=["b"], end=[second["lease_id"]])  # ends the second first
    assert channel.call("end_lease", lease_ids=[second["lease_id"], third["lease_id"]]) == {"held": [False, True]}
    assert channel.call("arena_file") == {"path": handler.arena_path, "nbytes": handler.arena.nbytes,
                                          "directory": handler.directory_file}
    assert handler.stats()["leases"] == 0


def authenticated(address: dict):
    """A raw, authenticated socket with its frame reader and writer (HELLO reply consumed)."""
    sock = socket.create_connection((address["host"], address["port"]), timeout=5)
    reader, writer = FrameReader(sock, MAX), FrameWriter(sock)
    writer.send(Op.HELLO, {"token": TOKEN})
    header, body = reader.read_frame()
    assert header.opcode == Op.OK and body["unit"] == "su-tcp"
    return sock, reader, writer


MALFORMED = {  # (opcode, body, payload) -> the typed error; the connection stays usable
    "read-keys-not-list": (Op.READ, {"keys": "abc"}, b""),
    "read-unhashable-key": (Op.READ, {"keys": [["a"]]}, b""),
    "read-missing-keys": (Op.READ, {}, b""),
    "read-bad-generation": (Op.READ, {"keys": ["k"], "generations": ["x"]}, b""),
    "read-generations-length": (Op.READ, {"keys": ["k"], "generations": [1, 2]}, b""),
    "read-negative-generation": (Op.READ, {"keys": ["k"], "generations": [-1]}, b""),
    "read-incarnation-int": (Op.READ, {"keys": ["k"], "incarnation": 5}, b""),
    "read-huge-list": (Op.READ, {"keys": ["k"] * 70_000}, b""),
    "write-key-int": (Op.WRITE, {"key": 5, "nbytes": 3}, b"abc"),
    "write-nbytes-mismatch": (Op.WRITE, {"key": "w", "nbytes": 4}, b"abc"),
    "write-nbytes-str": (Op.WRITE, {"key": "w", "nbytes": "3"}, b"abc"),
    "write-meta-list": (Op.WRITE, {"key": "w", "nbytes": 3, "meta": [1]}, b"abc"),
    "write-timeout-str": (Op.WRITE, {"key": "w", "nbytes": 3, "timeout": "soon"}, b"abc"),
    "call-method-int": (Op.CALL, {"method": 5}, b""),
    "call-args-list": (Op.CALL, {"method": "stats", "args": [1]}, b""),
    "call-unknown": (Op.CALL, {"method": "format_disk", "args": {}}, b""),
    "call-release-unhashable": (Op.CALL, {"method": "release", "args": {"keys": [["a"]]}}, b""),
    "call-release-int": (Op.CALL, {"method": "release", "args": {"keys": 5}}, b""),
    "call-release-extra-arg": (Op.CALL, {"method": "release", "args": {"keys": [], "nope": 1}}, b""),
    "call-lease-int-keys": (Op.CALL, {"method": "lease", "args": {"keys": [1]}}, b""),
    "call-lease-bad-end": (Op.CALL, {"method": "lease", "args": {"keys": ["k"], "end": "x"}}, b""),
    "call-end-lease-str": (Op.CALL, {"method": "end_lease", "args": {"lease_ids": "x"}}, b""),
    "call-end-lease-huge": (Op.CALL, {"method": "end_lease", "args": {"lease_ids": [1] * 70_000}}, b""),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_authenticated_requests_get_typed_errors(server, handler, case):
    handler.put("k", b"value")
    opcode, body, payload = MALFORMED[case]
    sock, reader, writer = authenticated(server.address)
    with sock:
        writer.send(opcode, body, (payload,) if payload else ())
        header, reply = reader.read_frame()
        assert header.opcode == Op.ERROR and reply["error"] == "InvalidInputError", reply
        writer.send(Op.READ, {"keys": ["k"]})  # the connection is still usable and in sync
        header, reply = reader.read_frame()
        got = bytearray(header.payload_len)
        reader.recv_exact(got)
        assert header.opcode == Op.OK and reply == {"lengths": [5]} and got == b"value"
    assert wait_until(lambda: handler.stats()["leases"] == 0) and handler.stats()["reserved"] == 0


def test_undecodable_authenticated_body_closes_cleanly(server, handler):
    sock, reader, writer = authenticated(server.address)
    with sock:
        raw = b"\xc1"  # never valid msgpack
        sock.sendall(bytes.fromhex("475054510103000000000001") + bytes(8) + raw)
        header, reply = reader.read_frame()
        assert header.opcode == Op.ERROR and reply["error"] == "ProtocolError"
        assert sock.recv(16) == b""  # then the server closed
    with TcpTransport().connect(server.address, token=TOKEN, max_frame_bytes=MAX, timeout=5) as ch:
        assert ch.call("stats")["keys"] == 0


# ------------------------------------------------------------------ a writer that stalls mid-payload

@pytest.mark.timeout(60)
def test_writer_stalled_past_its_reservation_is_cut_off_and_its_late_bytes_land_nowhere(caplog):
    """The region of a stalled write expires and goes to another key; the writer's late bytes must not."""
    caplog.set_level(logging.WARNING, logger="gputq.transport.tcp_connection")
    reservation, nbytes = 1.0, 64 << 10
    stale, fresh = np.full(nbytes, 0xAA, np.uint8), random_bytes(nbytes, 7)
    with make_unit(4 * nbytes, name="su-tcp", reservation_timeout_s=reservation) as unit, \
            TcpTransport().serve(unit, token=TOKEN, limits=LIMITS) as srv:
        sock, _, _ = authenticated(srv.address)
        with sock:
            body = pack_body({"key": "stalled", "nbytes": nbytes, "meta": {}, "timeout": None})
            sock.sendall(encode_header(Op.WRITE, len(body), nbytes) + body + stale[:nbytes // 2].tobytes())
            started = time.monotonic()
            sock.settimeout(10)
            try:  # the writer stalls here; the server must hang up within the reservation
                hung_up = sock.recv(1) == b""
            except ConnectionResetError:
                hung_up = True
            assert hung_up and time.monotonic() - started < reservation
            wait_until(lambda: srv.connections == 0, what="the stalled connection is closed")
            stats = unit.stats()  # aborted by the server while it held, not expired by the timer
            assert (stats["reserved"], stats["used"], stats["reservations_expired"]) == (0, 0, 0)
            with TcpTransport().connect(srv.address, token=TOKEN, max_frame_bytes=MAX, timeout=5) as ch:
                assert ch.write("fresh", fresh)["offset"] == 0  # the stalled write's region
                with contextlib.suppress(OSError):  # the writer wakes up and sends the rest
                    sock.sendall(stale[nbytes // 2:].tobytes())
                dest = np.empty(nbytes, np.uint8)
                assert ch.read(["fresh"], dest) == [nbytes]
                np.testing.assert_array_equal(dest, fresh)
                with pytest.raises(UnknownKeyError, match="'stalled'"):
                    ch.read(["stalled"], dest)
    logged = [r.getMessage() for r in caplog.records if "'stalled'" in r.getMessage()]
    assert len(logged) == 1 and f"not received within {reservation / 2:g} s" in logged[0], logged


# ------------------------------------------------------------------ writers blocked on space do not starve reads

@pytest.mark.timeout(60)
def test_reads_and_releases_do_not_wait_behind_blocked_writers():
    chunk = 256 << 10
    nwriters = 12  # more than a lane's connections: some wait for a write connection too
    with make_unit(4 * chunk, name="su-full") as unit, \
            TcpTransport().serve(unit, token=TOKEN, limits=LIMITS) as srv, \
            TcpTransport().connect(srv.address, token=TOKEN, max_frame_bytes=MAX, timeout=5) as ch:
        blobs = {f"w{i}": random_bytes(chunk, i) for i in range(4 + nwriters)}
        names = list(blobs)
        for key in names[:4]:
            ch.write(key, blobs[key])  # the unit is full
        errors: list[Exception] = []

        def put(key):
            try:
                ch.write(key, blobs[key], timeout=30)
            except Exception as exc:  # reported below
                errors.append(exc)

        writers = [threading.Thread(target=put, args=(k,)) for k in names[4:]]
        for t in writers:
            t.start()
        assert wait_until(lambda: unit.stats()["writers_waiting"] >= 8)
        # The writers wait up to 30 s for space that only this release frees: a read or a release queued
        # behind them would time out at its 5 s.
        start = time.monotonic()
        dest = np.empty(chunk, np.uint8)
        assert ch.read([names[0]], dest, timeout=5) == [chunk]
        assert ch.call("release", keys=[names[0]], timeout=5) == 1
        elapsed = time.monotonic() - start
        np.testing.assert_array_equal(dest, blobs[names[0]])
        assert elapsed < 1.0, f"a read and a release behind blocked writers took {elapsed:.2f} s"
        # Drain the overload: read each stored key bit-exact, then release it, until every writer landed.
        done = {names[0]}

        def consume_stored() -> bool:
            assert not errors, errors
            for key in [k for k in names if k not in done and _stored(unit, k)]:
                assert ch.read([key], dest, timeout=5) == [chunk]
                np.testing.assert_array_equal(dest, blobs[key])
                assert ch.call("release", keys=[key], timeout=5) == 1
                done.add(key)
            return len(done) == len(names)

        wait_until(consume_stored, 40, "every blocked writer landed and was consumed")
        for t in writers:
            t.join(10)
        assert not errors
        assert unit.stats()["keys"] == 0 and unit.stats()["capacity_errors"] == 0


def _stored(unit, key: str) -> bool:
    try:
        unit.lookup([key])
    except UnknownKeyError:
        return False
    return True


def test_transport_failures_name_the_unit_and_the_keys(server, handler, channel):
    channel.write("k", b"v")
    handler.lease_delay = 0.5
    with pytest.raises(GputqTimeoutError, match=r"unit su-tcp: read of keys \['k'\]") as info:
        channel.read(["k"], bytearray(1), timeout=0.1)
    assert (info.value.unit, info.value.keys) == ("su-tcp", ("k",))
    handler.lease_delay = 0.0
    server.close()
    with pytest.raises(PeerLostError, match="unit su-tcp: write of key 'w'"):
        channel.write("w", b"x", timeout=5)
    with pytest.raises(PeerLostError, match="unit su-tcp: control call 'stats'"):
        channel.call("stats", timeout=5)
