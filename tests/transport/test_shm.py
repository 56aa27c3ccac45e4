"""The shm backend: reads copied from a same-host unit's arena mapping (GPU cases skip without one)."""

from __future__ import annotations

import contextlib
import gc
import os
import stat
import threading

import numpy as np
import pytest

from gputq.errors import (
    ClosedError,
    GputqError,
    HintMissedError,
    InvalidInputError,
    RequestTooLargeError,
    StaleReadError,
    UnknownKeyError,
)
from gputq.transport import arena_copies, get_transport, shm
from gputq.transport.cuda import cuda_available, usable_cupy
from gputq.transport.handler import ServerLimits
from gputq.transport.policy import nixl_import_error
from gputq.transport.shm import ShmChannel
from gputq.unit.storage_unit import StorageUnit
from tests.host_cuda import HOST
from tests.transport.piecewise import NumpyWithCopyto, share_every_copy
from tests.waiting import child_exit_code, wait_until

TOKEN = "s" * 32
needs_cupy = pytest.mark.skipif(usable_cupy() is None, reason="CuPy sees no CUDA device")


@pytest.fixture
def served(tmp_path):
    """A unit with three keys (two adjacent in the arena), its tcp server, and an shm channel."""
    unit = StorageUnit("su-shm", 4 << 20, shm_dir=str(tmp_path), alignment=256)
    rng = np.random.default_rng(3)
    blobs = {"a": rng.integers(0, 256, 1000, dtype=np.uint8), "b": rng.integers(0, 256, 24, dtype=np.uint8),
             "c": rng.integers(0, 256, 70_000, dtype=np.uint8)}
    for key, blob in blobs.items():
        unit.put(key, blob, {"partition": "p"})
    server = get_transport("tcp").serve(unit, host="127.0.0.1", port=0, token=TOKEN,
                                        limits=ServerLimits(max_frame_bytes=1 << 26))
    channel = get_transport("shm").connect(server.address, token=TOKEN, max_frame_bytes=1 << 26, timeout=10)
    try:
        yield unit, blobs, channel, server.address
    finally:
        channel.close()
        server.close()
        unit.close()


@pytest.mark.timeout(30)
def test_read_copies_from_the_read_only_mapping(served):
    unit, blobs, channel, _ = served
    assert isinstance(channel, ShmChannel) and channel.fallback_reason is None
    assert channel.mapping.path == unit.arena_path
    assert not channel.mapping.array.flags.writeable  # mapped PROT_READ
    keys = ["c", "a", "b", "a"]
    want = np.concatenate([blobs[k] for k in keys])
    dest = np.full(want.size + 9, 7, np.uint8)
    assert channel.read(keys, dest, timeout=5) == [blobs[k].size for k in keys]
    assert np.array_equal(dest[:want.size], want) and (dest[want.size:] == 7).all()
    assert channel.read([], dest) == []
    # covered by its deadline, the lease is ended in the background
    wait_until(lambda: unit.stats()["leases"] == 0, 5, "the read's lease to end")
    # the unit's arena file keeps the permissions the unit gave it
    assert stat.S_IMODE(os.stat(unit.arena_path).st_mode) == 0o600


def test_read_errors_are_typed_and_end_the_lease(served):
    unit, blobs, channel, _ = served
    with pytest.raises(UnknownKeyError, match="ghost"):
        channel.read(["a", "ghost"], np.empty(2000, np.uint8), timeout=5)
    with pytest.raises(RequestTooLargeError, match="needs 1024 bytes"):
        channel.read(["a", "b"], np.empty(100, np.uint8), timeout=5)
    # the failed read's lease ended: a release frees the key's bytes at once
    assert unit.release(["a"], "p") == 1
    with pytest.raises(InvalidInputError, match="read-only"):
        channel.read(["b"], b"x" * 24)


@pytest.mark.timeout(30)
def test_a_lease_the_unit_expired_during_the_copy_is_a_stale_read(tmp_path, monkeypatch):
    # A real unit with a short lease timeout, and a reader held past it: the unit's own timer ends
    # the lease, end_lease answers it was not held, and the read returns nothing.
    unit = StorageUnit("su-expiry", 1 << 20, shm_dir=str(tmp_path), lease_timeout_s=0.2)
    blob = np.arange(1000, dtype=np.uint16).view(np.uint8)
    unit.put("a", blob, {"partition": "p"})
    server = get_transport("tcp").serve(unit, host="127.0.0.1", port=0, token=TOKEN)
    channel = get_transport("shm").connect(server.address, token=TOKEN, max_frame_bytes=1 << 20, timeout=10)
    copy_runs = arena_copies.copy_runs

    def held(out, src, runs):
        wait_until(lambda: unit.stats()["leases"] == 0, 10, "the unit to expire the read's lease")
        copy_runs(out, src, runs)

    try:
        monkeypatch.setattr(arena_copies, "copy_runs", held)
        dest = np.zeros(blob.size, np.uint8)
        result = None
        with pytest.raises(StaleReadError, match="expired before the copy finished"):
            result = channel.read(["a"], dest, timeout=5)
        assert result is None and unit.stats()["leases"] == 0
        monkeypatch.setattr(arena_copies, "copy_runs", copy_runs)
        assert channel.read(["a"], dest, timeout=5) == [blob.size] and np.array_equal(dest, blob)
    finally:
        channel.close()
        server.close()
        unit.close()


