"""No read returns another key's bytes: paused readers and release/read/rewrite races, on tcp, shm and rdma.

Each race prints one line of figures (cycles, reads, bytes checked, typed
errors, wrong bytes); run with ``-s`` to see them. docs/RELIABILITY.md
records a run of the slow versions.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from gputq.errors import MissingDependencyError, PeerLostError, StaleReadError, UnknownKeyError
from gputq.transport.handler import ServerLimits
from gputq.transport.shm import ShmTransport
from gputq.transport.staging import StagingPool
from gputq.transport.tcp import TcpChannel, TcpTransport
from tests.transport.units import make_unit
from tests.waiting import wait_until

TOKEN = "token-of-the-integrity-tests"
MAX = 1 << 30
LIMITS = ServerLimits(max_frame_bytes=MAX)
MiB = 1 << 20


# ------------------------------------------------------------------ a tcp reader that stops reading mid-reply

class FakeDeviceBuffer:
    """Host memory posing as CUDA memory, so the read goes through the staging ring."""

    def __init__(self, nbytes: int):
        self.host = np.zeros(nbytes, np.uint8)
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "strides": None,
                                         "data": (self.host.ctypes.data, False), "version": 3}


class PausingCopier:
    """A staging copier that stops the reader after its first chunk until ``resume`` is set."""

    paused = threading.Event()
    resume = threading.Event()

    def __init__(self, dest, nchunks, chunk_bytes):
        self.slots = [memoryview(bytearray(chunk_bytes)) for _ in range(nchunks)]
        self.copies = 0

    def target(self, dest):
        self.dest = dest.host

    def wait(self, slot):
        pass

    def copy_async(self, slot, offset, nbytes):
        self.dest[offset:offset + nbytes] = np.frombuffer(self.slots[slot][:nbytes], np.uint8)
        self.copies += 1
        if self.copies == 1:
            PausingCopier.paused.set()
            PausingCopier.resume.wait(30)

    def synchronize(self):
        pass


@pytest.mark.timeout(60)
def test_tcp_reader_paused_past_the_send_deadline_gets_an_error_never_other_bytes():
    nbytes = 40 * MiB
    victim = np.full(nbytes, 0xAA, np.uint8)
    PausingCopier.paused.clear()
    PausingCopier.resume.clear()
    # The unit's lease timeout is shorter than the pause: a lease that could expire would.
    with make_unit(64 * MiB, name="su-paused", lease_timeout_s=1.0) as unit, \
            TcpTransport().serve(unit, token=TOKEN,
                                 limits=ServerLimits(max_frame_bytes=MAX, send_timeout_s=0.5)) as srv:
        unit.put("victim", victim)
        staging = StagingPool(chunk_bytes=MiB, nchunks=2, make_copier=PausingCopier)
        outcome = {}
        dest = FakeDeviceBuffer(nbytes)
        with TcpChannel(srv.address, token=TOKEN, max_frame_bytes=MAX, timeout=5, staging=staging) as ch:
            def read():
                try:
                    outcome["ok"] = ch.read(["victim"], dest, timeout=30)
                except Exception as exc:  # the expected outcome; checked below
                    outcome["error"] = exc

            reader = threading.Thread(target=read)
            reader.start()
            assert PausingCopier.paused.wait(10)
            assert unit.release(["victim"]) == 1  # the key goes while its bytes are being sent
            # A new key needs the victim's space: it gets it only once no send of it can still run.
            unit.put("intruder", np.full(nbytes, 0x55, np.uint8), timeout=20)
            assert unit.lookup(["intruder"])[0]["offset"] == 0  # the victim's region, reused
            PausingCopier.resume.set()
            reader.join(20)
        assert "ok" not in outcome, "a paused read returned ok after its key was released and rewritten"
        error = outcome["error"]
        assert isinstance(error, PeerLostError) and "su-paused" in str(error) and "'victim'" in str(error)
        assert not (dest.host == 0x55).any()  # not one byte of the intruder reached the reader
        assert wait_until(lambda: unit.stats()["leases"] == 0)


# ------------------------------------------------------------------ release / read / rewrite races

def _content(cycle: int, nbytes: int) -> np.ndarray:
    data = np.full(nbytes, cycle % 251, np.uint8)
    data[:8] = np.frombuffer(np.uint64(cycle).tobytes(), np.uint8)  # unique per cycle
    return data


def run_races(channel, unit, cycles: int, *, key_bytes: int = 16 << 10, slots: int = 4, readers: int = 2) -> dict:
    """A mutator releases and rewrites keys while readers read them by reference (generation).

    Returns the figures: reads that returned bytes (all checked), typed
    errors, wrong bytes (must be 0) and other errors (must be none).
    """
    refs: dict[int, tuple[int, int]] = {}
    for slot in range(slots):
        refs[slot] = (channel.write(f"s{slot}", _content(slot, key_bytes))["generation"], slot)
    done = threading.Event()
    figures = {"cycles": cycles, "reads_ok": 0, "bytes_checked": 0, "stale": 0, "expired": 0, "unknown": 0,
               "wrong_bytes": 0, "other_errors": []}
    lock = threading.Lock()

    def mutate():
        try:
            for cycle in range(slots, slots + cycles):
                slot = cycle % slots
                channel.call("release", keys=[f"s{slot}"])
                receipt = channel.write(f"s{slot}", _content(cycle, key_bytes), timeout=10)
                refs[slot] = (receipt["generation"], cycle)
        except Exception as exc:  # reported below
            figures["other_errors"].append(repr(exc))
        finally:
            done.set()

    def read(seed: int):
        rng = np.random.default_rng(seed)
        dest = np.empty(key_bytes, np.uint8)
        while not done.is_set():
            slot = int(rng.integers(slots))
            generation, cycle = refs[slot]
            try:
                channel.read([f"s{slot}"], dest, timeout=10, generations=[generation])
            except StaleReadError as exc:
                with lock:
                    figures["expired" if "expired" in str(exc) else "stale"] += 1
                continue
            except UnknownKeyError:
                with lock:
                    figures["unknown"] += 1
                continue
            except Exception as exc:  # reported below
                figures["other_errors"].append(repr(exc))
                return
            wrong = int(np.count_nonzero(dest != _content(cycle, key_bytes)))
            with lock:
                figures["reads_ok"] += 1
                figures["bytes_checked"] += key_bytes
                figures["wrong_bytes"] += wrong

    threads = [threading.Thread(target=mutate)] + [threading.Thread(target=read, args=(i,)) for i in range(readers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return figures


def _check(figures: dict, transport: str) -> None:
    print(f"\n{transport} races: {figures}")
    assert figures["other_errors"] == [] and figures["wrong_bytes"] == 0, figures
    assert figures["reads_ok"] > 0 and figures["stale"] + figures["unknown"] > 0, figures


def _tcp_races(cycles: int) -> dict:
    with make_unit(96 << 10, name="su-race") as unit, \
            TcpTransport().serve(unit, token=TOKEN, limits=LIMITS) as srv, \
            TcpTransport().connect(srv.address, token=TOKEN, max_frame_bytes=MAX, timeout=5) as ch:
        figures = run_races(ch, unit, cycles)
        try:
            wait_until(lambda: unit.stats()["leases"] == 0, 30, "every lease ended")
        except AssertionError:
            figures["other_errors"].append(f"leases left: {unit.stats()}")
    return figures


def _shm_races(cycles: int) -> dict:
    # Readers copy from the key directory while their lease is requested: with 4 keys rewritten
    # in a 96 KiB arena, a region a reader copies ahead is often released and rewritten meanwhile.
    with make_unit(96 << 10, name="su-race") as unit, \
            TcpTransport().serve(unit, token=TOKEN, limits=LIMITS) as srv, \
            ShmTransport().connect(srv.address, token=TOKEN, max_frame_bytes=MAX, timeout=5) as ch:
        figures = run_races(ch, unit, cycles)
        figures.update(reads_ahead=ch.reads_ahead, hint_misses=ch.hint_misses)
        try:
            wait_until(lambda: unit.stats()["leases"] == 0, 30, "every lease ended")
        except AssertionError:
            figures["other_errors"].append(f"leases left: {unit.stats()}")
    if not figures["reads_ahead"]:
        figures["other_errors"].append("no read was copied ahead of its lease")
    return figures


def _rdma_races(cycles: int) -> dict:
    nixl = pytest.importorskip("gputq.transport.nixl", reason="gputq.transport.nixl does not import")
    try:
        nixl.import_nixl()
    except MissingDependencyError as exc:
        pytest.skip(f"nixl does not import: {exc}")
    # A lease timeout this short expires some leases mid-read on a busy machine: the confirm must catch them.
    with make_unit(96 << 10, name="su-race", lease_timeout_s=0.005) as unit, \
            nixl.NixlTransport("tcp").serve(unit, token=TOKEN, limits=LIMITS) as srv, \
            nixl.NixlTransport("tcp").connect(srv.address, token=TOKEN, max_frame_bytes=MAX, timeout=5) as ch:
        figures = run_races(ch, unit, cycles)
    return figures


@pytest.mark.timeout(120)
def test_tcp_release_read_rewrite_races():
    _check(_tcp_races(2000), "tcp")


@pytest.mark.timeout(120)
def test_shm_release_read_rewrite_races():
    _check(_shm_races(2000), "shm")


@pytest.mark.rdma
@pytest.mark.timeout(120)
def test_rdma_release_read_rewrite_races():
    _check(_rdma_races(2000), "rdma")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("transport", ["tcp", "shm", pytest.param("rdma", marks=pytest.mark.rdma)])
def test_release_read_rewrite_races_at_length(transport):
    races = {"tcp": _tcp_races, "shm": _shm_races, "rdma": _rdma_races}[transport]
    _check(races(20_000), transport)
