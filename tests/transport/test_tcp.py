"""The tcp backend over real loopback sockets, served by DictArenaHandler."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import transport
from tests.transport.fakes import DictArenaHandler
from transport.errors import (
    CapacityError,
    ClosedError,
    DuplicateKeyError,
    GputqTimeoutError,
    InvalidInputError,
    MissingDependencyError,
    PeerLostError,
    RequestTooLargeError,
    UnknownKeyError,
)
from transport.staging import StagingPool, cuda_available
from transport.tcp import TcpChannel, TcpTransport

TOKEN = "t0ken"
MAX = 32 << 20
MiB = 1 << 20


class SlowHandler(DictArenaHandler):
    """Adds a ``sleep`` control call and an optional delay in ``lease``."""

    lease_delay = 0.0

    def control(self, method, args):
        if method == "sleep":
            time.sleep(args["seconds"])
            return "slept"
        if method == "object":
            return {"bad": object()}
        return super().control(method, args)

    def lease(self, keys):
        time.sleep(self.lease_delay)
        return super().lease(keys)


@pytest.fixture
def handler():
    return SlowHandler(48 * MiB)


@pytest.fixture
def server(handler):
    with TcpTransport().serve(handler, token=TOKEN, max_frame_bytes=MAX) as srv:
        yield srv


@pytest.fixture
def channel(server):
    with TcpTransport().connect(server.address, token=TOKEN, max_frame_bytes=MAX, timeout=5) as ch:
        yield ch


def random_bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_registry_and_address(server):
    tcp = transport.get_transport("tcp")
    assert isinstance(tcp, TcpTransport) and tcp.name == "tcp"
    assert server.address["transport"] == "tcp" and server.address["port"] > 0
    with pytest.raises(InvalidInputError, match="unknown transport"):
        transport.get_transport("carrier-pigeon")
    try:
        rdma = transport.get_transport("rdma")
    except MissingDependencyError:
        pass  # transport.nixl or nixl itself not installed
    else:
        assert rdma.name == "rdma"
    assert set(transport.__all__) >= {"get_transport", "Channel", "UnknownKeyError", "error_from_wire"}


@pytest.mark.parametrize("nbytes", [0, 1, MiB, 20 * MiB])
def test_write_read_round_trip(channel, handler, nbytes):
    data = random_bytes(nbytes, nbytes)
    receipt = channel.write("k", data, {"field": "logprobs"})
    assert receipt["nbytes"] == nbytes and receipt["key"] == "k"
    dest = np.full(nbytes + 16, 0xAB, np.uint8)
    assert channel.read(["k"], dest) == [nbytes]
    np.testing.assert_array_equal(dest[:nbytes], data)
    assert (dest[nbytes:] == 0xAB).all()  # nothing written past the read
    assert handler.active_leases() == 0


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
    assert channel._nopen == 1  # every error left the single connection in sync
    assert handler.active_leases() == 0


def test_call_passes_arguments(channel):
    channel.write("x", b"1")
    channel.write("y", b"22")
    assert channel.call("release", keys=["x", "nope"]) == {"released": 1}
    assert channel.call("stats")["used"] == 2


def test_dest_too_small_keeps_connection_in_sync(channel):
    channel.write("k", random_bytes(1000))
    with pytest.raises(RequestTooLargeError, match="1000 bytes"):
        channel.read(["k"], bytearray(999))
    dest = bytearray(1000)
    assert channel.read(["k"], dest) == [1000]
    assert bytes(dest) == random_bytes(1000).tobytes()
    assert channel._nopen == 1


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


def test_timeout_discards_connection_and_recovers(channel):
    start = time.monotonic()
    with pytest.raises(GputqTimeoutError):
        channel.call("sleep", timeout=0.15, seconds=0.6)
    assert time.monotonic() - start < 0.5
    assert channel._nopen == 0  # the connection mid-reply was dropped
    assert channel.call("sleep", timeout=5, seconds=0.0) == "slept"


def test_write_back_pressure_expires_as_capacity_error(server):
    small = DictArenaHandler(1000)
    with TcpTransport().serve(small, token=TOKEN, max_frame_bytes=MAX) as srv, \
            TcpTransport().connect(srv.address, token=TOKEN, max_frame_bytes=MAX, timeout=5) as ch:
        ch.write("a", bytes(800))
        with pytest.raises(CapacityError, match="full") as info:
            ch.write("b", bytes(300), timeout=0.2)
        assert isinstance(info.value, TimeoutError)
        releaser = threading.Timer(0.2, lambda: ch.call("release", keys=["a"]))
        releaser.start()
        assert ch.write("b", bytes(300), timeout=5)["nbytes"] == 300  # waited for the release
        releaser.join()


def test_concurrent_reads_run_in_parallel(channel, handler):
    blobs = {f"t{i}": random_bytes(2 * MiB + i, i) for i in range(4)}
    for key, blob in blobs.items():
        channel.write(key, blob)
    handler.lease_delay = 0.3
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
    assert channel._nopen == 4


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
    srv = TcpTransport().serve(handler, token=TOKEN, max_frame_bytes=MAX)
    with TcpTransport().connect(srv.address, token=TOKEN, max_frame_bytes=MAX, timeout=5) as ch:
        ch.write("k", b"v")
        srv.close()
        with pytest.raises(PeerLostError):
            ch.read(["k"], bytearray(1), timeout=5)
        with pytest.raises(PeerLostError):  # reconnecting fails too: nobody listens
            ch.call("stats", timeout=5)


def test_connect_to_nothing_raises_peer_lost(server):
    address = dict(server.address)
    server.close()
    with pytest.raises(PeerLostError, match="cannot connect"):
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
    time.sleep(0.3)  # let the accept loop hit the failure
    assert server._listener.failed
    with TcpTransport().connect(server.address, token=TOKEN, max_frame_bytes=MAX, timeout=5) as ch:
        assert ch.call("stats")["keys"] == 0