def _generations(unit: StorageUnit, keys: list[str]) -> list[int]:
    return [entry["generation"] for entry in unit.lookup(keys)]


def _read_bit_exact(unit: StorageUnit, blobs: dict, channel, keys: list[str]) -> None:
    """Read ``keys`` with their generations and check the bytes."""
    dest = np.empty(sum(blobs[k].size for k in keys), np.uint8)
    assert channel.read(keys, dest, timeout=10, generations=_generations(unit, keys)) == [blobs[k].size for k in keys]
    assert np.array_equal(dest, np.concatenate([blobs[k] for k in keys]))


@pytest.mark.timeout(30)
def test_a_read_copies_from_the_directory_before_its_lease_is_granted(served, monkeypatch):
    unit, blobs, channel, _ = served
    assert channel.directory is not None
    copied = threading.Event()
    real_copy, real_lease = arena_copies.copy_runs, unit.lease_regions
    monkeypatch.setattr(arena_copies, "copy_runs", lambda *args: (real_copy(*args), copied.set()))

    def lease_once_copied(keys, **checks):
        if not copied.wait(5):
            raise RuntimeError("the reader waited for the lease before copying")
        return real_lease(keys, **checks)

    monkeypatch.setattr(unit, "lease_regions", lease_once_copied)
    keys = ["c", "a", "b"]
    dest = np.empty(sum(blobs[k].size for k in keys), np.uint8)
    assert channel.read(keys, dest, timeout=10, generations=_generations(unit, keys)) == [70_000, 1000, 24]
    assert np.array_equal(dest, np.concatenate([blobs[k] for k in keys]))
    assert (channel.reads_ahead, channel.hint_misses) == (1, 0)
    dest[:] = 0  # without generations there is nothing to look up: the copy waits for the lease
    copied.clear()
    monkeypatch.setattr(unit, "lease_regions", real_lease)
    assert channel.read(["a"], dest[:1000], timeout=5) == [1000] and np.array_equal(dest[:1000], blobs["a"])
    assert (channel.reads_ahead, channel.hint_misses) == (1, 0)



@pytest.mark.timeout(30)
def test_the_lease_reply_is_read_while_the_copy_runs(served, monkeypatch):
    # The exchange (send, receive, decode) runs beside the copy, not after it: a copy that
    # waits for the reply to be read finishes only if it is.
    unit, blobs, channel, _ = served
    replied = threading.Event()
    real_request, real_copy = channel._tcp.request, arena_copies.copy_runs

    def request(*args, **kwargs):
        try:
            return real_request(*args, **kwargs)
        finally:
            replied.set()

    def copy_once_replied(*args):
        if not replied.wait(5):
            raise RuntimeError("the lease's reply was read only after the copy")
        real_copy(*args)

    monkeypatch.setattr(channel._tcp, "request", request)
    monkeypatch.setattr(arena_copies, "copy_runs", copy_once_replied)
    _read_bit_exact(unit, blobs, channel, ["a", "c"])
    assert (channel.reads_ahead, channel.hint_misses) == (1, 0)  # copied from the directory ahead of the lease


@pytest.mark.timeout(30)
def test_the_lease_helper_takes_pieces_of_the_copy_once_its_reply_is_in(served, monkeypatch):
    # On a box with few cores, a thread started with the copy competes with the unit's answer
    # to the lease; the helper that waited for that answer is free once it is in.
    unit, blobs, channel, _ = served
    share_every_copy(monkeypatch, 1000)
    reader, by_helper = threading.get_ident(), threading.Event()

    def copyto(dst, piece):
        if threading.get_ident() == reader:
            if not by_helper.wait(10):
                raise AssertionError("the lease helper took no piece of the copy")
        elif threading.current_thread().name.startswith("gputq-shm-lease-"):
            by_helper.set()
        np.copyto(dst, piece)

    real_lease = unit.lease_regions

    def lease_once_copying(keys, **checks):  # the reply comes while the copy runs, as it does when it is large
        wait_until(lambda: arena_copies._under_way, 10, "the copy to start")
        return real_lease(keys, **checks)

    monkeypatch.setattr(unit, "lease_regions", lease_once_copying)
    monkeypatch.setattr(arena_copies, "np", NumpyWithCopyto(copyto))
    _read_bit_exact(unit, blobs, channel, ["c", "a"])
    assert (channel.reads_ahead, channel.hint_misses) == (1, 0)  # copied from the directory ahead of the lease


