"""The rdma backend through the real NIXL/UCX stack, server and channel in one process.

On one host UCX picks cross-memory attach (or its tcp lane); both are real
one-sided transfers through NIXL, so these tests exercise the same code path
as an InfiniBand cluster, minus the NIC.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading

import numpy as np
import pytest

from gputq.errors import (
    AuthenticationError,
    ClosedError,
    GputqTimeoutError,
    InvalidInputError,
    MissingDependencyError,
    PeerLostError,
    ProtocolError,
    RequestTooLargeError,
    StaleReadError,
    TransferError,
    UnknownKeyError,
)
from gputq.transport import nixl_push
from gputq.transport.handler import ArenaHandler, ServerLimits
from gputq.transport.nixl_transfer import Transfers, descriptors
from tests.transport.units import ContractUnit, make_unit
from tests.waiting import pause, wait_until

pytestmark = [pytest.mark.rdma, pytest.mark.timeout(60)]

TOKEN = "test-token-of-the-nixl-tests"
MAX_FRAME = 1 << 30
LIMITS = ServerLimits(max_frame_bytes=MAX_FRAME)


def _nixl_or_skip():
    nixl = pytest.importorskip("gputq.transport.nixl", reason="gputq.transport.nixl does not import")
    try:
        nixl.import_nixl()
    except MissingDependencyError as exc:
        pytest.skip(f"nixl does not import: {exc}")
    return nixl


class RacingUnit(ContractUnit):
    """A real unit that counts leases and runs ``on_lease`` right after granting one (the read's race window)."""

    on_lease = None
    leases = 0

    def lease_regions(self, keys, *args, **kwargs):
        granted = super().lease_regions(keys, *args, **kwargs)
        self.leases += 1
        if self.on_lease is not None:
            hook, self.on_lease = self.on_lease, None
            hook()
        return granted


@pytest.fixture
def handler():
    with RacingUnit("unit-nixl", 8 << 20) as unit:
        yield unit


@pytest.fixture
def server(handler):
    nixl = _nixl_or_skip()
    try:
        srv = nixl.NixlTransport().serve(handler, token=TOKEN, limits=LIMITS)
    except MissingDependencyError as exc:
        pytest.skip(f"no NIXL agent here: {exc}")
    except RuntimeError as exc:  # NIXL raises RuntimeError when no plugin loads
        pytest.skip(f"cannot create a NIXL agent here: {exc}")
    yield srv
    srv.close()


def _connect(server, write_path="tcp"):
    nixl = _nixl_or_skip()
    return nixl.NixlTransport(write_path).connect(server.address, token=TOKEN, max_frame_bytes=MAX_FRAME,
                                                  timeout=10)


def _store(channel, items: dict) -> None:
    for key, value in items.items():
        receipt = channel.write(key, value, {"field": "test"})
        assert receipt["nbytes"] == value.nbytes


def _payloads(n: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 20_000, size=n)
    sizes[3] = 0  # an empty blob is a legal key
    return {f"k{i}": rng.integers(0, 256, size=int(s), dtype=np.uint8) for i, s in enumerate(sizes)}


def test_many_regions_in_one_read_are_bit_exact(server, handler):
    items = _payloads(200)
    with _connect(server) as ch:
        _store(ch, items)
        order = list(items)[::-1] + ["k7", "k7"]  # any order, repeats allowed
        expected = np.concatenate([items[k] for k in order])
        dest = np.full(expected.size + 100, 0xEE, dtype=np.uint8)
        leases_before = handler.leases
        lengths = ch.read(order, dest, timeout=10)
        # covered by its deadline, the lease is ended in the background
        wait_until(lambda: handler.stats()["leases"] == 0, 5, "the read's lease to end")
    assert lengths == [items[k].nbytes for k in order]
    assert np.array_equal(dest[:expected.size], expected)
    assert (dest[expected.size:] == 0xEE).all()  # nothing written past the keys
    assert handler.leases == leases_before + 1  # one lease, one READ


def test_address_carries_what_auto_and_tcp_need_and_no_secret(server, handler):
    address = server.address
    assert set(address) == {"transport", "unit", "incarnation", "control", "hostname", "ib_devices"}
    assert address["transport"] == "rdma" and address["unit"] == "unit-nixl"
    assert address["incarnation"] == handler.incarnation and address["hostname"]
    assert set(address["control"]) == {"transport", "unit", "incarnation", "host", "port", "hostname"}
    assert not any(isinstance(v, bytes) for v in (*address.values(), *address["control"].values()))
    with _connect(server) as ch:
        info = ch.call("nixl_connect")
        assert isinstance(info["agent_metadata"], bytes) and info["arena_nbytes"] == handler.arena.nbytes
        assert (ch.unit, ch.incarnation) == ("unit-nixl", handler.incarnation)
    assert info["agent_metadata"] not in repr(address).encode()


def test_unknown_key_is_typed_and_ends_nothing_open(server, handler):
    with _connect(server) as ch:
        ch.write("present", np.ones(10, np.uint8), {})
        with pytest.raises(UnknownKeyError, match="missing"):
            ch.read(["present", "missing"], np.zeros(100, np.uint8))
    assert handler.stats()["leases"] == 0


def test_small_dest_raises_and_ends_the_lease(server, handler):
    with _connect(server) as ch:
        ch.write("a", np.ones(1000, np.uint8), {})
        with pytest.raises(RequestTooLargeError):
            ch.read(["a"], np.zeros(999, np.uint8))
        assert handler.stats()["leases"] == 0


def test_pool_is_reused_and_grows_geometrically(server):
    items = _payloads(20, seed=1)
    with _connect(server) as ch:
        _store(ch, items)
        before = ch.pool.registrations  # the pool is process-wide: count from here
        dest = np.zeros(1 << 20, np.uint8)
        ch.read(list(items), dest)
        assert ch.pool.registrations == before + 1
        for _ in range(3):
            ch.read(list(items), dest)
        assert ch.pool.registrations == before + 1  # nothing registered per request
        big = np.arange(3 << 20, dtype=np.uint64).view(np.uint8)[: 3 << 20]
        ch.write("big", big, {})
        out = np.zeros(big.size, np.uint8)
        ch.read(["big"], out)
        ch.read(["big"], out)
        assert np.array_equal(out, big)
        assert ch.pool.registrations == before + 2  # grew once, to a power of two >= 3 MiB
        assert ch.copies == 6  # plain numpy destinations: one copy per read


def test_lenders_finding_their_size_all_lent_out_take_that_size_and_only_a_larger_read_doubles(server):
    """Concurrent streams and fetches of one process lend from one pool: each such lender got twice the
    largest buffer before, so eight concurrent 1 MiB lends registered 255 MiB (eight ranks' streams in one
    process reached 32 GiB and a MemoryError)."""
    with _connect(server) as ch:
        pool = ch.pool
        pool.trim()  # the pool is process-wide: no free buffer left by earlier tests
        with contextlib.ExitStack() as lent:
            before, registrations = pool.registered_bytes, pool.registrations
            for _ in range(8):
                lent.enter_context(pool.lend(1 << 20))
            assert pool.registered_bytes - before == 8 << 20
            lent.enter_context(pool.lend(3 << 20))  # larger than every buffer: twice the largest, or more
            assert pool.registered_bytes - before == 12 << 20
            assert pool.registrations == registrations + 9
        with pool.lend(1 << 20), pool.lend(2 << 20):  # reused: the smallest free ones that fit
            assert pool.registrations == registrations + 9


def test_read_into_staging_view_is_direct(server):
    items = _payloads(10, seed=2)
    expected = np.concatenate(list(items.values()))
    with _connect(server) as ch:
        _store(ch, items)
        with ch.staging(expected.size) as view:
            registrations = ch.pool.registrations
            ch.read(list(items), view)
            assert np.array_equal(view, expected)
            assert ch.pool.registrations == registrations


def test_read_racing_release_never_returns_another_keys_bytes(server, handler):
    victim = np.full(64 << 10, 0xAA, dtype=np.uint8)
    intruder = np.full(64 << 10, 0x55, dtype=np.uint8)
    with _connect(server) as ch:
        ch.write("victim", victim, {})
        victim_offset = handler.lookup(["victim"])[0]["offset"]

        def release_and_reuse():
            # Inside the read's window: release the leased key, then write a
            # new key of the same size into whatever space is free.
            assert handler.release(["victim"]) == 1
            offset = handler.begin_write("intruder", intruder.nbytes, {}, timeout=1)
            handler.arena[offset:offset + intruder.nbytes] = intruder.tobytes()
            handler.commit_write("intruder")

        handler.on_lease = release_and_reuse
        out = np.zeros(victim.size, np.uint8)
        try:
            ch.read(["victim"], out, timeout=10)
        except (UnknownKeyError, StaleReadError):
            pass  # a typed failure is acceptable; wrong bytes are not
        else:
            assert np.array_equal(out, victim)
        assert handler.lookup(["intruder"])[0]["offset"] != victim_offset  # the lease kept the region
        with pytest.raises(UnknownKeyError):
            ch.read(["victim"], out)
        ch.read(["intruder"], out)
        assert np.array_equal(out, intruder)
    assert handler.stats()["leases"] == 0  # the read ended its lease
    assert handler.stats()["used"] == intruder.nbytes  # and the victim's bytes were freed then


def test_transfer_failure_names_unit_and_keys(server, handler):
    with _connect(server) as ch:
        ch.write("x", np.ones(4096, np.uint8), {})
        ch._transfers.remote_base += 1 << 44  # a remote address nothing is registered at
        with pytest.raises(TransferError) as info:
            ch.read(["x"], np.zeros(4096, np.uint8), timeout=10)
    assert info.value.unit == "unit-nixl" and info.value.keys == ("x",)
    assert "unit-nixl" in str(info.value) and "'x'" in str(info.value)
    assert handler.stats()["leases"] == 0


def test_push_write_path_round_trips(server, handler, monkeypatch):
    _nixl_or_skip()
    monkeypatch.setattr(nixl_push, "PUSH_CHUNK_BYTES", 4096)  # several chunks per blob
    items = _payloads(5, seed=3)
    with _connect(server, write_path="push") as ch:
        before = ch.pool.registrations
        _store(ch, items)
        assert ch.pool.registrations == before + 1  # one bounded staging buffer for every push
        out = np.zeros(sum(v.nbytes for v in items.values()), np.uint8)
        ch.read(list(items), out)
    assert np.array_equal(out, np.concatenate(list(items.values())))
    assert handler.stats()["puts"] == len(items)


def test_push_slower_than_half_the_reservation_is_abandoned_while_it_holds(monkeypatch):
    """The unit cannot stop a granted WRITE: the client must, before the region can go to another key."""
    nixl = _nixl_or_skip()
    monkeypatch.setattr(nixl_push, "PUSH_CHUNK_BYTES", 64 << 10)  # four chunks
    payload = np.random.default_rng(5).integers(0, 256, 256 << 10, dtype=np.uint8)
    with make_unit(1 << 20, name="unit-push", reservation_timeout_s=1.0) as unit, \
            nixl.NixlTransport().serve(unit, token=TOKEN, limits=LIMITS) as srv, \
            _connect(srv, write_path="push") as ch:
        transfer, chunks = Transfers.run, []

        def slow_first_chunk(self, *args, **kwargs):
            chunks.append(args[2][0].tolist())
            if len(chunks) == 1:
                pause(0.6)  # the writer is descheduled past half the reservation
            return transfer(self, *args, **kwargs)

        monkeypatch.setattr(Transfers, "run", slow_first_chunk)
        with pytest.raises(GputqTimeoutError, match=r"unit unit-push: push of key 'slow' .* within 0.5 s of its "
                                                    r"reservation's request \(half the unit's reservation\): "
                                                    r".*timed out.*; write aborted"):
            ch.write("slow", payload, {}, timeout=30)
        assert len(chunks) == 1  # no chunk started past the window
        stats = unit.stats()  # aborted by the writer while the reservation held, not expired
        assert (stats["reserved"], stats["used"], stats["reservations_expired"]) == (0, 0, 0)
        monkeypatch.setattr(Transfers, "run", transfer)
        assert ch.write("slow", payload, {}, timeout=30)["nbytes"] == payload.nbytes  # a retry lands


def test_push_committed_after_the_reservation_expired_is_refused_with_a_typed_error(monkeypatch):
    nixl = _nixl_or_skip()
    payload = np.full(2 << 20, 0x5A, np.uint8)
    with make_unit(4 << 20, name="unit-late", reservation_timeout_s=0.3) as unit, \
            nixl.NixlTransport().serve(unit, token=TOKEN, limits=LIMITS) as srv, \
            _connect(srv, write_path="push") as ch:
        push = nixl_push.Pushes._push_reserved

        def descheduled_before_commit(*args, **kwargs):
            push(*args, **kwargs)
            wait_until(lambda: unit.stats()["reservations_expired"] == 1, 10, "the reservation expires")

        monkeypatch.setattr(nixl_push.Pushes, "_push_reserved", descheduled_before_commit)
        with pytest.raises(UnknownKeyError, match="unit-late: no write in progress for key 'late'.*expired"):
            ch.write("late", payload, {}, timeout=30)
        assert (unit.stats()["used"], unit.stats()["keys"]) == (0, 0)
        monkeypatch.setattr(nixl_push.Pushes, "_push_reserved", push)
        assert ch.write("late", payload, {}, timeout=30)["nbytes"] == payload.nbytes


def test_auto_write_path_pushes_only_large_payloads(server):
    _nixl_or_skip()
    small = np.full(1000, 7, np.uint8)
    large = np.arange(nixl_push.PUSH_MIN_BYTES + 3, dtype=np.uint64).astype(np.uint8)
    with _connect(server, write_path="auto") as ch:
        before = ch.pool.registrations
        ch.write("small", small, {})
        assert ch.pool.registrations == before  # the tcp path registers nothing
        ch.write("large", large, {})
        assert ch.pool.registrations == before + 1
        out = np.zeros(small.size + large.size, np.uint8)
        assert ch.read(["small", "large"], out) == [small.size, large.size]
    assert np.array_equal(out, np.concatenate([small, large]))


class _FakeDeviceArray:
    """Host memory posing as a CUDA buffer: exercises the device plumbing without a GPU."""

    def __init__(self, host: np.ndarray):
        self.host = host
        self.device = type("Device", (), {"id": 0})()
        self.__cuda_array_interface__ = {"shape": (host.size,), "typestr": "|u1",
                                         "data": (host.ctypes.data, False), "version": 3}


class _HostCuda:
    """Stands in for the CUDA helper: no device memory, copies with memmove."""

    def __init__(self):
        self.copies = []

    def alloc(self, nbytes, device):
        raise RuntimeError("no device memory in this test")

    def copy(self, dst, src, nbytes, device, src_host):
        import ctypes
        ctypes.memmove(dst, src, nbytes)
        self.copies.append((nbytes, device, src_host))


def test_device_destination_falls_back_to_host_staging(server, monkeypatch):
    fake_cuda = _HostCuda()
    items = _payloads(12, seed=5)
    expected = np.concatenate(list(items.values()))
    dest = _FakeDeviceArray(np.zeros(expected.size + 8, np.uint8))
    with _connect(server) as ch:
        monkeypatch.setattr(ch.pool, "_cuda", fake_cuda)  # restored after the test: the pool outlives it
        _store(ch, items)
        assert ch.read(list(items), dest) == [v.nbytes for v in items.values()]
        ch.read(list(items), dest)
    assert np.array_equal(dest.host[:expected.size], expected)
    assert fake_cuda.copies == [(expected.size, 0, True)] * 2  # host pool -> device, once per read


def test_channels_share_the_remote_agent(server):
    data = np.arange(1000, dtype=np.uint32).view(np.uint8)
    first, second = _connect(server), _connect(server)
    first.write("d", data, {})
    first.close()  # must not drop the remote agent the second channel uses
    out = np.zeros(data.size, np.uint8)
    assert second.read(["d"], out) == [data.nbytes]
    assert np.array_equal(out, data)
    second.close()


def test_concurrent_reads_on_one_channel(server):
    items = _payloads(30, seed=4)
    expected = np.concatenate(list(items.values()))
    errors = []
    with _connect(server) as ch:
        _store(ch, items)

        def reader():
            out = np.zeros(expected.size, np.uint8)
            for _ in range(5):
                ch.read(list(items), out)
                if not np.array_equal(out, expected):
                    errors.append("mismatch")

        threads = [threading.Thread(target=reader) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []


def test_close_is_idempotent_and_final(server):
    ch = _connect(server)
    assert ch.read([], np.zeros(1, np.uint8)) == []
    ch.close()
    ch.close()
    with pytest.raises(ClosedError):
        ch.read(["a"], np.zeros(1, np.uint8))
    server.close()
    server.close()


def test_rejects_a_tcp_address(server):
    nixl = _nixl_or_skip()
    with pytest.raises(InvalidInputError):
        nixl.NixlTransport().connect(server.address["control"], token=TOKEN, max_frame_bytes=MAX_FRAME)
    with pytest.raises(InvalidInputError):
        nixl.NixlTransport(write_path="carrier-pigeon")


def test_write_path_from_environment(monkeypatch):
    nixl = _nixl_or_skip()
    monkeypatch.setenv(nixl_push.WRITE_PATH_ENV, "TCP")
    assert nixl.NixlTransport().write_path == "tcp"
    monkeypatch.delenv(nixl_push.WRITE_PATH_ENV)
    assert nixl.NixlTransport().write_path == "auto"
    assert nixl.NixlTransport("push").write_path == "push"


def _cuda_array_module():
    from gputq.transport.staging import cuda_available

    if not cuda_available():
        pytest.skip("no CUDA device (CuPy or CUDA torch)")
    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
        return "cupy", cupy
    except Exception:
        import torch

        return "torch", torch


@pytest.mark.gpu
def test_read_into_cuda_memory(server):
    kind, lib = _cuda_array_module()
    items = _payloads(40, seed=6)
    expected = np.concatenate(list(items.values()))

    def to_host(arr):
        return lib.asnumpy(arr) if kind == "cupy" else arr.cpu().numpy()

    if kind == "cupy":
        dest = lib.zeros(expected.size + 16, dtype=lib.uint8)
    else:
        dest = lib.zeros(expected.size + 16, dtype=lib.uint8, device="cuda:0")
    with _connect(server) as ch:
        _store(ch, items)
        assert ch.read(list(items), dest) == [v.nbytes for v in items.values()]
        assert np.array_equal(to_host(dest)[:expected.size], expected)
        registrations = ch.pool.registrations
        dest[:] = 0
        ch.read(list(items), dest)  # second read: same pool buffer, no registration
        assert np.array_equal(to_host(dest)[:expected.size], expected)
        assert ch.pool.registrations == registrations
        with ch.staging(expected.size, device=0) as view:  # device memory from the pool
            ch.read(list(items), view)
            assert np.array_equal(to_host(view), expected)


# -- process-wide destination pool -------------------------------------------------------

@pytest.fixture
def second_server():
    nixl = _nixl_or_skip()
    with make_unit(4 << 20, name="unit-nixl-2") as unit, \
            nixl.NixlTransport().serve(unit, token=TOKEN, limits=LIMITS) as srv:
        yield srv


def _two_units(server, second_server, seed: int):
    """Two channels, each unit holding its own keys; returns (channels, keys, expected bytes)."""
    first, second = _connect(server), _connect(second_server)
    items = [_payloads(15, seed=seed), {f"u2-{k}": v for k, v in _payloads(9, seed=seed + 1).items()}]
    _store(first, items[0])
    _store(second, items[1])
    return (first, second), [list(i) for i in items], [np.concatenate(list(i.values())) for i in items]


def test_destination_takes_several_units_reads_without_copy(server, second_server):
    nixl = _nixl_or_skip()
    channels, keys, expected = _two_units(server, second_server, seed=7)
    split = expected[0].size
    try:
        pool = nixl.local_pool()
        with nixl.NixlTransport().destination(split + expected[1].size) as buf:
            assert isinstance(buf, np.ndarray) and buf.dtype == np.uint8 and buf.shape == (split + expected[1].size,)
            registrations = pool.registrations
            assert channels[0].read(keys[0], buf[:split]) == [len(v) for v in _payloads(15, seed=7).values()]
            channels[1].read(keys[1], buf[split:])
            assert np.array_equal(buf[:split], expected[0])
            assert np.array_equal(buf[split:], expected[1])
        assert pool.registrations == registrations  # the READs registered nothing
        assert [ch.copies for ch in channels] == [0, 0]  # and copied nothing
    finally:
        for ch in channels:
            ch.close()


def test_a_channel_dropped_unclosed_counts_as_closed_and_the_pool_still_frees_its_idle_buffers(server):
    """The pool frees its idle buffers when the process's last open channel closes. A channel collected
    unclosed (clients dropped without close) once counted as open for ever: no later close freed them."""
    nixl = _nixl_or_skip()
    transport, pool = nixl.NixlTransport(), nixl.local_pool()
    dropped = _connect(server)
    dropped.read([], np.zeros(0, np.uint8))
    del dropped
    gc.collect()
    with _connect(server):
        with transport.destination(3 << 20):
            pass
        before = pool.registrations
    with _connect(server):  # the last open channel closed: the idle 4 MiB buffer went
        with transport.destination(3 << 20):
            pass
        assert pool.registrations == before + 1


def test_destination_reuses_pool_buffers_and_grows_by_doubling(server):
    nixl = _nixl_or_skip()
    transport = nixl.NixlTransport()
    with _connect(server):  # an open channel keeps the pool's idle buffers
        pool = nixl.local_pool()
        with transport.destination(3 << 20) as first:
            address = first.ctypes.data
        before = pool.registrations
        for nbytes in (3 << 20, 100, 0):
            with transport.destination(nbytes) as again:
                assert again.size == nbytes and again.ctypes.data == address  # the same registered buffer
        assert pool.registrations == before
        with transport.destination(5 << 20) as bigger:
            assert bigger.size == 5 << 20
        assert pool.registrations == before + 1  # one new buffer: 8 MiB, twice the largest
        with transport.destination(1 << 20), transport.destination(1 << 20) as other:
            assert other.size == 1 << 20  # two lent at once: two distinct buffers
        with pytest.raises(InvalidInputError):
            with transport.destination(-1):
                pass


def test_destination_reads_from_four_threads(server, second_server):
    nixl = _nixl_or_skip()
    channels, keys, expected = _two_units(server, second_server, seed=11)
    layout = [(channels[i % 2], keys[i % 2], expected[i % 2]) for i in range(4)]
    starts = np.cumsum([0] + [e.size for _, _, e in layout])
    errors = []
    try:
        with nixl.NixlTransport().destination(int(starts[-1])) as buf:
            registrations = nixl.local_pool().registrations

            def reader(i):
                channel, ks, want = layout[i]
                view = buf[starts[i]:starts[i + 1]]
                for _ in range(10):
                    view[:] = 0
                    channel.read(ks, view, timeout=10)
                    if not np.array_equal(view, want):
                        errors.append(i)

            threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert nixl.local_pool().registrations == registrations
        assert errors == []
        assert [ch.copies for ch in channels] == [0, 0]
    finally:
        for ch in channels:
            ch.close()


def test_base_transport_destination_is_plain_memory():
    from gputq.transport.tcp import TcpTransport

    with TcpTransport().destination(12) as buf:
        assert isinstance(buf, np.ndarray) and buf.dtype == np.uint8 and buf.shape == (12,)
        buf[:] = 1  # writable


class NoRegionsUnit(ContractUnit):
    """A handler on :meth:`ArenaHandler.lease_regions`' default: leases come as Region objects."""

    lease_regions = ArenaHandler.lease_regions


def test_server_serves_a_handler_on_the_default_lease_regions():
    nixl = _nixl_or_skip()
    items = _payloads(8, seed=13)
    with NoRegionsUnit("unit-regions", 1 << 20) as unit, \
            nixl.NixlTransport().serve(unit, token=TOKEN, limits=LIMITS) as srv, _connect(srv) as ch:
        _store(ch, items)
        out = np.zeros(sum(v.nbytes for v in items.values()), np.uint8)
        assert ch.read(list(items), out) == [v.nbytes for v in items.values()]
        wait_until(lambda: unit.stats()["leases"] == 0, 5, "the read's lease to end")
    assert np.array_equal(out, np.concatenate(list(items.values())))


def test_descriptors_merge_adjacent_regions_and_drop_empty_ones():
    regions = np.array([[0, 0], [100, 10], [110, 0], [110, 6], [500, 5], [0, 0]], dtype=np.int64)
    local, remote = descriptors(regions, 1000, 1 << 20, 3)
    assert local.tolist() == [[1000, 16, 3], [1016, 5, 3]]
    assert remote.tolist() == [[(1 << 20) + 100, 16, 0], [(1 << 20) + 500, 5, 0]]
    local, remote = descriptors(np.array([[64, 8], [72, 8]], dtype=np.int64), 0, 0, 0)
    assert local.tolist() == [[0, 16, 0]] and remote.tolist() == [[64, 16, 0]]
    local, _ = descriptors(np.array([[5, 0]], dtype=np.int64), 0, 0, 0)
    assert local.shape == (0, 3)


# The pool's page-locking (no NIXL needed) is tested in tests/transport/test_host_register.py.


# -- security and integrity ----------------------------------------------------------------

def test_peer_with_membership_but_no_token_gets_nothing(server, handler, caplog):
    """The address (what membership hands out) reaches neither the NIXL metadata nor a byte of the arena."""
    import socket

    from gputq.transport.wire import FrameReader, FrameWriter, Op

    nixl = _nixl_or_skip()
    caplog.set_level(logging.DEBUG)
    with _connect(server) as ch:
        ch.write("secret", np.full(4096, 0x5A, np.uint8), {})
        metadata = ch.call("nixl_connect")["agent_metadata"]
    address = server.address
    assert metadata not in repr(address).encode() and b"agent" not in repr(address).encode()
    before = bytes(handler.arena)
    reads_before = handler.stats()["reads"]
    with pytest.raises(AuthenticationError):
        nixl.NixlTransport().connect(address, token="a-guess-of-the-token", max_frame_bytes=MAX_FRAME, timeout=5)
    control = address["control"]
    for first in ({"token": "wrong"}, None):  # a wrong token; no HELLO at all
        with socket.create_connection((control["host"], control["port"]), timeout=5) as sock:
            reader, writer = FrameReader(sock, MAX_FRAME), FrameWriter(sock)
            if first is not None:
                writer.send(Op.HELLO, first)
            else:
                writer.send(Op.CALL, {"method": "nixl_connect", "args": {}})
            header, body = reader.read_frame()
            assert header.opcode == Op.ERROR and body["error"] == "AuthenticationError"
            assert sock.recv(1 << 16) == b""  # closed: nothing more is answered
    assert bytes(handler.arena) == before and handler.stats()["reads"] == reads_before
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert repr(metadata) not in logged and "agent_metadata" not in logged


def test_lease_expired_before_the_confirm_raises_stale_read():
    """The reader stalls between lease and READ past the unit's lease timeout; the region is reused meanwhile."""
    nixl = _nixl_or_skip()
    victim = np.full(64 << 10, 0xAA, np.uint8)
    intruder = np.full(64 << 10, 0x55, np.uint8)
    with make_unit(1 << 20, name="unit-slow", lease_timeout_s=0.2) as unit, \
            nixl.NixlTransport().serve(unit, token=TOKEN, limits=LIMITS) as srv, _connect(srv) as ch:
        ch.write("victim", victim, {})
        offset = unit.lookup(["victim"])[0]["offset"]
        read_leased = ch._read_leased

        def stalled(*args, **kwargs):
            # The reader is descheduled until the unit's timer has expired its lease.
            wait_until(lambda: unit.stats()["leases_expired"] == 1, 10, "the reader's lease expires")
            assert unit.release(["victim"]) == 1
            unit.put("intruder", intruder)
            assert unit.lookup(["intruder"])[0]["offset"] == offset  # the region was reused
            return read_leased(*args, **kwargs)

        ch._read_leased = stalled
        with nixl.NixlTransport().destination(victim.size) as dest:
            with pytest.raises(StaleReadError, match="unit-slow.*expired"):
                ch.read(["victim"], dest, timeout=10)
            assert np.array_equal(dest, intruder)  # what landed was another key's: only the confirm caught it
        assert unit.stats()["leases"] == 0


def test_leased_regions_outside_the_arena_are_refused_before_any_read(handler, monkeypatch):
    nixl = _nixl_or_skip()

    class Lying(ContractUnit):
        def lease_regions(self, keys, *args, **kwargs):
            lease_id, regions = super().lease_regions(keys, *args, **kwargs)
            regions = regions.copy()
            regions[0, 0] = self.arena.nbytes - 8  # runs past the arena's end
            return lease_id, regions

    with Lying("unit-lying", 1 << 20) as unit, \
            nixl.NixlTransport().serve(unit, token=TOKEN, limits=LIMITS) as srv, _connect(srv) as ch:
        ch.write("k", np.ones(4096, np.uint8), {})
        transfers = []
        monkeypatch.setattr(Transfers, "run", lambda *a, **k: transfers.append(a))
        with pytest.raises(ProtocolError, match="unit-lying.*outside"):
            ch.read(["k"], np.zeros(4096, np.uint8), timeout=10)
        assert transfers == [] and unit.stats()["leases"] == 0


def test_progress_loop_failures_are_logged_at_a_limited_rate(server, caplog):
    caplog.set_level(logging.WARNING, logger="gputq.transport.nixl_server")
    calls = []

    def failing():
        calls.append(1)
        raise RuntimeError("UCX worker gone")

    server._agent.get_new_notifs = failing
    assert wait_until(lambda: len(calls) >= 20)
    logged = [r.getMessage() for r in caplog.records if "progress" in r.getMessage()]
    assert len(logged) == 1 and "unit-nixl" in logged[0] and "UCX worker gone" in logged[0]


def test_a_lease_taken_ahead_is_read_with_no_second_lease_and_keeps_its_region(server, handler):
    """lease_ahead then read_leased: the READ pays no lease of its own, and a release racing it (after the
    lease, before the READ) cannot hand it another key's bytes: the lease pinned the region."""
    victim, intruder = np.full(64 << 10, 0xAA, np.uint8), np.full(64 << 10, 0x55, np.uint8)
    with _connect(server) as ch:
        assert ch.leases_ahead
        ch.write("victim", victim, {})
        generation = handler.lookup(["victim"])[0]["generation"]
        held = ch.lease_ahead(["victim"], timeout=10, generations=[generation])
        leases = handler.leases
        assert handler.release(["victim"]) == 1
        handler.put("intruder", intruder)
        out = np.zeros(victim.size, np.uint8)
        assert ch.read_leased(held, out, timeout=10) == [victim.size]
        assert np.array_equal(out, victim)
        assert handler.leases == leases and ch.leased_ahead == 1  # no lease of its own
        wait_until(lambda: handler.stats()["leases"] == 0, 10, "the lease is ended off the read's path")
        with pytest.raises(StaleReadError):  # the unit checks the generation when the lease is taken
            ch.lease_ahead(["intruder"], timeout=10, generations=[generation + 1000])


@pytest.mark.slow
def test_a_read_whose_units_process_died_under_its_lease_is_a_lost_peer():
    """The unit's process is killed between the lease (taken ahead) and its READ: NIXL reports the remote
    disconnected, which is a lost peer (``PeerLostError``, a ``ConnectionError``: the Reader marks the
    unit lost), not a failed transfer of a live unit; ``dest`` is not handed out as read."""
    from bench.faults import unit_processes

    nixl = _nixl_or_skip()
    with unit_processes(1, transport="rdma") as (config, units), \
            nixl.NixlTransport().connect(units["su-0"].address, token=config.token, max_frame_bytes=MAX_FRAME,
                                         timeout=10) as ch:
        ch.write("k", np.full(256 << 10, 7, np.uint8), {})
        held = ch.lease_ahead(["k"], timeout=10)
        units["su-0"].kill()
        with pytest.raises(PeerLostError, match="su-0") as info:
            ch.read_leased(held, np.zeros(256 << 10, np.uint8), timeout=10)
        assert not isinstance(info.value, TransferError) and isinstance(info.value, ConnectionError)


def test_a_lease_past_half_its_life_or_of_another_channel_is_taken_again(server, handler, monkeypatch):
    from gputq.transport import one_sided

    payload = np.arange(5000, dtype=np.uint8)
    with _connect(server) as ch, _connect(server) as other:
        ch.write("k", payload, {})
        held = ch.lease_ahead(["k"], timeout=10)
        out = np.zeros(payload.size, np.uint8)
        leases = handler.leases
        assert other.read_leased(held, out, timeout=10) == [payload.size]  # not its lease: it takes its own
        assert np.array_equal(out, payload) and handler.leases == leases + 1 and other.leased_ahead == 0
        monkeypatch.setattr(one_sided, "FRESH_FRACTION", 0.0)  # any lease is past its fresh part now
        out[:] = 0
        assert ch.read_leased(held, out, timeout=10) == [payload.size]
        assert np.array_equal(out, payload) and handler.leases == leases + 2 and ch.leased_ahead == 0
        held = ch.lease_ahead(["k"], timeout=10)
        ch.drop_lease(held)  # never read: ended off the caller's path
        wait_until(lambda: handler.stats()["leases"] == 0, 10, "every lease is ended")
        with pytest.raises(InvalidInputError):
            ch.lease_ahead([], timeout=10)


def test_closing_a_channel_drives_the_worker_after_dropping_its_units_agent(server, monkeypatch):
    """The reader's worker has no progress thread: a channel's close drives it after dropping the unit's agent,
    so the endpoints to the unit finish closing while it answers (an endpoint left half open is reconnected
    once the unit is gone, refused, and its teardown can abort the process)."""
    _nixl_or_skip()
    from gputq.transport import nixl_pool

    ch = _connect(server)
    agent = nixl_pool.LocalAgent.get().agent
    calls = []
    remove, progress = agent.remove_remote_agent, agent.get_new_notifs
    monkeypatch.setattr(agent, "remove_remote_agent", lambda name: (calls.append("remove"), remove(name))[1])
    monkeypatch.setattr(agent, "get_new_notifs", lambda: (calls.append("progress"), progress())[1])
    ch.write("k", np.ones(64, np.uint8), {})
    assert ch.read(["k"], np.zeros(64, np.uint8)) == [64]
    calls.clear()
    ch.close()
    assert calls[0] == "remove" and set(calls[1:]) == {"progress"}