@pytest.mark.timeout(60)
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_reads_over_a_channel_of_its_own(served, monkeypatch):
    # The parent's copy threads are not in the child; their pool must not take its reads.
    unit, blobs, channel, address = served
    monkeypatch.setattr(arena_copies, "COPY_THREADS", 2)
    monkeypatch.setattr(arena_copies, "PARALLEL_COPY_BYTES", 1000)
    keys, generations = ["a", "c"], _generations(unit, ["a", "c"])
    want = np.concatenate([blobs["a"], blobs["c"]])
    dest = np.empty_like(want)
    channel.read(keys, dest, timeout=5, generations=generations)
    assert channel.reads_ahead == 1 and arena_copies._pool is not None  # the copy threads exist in this process now
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            child = get_transport("shm").connect(address, token=TOKEN, max_frame_bytes=1 << 26, timeout=5)
            got = np.zeros_like(want)
            child.read(keys, got, timeout=5, generations=generations)
            code = 0 if np.array_equal(got, want) and child.reads_ahead == 1 else 2
            child.close()
        finally:
            os._exit(code)

    assert child_exit_code(pid, 30, "the forked child's read") == 0



@pytest.mark.timeout(60)
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("ahead", [True, False], ids=["leased-ahead", "leased"])
def test_a_channel_closed_while_its_lent_regions_are_read_unmaps_them_only_after(served, ahead):
    # A lost unit's channel is closed by the heartbeat, on another thread, whenever it is marked lost: a
    # restore still reading the regions it was lent (by address) must not find them unmapped. In a
    # forked child, so that the fault this guards against fails the test instead of killing pytest.
    unit, blobs, _, address = served
    generations = _generations(unit, ["a", "c"])
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            child = get_transport("shm").connect(address, token=TOKEN, max_frame_bytes=1 << 26, timeout=5)
            got = None
            with contextlib.suppress(ClosedError):  # the lease's exchange or end on the closed channel: typed
                with child.mapped_source(["a", "c"], 5, generations=generations, device=False,
                                         ahead=ahead) as regions:
                    child.close()
                    got = _bytes_at(regions)
            unmapped = child.mapping.array is None
            code = 0 if got == [blobs["a"].tobytes(), blobs["c"].tobytes()] and unmapped else 2
        finally:
            os._exit(code)

    assert child_exit_code(pid, 30, "the child's read of a closed channel's regions") == 0


@pytest.mark.timeout(60)
def test_a_unit_that_stops_answering_holds_up_its_own_reads_only(served, tmp_path, monkeypatch):
    unit, blobs, channel, _ = served
    other = StorageUnit("su-shm-other", 1 << 20, shm_dir=str(tmp_path), alignment=256)
    other.put("x", blobs["a"], {"partition": "p"})
    server = get_transport("tcp").serve(other, host="127.0.0.1", port=0, token=TOKEN,
                                        limits=ServerLimits(max_frame_bytes=1 << 26))
    other_channel = get_transport("shm").connect(server.address, token=TOKEN, max_frame_bytes=1 << 26, timeout=10)
    stuck, release = threading.Semaphore(0), threading.Event()
    real_lease = unit.lease_regions

    def lease_never_answered(keys, **checks):
        stuck.release()
        release.wait(30)
        return real_lease(keys, **checks)

    monkeypatch.setattr(unit, "lease_regions", lease_never_answered)
    generations = _generations(unit, ["a"])
    readers = [threading.Thread(target=lambda: channel.read(["a"], np.empty(1000, np.uint8), timeout=30,
                                                              generations=generations), daemon=True)
               for _ in range(shm.LEASE_THREADS + 2)]
    try:
        for reader in readers:
            reader.start()
        assert all(stuck.acquire(timeout=10) for _ in range(shm.LEASE_THREADS))  # its helpers all wait
        dest, done = np.zeros(1000, np.uint8), threading.Event()
        threading.Thread(target=lambda: (other_channel.read(["x"], dest, timeout=5,
                                                            generations=_generations(other, ["x"])), done.set()),
                         daemon=True).start()
        assert done.wait(10), "a read of another unit waited for the unit that does not answer"
        assert np.array_equal(dest, blobs["a"]) and other_channel.reads_ahead == 1
    finally:
        release.set()
        for reader in readers:
            reader.join(30)
        other_channel.close()
        server.close()
        other.close()


@pytest.mark.timeout(30)
def test_a_wrong_directory_entry_costs_a_second_copy_not_wrong_bytes(served):
    unit, blobs, channel, _ = served
    generation = _generations(unit, ["a"])[0]
    elsewhere = unit.lookup(["c"])[0]["offset"]
    unit._directory.publish("a", generation, elsewhere, 1000)  # a torn or stale entry
    dest = np.empty(1000, np.uint8)
    assert channel.read(["a"], dest, timeout=5, generations=[generation]) == [1000]
    assert np.array_equal(dest, blobs["a"])
    assert (channel.reads_ahead, channel.hint_misses) == (0, 1)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("offset, nbytes", [(-256, 1000), (4 << 20, 1000), (2**62, 2**62), (0, -1)])
def test_a_directory_entry_outside_the_arena_is_never_read(served, offset, nbytes):
    unit, blobs, channel, _ = served
    generation = _generations(unit, ["a"])[0]
    unit._directory.publish("a", generation, offset, nbytes)  # the sum of the last overflows int64
    dest = np.empty(1000, np.uint8)
    assert channel.read(["a"], dest, timeout=5, generations=[generation]) == [1000]
    assert np.array_equal(dest, blobs["a"]) and (channel.reads_ahead, channel.hint_misses) == (0, 0)
    with channel.mapped_source(["a"], 5, generations=[generation], device=False) as regions:
        assert regions[0, 1] == 1000 and regions[0, 0] - channel.mapping.address == unit.lookup(["a"])[0]["offset"]


@pytest.mark.timeout(30)
def test_a_key_freed_and_its_space_reused_during_the_early_copy_fails_the_read(served, monkeypatch):
    unit, blobs, channel, _ = served
    generation = _generations(unit, ["a"])[0]
    real_lease = unit.lease_regions

    def reused_first(keys, **checks):  # between the reader's look-up and the grant
        unit.release(["a"], "p")
        unit.put("z", np.full(1000, 0xEE, np.uint8), {"partition": "p"})
        return real_lease(keys, **checks)

    monkeypatch.setattr(unit, "lease_regions", reused_first)
    dest = np.zeros(1000, np.uint8)
    with pytest.raises(UnknownKeyError, match="'a'"):
        channel.read(["a"], dest, timeout=5, generations=[generation])
    assert unit.stats()["leases"] == 0


@pytest.mark.timeout(30)
def test_a_failed_early_copy_ends_the_lease_it_was_granted(served, monkeypatch):
    unit, blobs, channel, _ = served

    def broken(*args):
        raise MemoryError("copy failed")

    monkeypatch.setattr(arena_copies, "copy_runs", broken)
    with pytest.raises(MemoryError, match="copy failed"):
        channel.read(["a"], np.empty(1000, np.uint8), timeout=5, generations=_generations(unit, ["a"]))
    wait_until(lambda: unit.stats()["leases"] == 0, 5, "the granted lease to end")


def _bytes_at(regions: np.ndarray) -> list[bytes]:
    import ctypes

    return [ctypes.string_at(int(address), int(nbytes)) for address, nbytes in regions]


@pytest.mark.timeout(30)
def test_mapped_source_lends_the_directory_regions_before_its_lease_is_granted(served, monkeypatch):
    unit, blobs, channel, _ = served
    used = threading.Event()
    real_lease = unit.lease_regions

    def lease_once_used(keys, **checks):
        if not used.wait(5):
            raise RuntimeError("the regions were lent only after the lease")
        return real_lease(keys, **checks)

    monkeypatch.setattr(unit, "lease_regions", lease_once_used)
    keys = ["c", "a"]
    with channel.mapped_source(keys, 10, generations=_generations(unit, keys), device=False) as regions:
        got = _bytes_at(regions)
        used.set()
    assert got == [blobs["c"].tobytes(), blobs["a"].tobytes()]
    assert (channel.reads_ahead, channel.hint_misses) == (1, 0)
    wait_until(lambda: unit.stats()["leases"] == 0, 5, "the lease to end")


@pytest.mark.timeout(30)
def test_mapped_source_on_a_wrong_directory_entry_fails_on_exit_and_reads_right_after_the_lease(served):
    unit, blobs, channel, _ = served
    generation = _generations(unit, ["a"])[0]
    unit._directory.publish("a", generation, unit.lookup(["c"])[0]["offset"], 1000)
    with pytest.raises(HintMissedError, match="read them again after the lease"):
        with channel.mapped_source(["a"], 10, generations=[generation], device=False) as regions:
            assert _bytes_at(regions) == [blobs["c"][:1000].tobytes()]  # what the stale entry names
    assert unit.stats()["leases"] == 0 and channel.hint_misses == 1
    with channel.mapped_source(["a"], 10, generations=[generation], device=False, ahead=False) as regions:
        assert _bytes_at(regions) == [blobs["a"].tobytes()]


@pytest.mark.timeout(30)
def test_an_error_in_the_block_on_a_wrong_directory_entry_is_a_hint_miss(served):
    """A wrong entry may name any bytes (misaligned ones too), and a restore on them may fail: the lease says
    the hint was wrong, so the block's error becomes HintMissedError (read again after the lease), its cause
    kept, and the lease ends."""
    unit, blobs, channel, _ = served
    generation = _generations(unit, ["a"])[0]
    unit._directory.publish("a", generation, unit.lookup(["c"])[0]["offset"] + 1, 1000)
    with pytest.raises(HintMissedError, match="read them again after the lease") as info:
        with channel.mapped_source(["a"], 10, generations=[generation], device=False):
            raise ValueError("misaligned")
    assert isinstance(info.value.__cause__, ValueError)
    assert channel.hint_misses == 1
    wait_until(lambda: unit.stats()["leases"] == 0, 5, "the lease to end")


@pytest.mark.timeout(30)
def test_an_error_in_the_block_ends_the_lease_requested_ahead(served):
    unit, blobs, channel, _ = served
    with pytest.raises(KeyError, match="restore failed"):
        with channel.mapped_source(["a"], 10, generations=_generations(unit, ["a"]), device=False):
            raise KeyError("restore failed")
    wait_until(lambda: unit.stats()["leases"] == 0, 5, "the lease to end")
    assert (channel.reads_ahead, channel.hint_misses) == (0, 0)


@pytest.mark.timeout(30)
def test_a_unit_without_a_directory_is_read_after_its_lease(served, monkeypatch):
    unit, blobs, _, address = served
    monkeypatch.setattr(StorageUnit, "directory_file", property(lambda self: None))
    with ShmChannel(address, token=TOKEN, max_frame_bytes=1 << 26, timeout=5) as plain:
        assert plain.directory is None and plain.mapping is not None
        dest = np.empty(1000, np.uint8)
        assert plain.read(["a"], dest, timeout=5, generations=_generations(unit, ["a"])) == [1000]
        assert np.array_equal(dest, blobs["a"]) and plain.reads_ahead == 0


def test_writes_are_copied_into_the_arena_and_control_goes_over_the_tcp_lane(served):
    unit, _, channel, _ = served
    receipt = channel.write("d", np.arange(10, dtype=np.uint8), {"partition": "p"}, timeout=5)
    assert receipt["offset"] >= 0 and channel.writes_copied == 1 and channel.write_fallback_reason is None
    assert channel.call("stats", timeout=5)["keys"] == 4
    dest = np.empty(10, np.uint8)
    channel.read(["d"], dest, timeout=5)
    assert dest.tolist() == list(range(10))


def test_unmappable_arena_falls_back_to_tcp_reads(served, monkeypatch):
    unit, blobs, channel, address = served
    remote = ShmChannel(dict(address, hostname="elsewhere"), token=TOKEN, max_frame_bytes=1 << 26, timeout=5)
    with remote:
        assert remote.mapping is None and "elsewhere" in remote.fallback_reason
        dest = np.empty(1000, np.uint8)
        assert remote.read(["a"], dest, timeout=5) == [1000] and np.array_equal(dest, blobs["a"])
    monkeypatch.setattr(os, "open", lambda *a, **k: (_ for _ in ()).throw(PermissionError(13, "denied")))
    with ShmChannel(address, token=TOKEN, max_frame_bytes=1 << 26, timeout=5) as denied:
        assert denied.mapping is None and "denied" in denied.fallback_reason
        with pytest.raises(Exception, match="no mapped arena"):
            with denied.mapped_source(["a"]):
                pass


@pytest.mark.rdma
@pytest.mark.skipif(nixl_import_error() is not None, reason=f"NIXL not importable: {nixl_import_error()}")
@pytest.mark.timeout(60)
def test_unmappable_arena_of_an_rdma_unit_falls_back_to_rdma(tmp_path):
    with StorageUnit("su-rdma", 1 << 20, shm_dir=str(tmp_path)) as unit:
        blob = np.arange(5000, dtype=np.uint32).view(np.uint8)
        unit.put("k", blob, {"partition": "p"})
        server = get_transport("rdma").serve(unit, host="127.0.0.1", port=0, token=TOKEN,
                                             limits=ServerLimits(max_frame_bytes=1 << 26))
        try:
            address = dict(server.address, hostname="elsewhere")
            with ShmChannel(address, token=TOKEN, max_frame_bytes=1 << 26, timeout=10) as channel:
                assert channel.mapping is None and type(channel._fallback).__name__ == "NixlChannel"
                dest = np.empty(blob.size, np.uint8)
                assert channel.read(["k"], dest, timeout=10) == [blob.size]
                assert np.array_equal(dest, blob)
        finally:
            server.close()


def test_closed_channel_raises(served):
    _, _, channel, _ = served
    channel.close()
    channel.close()
    with pytest.raises(Exception, match="closed"):
        channel.read(["a"], np.empty(1000, np.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="no CUDA device")
def test_read_into_gpu_memory_from_the_registered_mapping(served):
    unit, blobs, channel, _ = served
    torch = pytest.importorskip("torch")
    keys = ["b", "c", "a"]
    want = np.concatenate([blobs[k] for k in keys])
    dest = torch.full((want.size + 16,), 9, dtype=torch.uint8, device="cuda")
    assert channel.read(keys, dest, timeout=10) == [blobs[k].size for k in keys]
    got = dest.cpu().numpy()
    assert np.array_equal(got[:want.size], want) and (got[want.size:] == 9).all()
    assert channel.mapping.registered or channel.mapping.register_error
    dest.fill_(9)  # with generations: copied from the directory's regions while the lease is requested
    generations = _generations(unit, keys)
    assert channel.read(keys, dest, timeout=10, generations=generations) == [blobs[k].size for k in keys]
    got = dest.cpu().numpy()
    assert np.array_equal(got[:want.size], want) and (got[want.size:] == 9).all()
    assert (channel.reads_ahead, channel.hint_misses) == (1, 0)


@pytest.mark.gpu
@needs_cupy
def test_mapped_source_lends_device_addresses_under_a_lease(served):
    import cupy as cp

    unit, blobs, channel, _ = served
    if not channel.device_mappable():
        pytest.skip(f"mapping not registrable here: {channel.mapping.register_error}")
    with channel.mapped_source(["c", "a"], timeout=10) as regions:
        assert regions[:, 1].tolist() == [blobs["c"].size, blobs["a"].size]
        out = cp.empty(int(regions[0, 1]), cp.uint8)
        cp.cuda.runtime.memcpy(out.data.ptr, int(regions[0, 0]), int(regions[0, 1]),
                               cp.cuda.runtime.memcpyDefault)  # unified addressing tells the kinds
        assert np.array_equal(out.get(), blobs["c"])


def test_one_cached_cuda_probe_answers_everywhere():
    from gputq import kernels
    from gputq.kernels import cupy_backend
    from gputq.transport import cuda, staging

    assert kernels.cuda_available is cuda.cuda_available is staging.cuda_available
    assert cupy_backend.cupy_usable() is (cuda.usable_cupy() is not None)
    assert cuda.usable_cupy.cache_info().currsize == 1  # probed once, then cached
    if cuda.cuda_available():
        pytest.skip("CUDA is usable here: the no-CUDA answers do not apply")
    assert cuda.usable_cupy() is None and cuda.usable_torch() is None
    with pytest.raises(ImportError, match="CuPy"):
        cuda.require_cupy("zero-copy")
    with pytest.raises(ImportError, match="CUDA"):
        cuda.host_register(0, 4096, cuda.HOST_REGISTER_READ_ONLY)


def test_large_reads_are_split_over_threads(served, monkeypatch):
    unit, blobs, channel, _ = served
    share_every_copy(monkeypatch, 4096, threads=3)
    keys = ["a", "b", "c", "a"]
    want = np.concatenate([blobs[k] for k in keys])
    dest = np.zeros(want.size, np.uint8)
    assert channel.read(keys, dest, timeout=5) == [blobs[k].size for k in keys]
    assert np.array_equal(dest, want)



def _copies_and_waits(log: list) -> list:
    return [entry[:4] if entry[0] == "copy" else entry[:1] for entry in log if entry[0] in ("copy", "sync")]


def test_device_copies_land_each_run_at_its_offset_and_wait(host_cuda):
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, 10_000, dtype=np.uint8)
    out = host_cuda.empty(3_000, np.uint8)
    runs = [(9_000, 0, 1_000), (100, 1_000, 1_500), (4_000, 2_500, 500)]
    arena_copies.device_copy_runs(out, src, runs)
    want = np.concatenate([src[at:at + n] for at, _, n in runs])
    assert np.array_equal(out.host, want)
    # one cudaMemcpyAsync per run, then one wait, after the last copy
    assert _copies_and_waits(host_cuda.log) == \
        [("copy", out.data.ptr + off, src.ctypes.data + at, n) for at, off, n in runs] + [("sync",)]


def test_a_read_into_gpu_memory_copies_each_run_from_the_mapping(shm_leases_checked, served):
    # channel.read into CUDA memory: one cudaMemcpyAsync per run of the arena, from the mapping's
    # own (page-locked) addresses, and one wait before the lease is confirmed.
    host_cuda = shm_leases_checked  # the copies run before the lease is confirmed
    unit, blobs, channel, _ = served
    keys = ["c", "a", "b"]  # padded to 256 bytes apart in the arena: a run each
    want = np.concatenate([blobs[k] for k in keys])
    dest = host_cuda.empty(want.size, np.uint8)
    assert channel.read(keys, dest, timeout=10, generations=_generations(unit, keys)) == [70_000, 1000, 24]
    assert np.array_equal(dest.host, want) and channel.mapping.registered
    at, packed = [entry["offset"] for entry in unit.lookup(keys)], np.cumsum([0, 70_000, 1000])
    assert _copies_and_waits(host_cuda.log) == \
        [("copy", dest.data.ptr + int(p), channel.mapping.address + a, blobs[k].size)
         for k, a, p in zip(keys, at, packed)] + [("sync",)]
    assert {entry[5] for entry in host_cuda.log if entry[0] == "copy"} == {HOST}
    assert (channel.reads_ahead, channel.hint_misses) == (1, 0)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("supported, refuse", [(True, False), (False, False), (True, True)],
                         ids=["registered", "no-read-only-support", "refused"])
def test_the_arena_mapping_is_page_locked_read_only_and_mapped_once(served, host_cuda, supported, refuse):
    from gputq.transport import cuda

    _, _, channel, _ = served
    host_cuda.read_only_register_supported, host_cuda.refuse_registration = supported, refuse
    host_cuda.mapped_offset = 1 << 40  # a device address that is not the host one
    mapping = shm.ArenaMapping(channel.mapping.path, channel.mapping.nbytes)
    registered = supported and not refuse
    assert mapping.register() is registered and mapping.register() is registered  # tried once
    flags = cuda.HOST_REGISTER_PORTABLE | cuda.HOST_REGISTER_MAPPED | cuda.HOST_REGISTER_READ_ONLY
    attempts = [entry for entry in host_cuda.log if entry[0] in ("register", "refused")]
    assert attempts == ([("refused" if refuse else "register", mapping.address, mapping.nbytes, flags)]
                        if supported else [])
    assert (mapping.register_error is None) is registered
    if registered:  # the kernel reads it through the device address the runtime gives
        assert cuda.mapped_device_pointer(mapping.address) == mapping.address + (1 << 40)
    else:
        with pytest.raises(GputqError, match="not registered"):
            cuda.mapped_device_pointer(mapping.address)
    mapping.close()
    mapping.close()
    unregistered = [entry for entry in host_cuda.log if entry[0] == "unregister"]
    assert unregistered == ([("unregister", mapping.address)] if registered else [])  # once, and only if locked


@pytest.mark.timeout(30)
def test_a_page_locked_arena_mapping_dropped_unclosed_is_unregistered_while_still_mapped(served, host_cuda,
                                                                                         monkeypatch):
    """Clients dropped unclosed leave their channels' mappings to the garbage collector: a page-locked one is
    unregistered from CUDA, its range still mapped. It once stayed registered, its pages locked, for ever."""
    from gputq.transport import arena_mapping

    _, _, channel, _ = served
    host_cuda.read_only_register_supported = True
    mapping = shm.ArenaMapping(channel.mapping.path, channel.mapping.nbytes)
    assert mapping.register()
    address, seen = mapping.address, []
    unregister = arena_mapping.host_unregister

    def checked(ptr):  # the range must still be mapped
        with open("/proc/self/maps") as maps:
            spans = [[int(end, 16) for end in line.split()[0].split("-")] for line in maps]
        seen.append(any(start <= ptr < stop for start, stop in spans))
        unregister(ptr)

    monkeypatch.setattr(arena_mapping, "host_unregister", checked)
    del mapping
    gc.collect()
    assert seen == [True] and [entry for entry in host_cuda.log if entry[0] == "unregister"] == [
        ("unregister", address)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("zero_copy_max", [float("inf"), 0], ids=["in-place", "copied"])
def test_host_restore_over_shm_reads_in_place_or_stages(monkeypatch, zero_copy_max):
    """A CPU restore widens straight out of the arena mappings (no staging copy), or from a copy of
    them in spans when ``zero_copy_max_bytes`` says so; both are bit-exact with the inline path."""
    from gputq.client.reader import Reader
    from gputq.kernels import MappedSource
    from tests.conftest import local_units

    copies, sources = [], []
    real_copy, real_widen = arena_copies.copy_runs, MappedSource.widen_scatter

    def counted_copy(out, src, runs):
        runs = list(runs)
        copies.append(len(runs))
        real_copy(out, src, runs)

    monkeypatch.setattr(arena_copies, "copy_runs", counted_copy)
    monkeypatch.setattr(MappedSource, "widen_scatter",
                        lambda self, *a, **k: (sources.append(self.addresses.copy()), real_widen(self, *a, **k))[1])
    with local_units("shm", routed_experts_dtype="uint8", zero_copy_max_bytes=zero_copy_max) as \
            (config, services, clients):
        segments = _written_segments(clients, config, "uint8", seed=5)
        with Reader(clients, config) as reader:
            restored = reader.fetch([seg.layouts for seg in segments])
        _check_restored(segments, restored)
        assert all(a.flags.writeable for got in restored for a in got.values())  # the caller's own memory
        wait_until(lambda: all(s.stats()["leases"] == 0 for s in services), 5, "every lease to end")
        channels = [clients.channel(unit) for unit in clients.units]
        assert sum(channel.reads_ahead for channel in channels) >= len(clients.units)  # found in the directories
        assert sum(channel.hint_misses for channel in channels) == 0
        arenas = [(c.mapping.address, c.mapping.address + c.mapping.nbytes) for c in channels]
    in_arena = [any(low <= a < high for low, high in arenas) for a in np.concatenate(sources)]
    if zero_copy_max:
        assert all(in_arena) and not copies
    else:  # one copy call, a few spans (keys written in sequence lie back to back), read from the copy
        assert not any(in_arena) and len(copies) == 1 and copies[0] <= len(clients.units) * 4


@pytest.mark.timeout(60)
def test_a_restore_on_a_wrong_directory_entry_is_made_again_after_the_leases(monkeypatch):
    from gputq.client.reader import Reader
    from tests.conftest import local_units

    with local_units("shm", routed_experts_dtype="uint16") as (config, services, clients):
        segments = _written_segments(clients, config, "uint16", seed=8)
        unit = services[0]._unit
        key = min(key for keys in unit.keys()["partitions"].values() for key in keys)
        entry = unit.lookup([key])[0]
        unit._directory.publish(key, entry["generation"], entry["offset"] + 256, entry["nbytes"])  # stale
        with Reader(clients, config) as reader:
            restored = reader.fetch([seg.layouts for seg in segments])
        _check_restored(segments, restored)
        assert clients.channel(services[0].name).hint_misses == 1
        wait_until(lambda: all(s.stats()["leases"] == 0 for s in services), 5, "every lease to end")


@pytest.mark.timeout(60)
def test_a_restore_held_past_its_leases_is_a_stale_read_that_returns_nothing(monkeypatch):
    # Real units expire the leases of an in-place restore whose trainer stalls past them (their
    # lease timeout is twice the read timeout): the fetch fails, and a fetch after it is whole.
    from gputq.client.reader import Reader
    from gputq.kernels import MappedSource
    from tests.conftest import local_units

    # The restore reads the mapping through either (R3 transposed out of it, other fields widened).
    real_widen, real_host_array = MappedSource.widen_scatter, MappedSource.host_array

    def expired():
        # The leases first: a restore on the key directory's regions starts while they are requested.
        wait_until(lambda: all(s.stats()["reads"] > granted[s.name] for s in services if s.name in read), 10,
                   "the units to grant the leases")
        wait_until(lambda: all(s.stats()["leases"] == 0 for s in services), 10, "the units to expire the leases")

    def held(source, *args, **kwargs):
        expired()
        return real_widen(source, *args, **kwargs)

    def held_array(source, *args, **kwargs):
        expired()
        return real_host_array(source, *args, **kwargs)

    with local_units("shm", routed_experts_dtype="uint8", zero_copy_max_bytes=float("inf"), read_timeout_s=1.0) as \
            (config, services, clients):
        segments = _written_segments(clients, config, "uint8", seed=6)
        read = {f.ref.unit for seg in segments for layout in seg.layouts.values() for f in layout.fragments}
        granted = {s.name: s.stats()["reads"] for s in services}  # a one-sided reader's lease is the unit's read
        with Reader(clients, config) as reader:
            monkeypatch.setattr(MappedSource, "widen_scatter", held)
            monkeypatch.setattr(MappedSource, "host_array", held_array)
            restored = None
            with pytest.raises(StaleReadError, match="expired before the copy finished"):
                restored = reader.fetch([seg.layouts for seg in segments])
            assert restored is None
            monkeypatch.setattr(MappedSource, "widen_scatter", real_widen)
            monkeypatch.setattr(MappedSource, "host_array", real_host_array)
            _check_restored(segments, reader.fetch([seg.layouts for seg in segments]))


def _written_segments(clients, config, dtype: str, seed: int) -> list:
    """A small synthetic rollout (branches, rewrites) written to the units; its lineage segments."""
    from gputq.client.writer import Writer
    from gputq.data.fields import FieldRegistry
    from gputq.data.trajectory import lineage_segments
    from gputq.tools.synthetic import SyntheticConfig, build_sessions

    synth = SyntheticConfig(sessions=3, steps_per_session=3, layers=3, topk=4, num_experts=200, prompt_tokens=40,
                            tokens_per_step=30, tool_tokens=6, branch_prob=0.5, rewrite_prob=0.3, seed=seed)
    with Writer(clients, config) as writer:
        sessions = build_sessions(synth, fields=FieldRegistry.builtin(3, 4, dtype), writer=writer)
        writer.flush()
    return [seg for session in sessions for seg in lineage_segments(session)]


def _check_restored(segments, restored) -> None:
    """Every restored field is bit-exact with the segment's inline fields."""
    from gputq.data.trajectory import inline_fields

    assert len(restored) == len(segments)
    for seg, got in zip(segments, restored):
        for name, want in inline_fields(seg).items():
            assert np.array_equal(got[name], want), (seg.segment_id, name)
