"""gputq's one ``cudaHostRegister`` (gputq.transport.cuda) and its two users: the arena and the rdma pool.

Run on the CuPy stand-in of tests/host_cuda.py (``host_cuda``), which keeps
the registered ranges and refuses a double registration as CUDA does, and
on a torch stand-in whose ``cudart()`` answers error codes. Neither needs a
GPU or NIXL: the pool is driven with an agent that records registrations.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from gputq.errors import GputqError, MissingDependencyError
from gputq.transport import cuda, nixl_pool
from gputq.unit.arena import Arena

pytestmark = pytest.mark.timeout(60)

KIB = 1024


class RecordingAgent:
    """The part of a NIXL agent a BufferPool calls; it records what is (de)registered."""

    def __init__(self, refuse: bool = False):
        self.refuse = refuse
        self.registered: list[int] = []
        self.deregistered: list[int] = []

    def register_memory(self, descs, mem):
        if self.refuse:
            raise RuntimeError("NIXL: registration refused")
        ptr = int(descs[0][0])
        self.registered.append(ptr)
        return ptr

    def deregister_memory(self, handle):
        self.deregistered.append(handle)


class TorchCudart:
    """torch's ``cudart()`` binding: error codes, 0 for success."""

    def __init__(self, register_error: int = 0, unregister_error: int = 0):
        self.register_error, self.unregister_error = register_error, unregister_error
        self.calls: list[tuple] = []

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.calls.append(("register", ptr, nbytes, flags))
        return self.register_error

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return self.unregister_error


@pytest.fixture
def torch_cuda(monkeypatch):
    """CUDA through torch only (no CuPy): the probes answer a torch stand-in."""
    cudart = TorchCudart()
    torch = types.SimpleNamespace(cuda=types.SimpleNamespace(cudart=lambda: cudart))
    monkeypatch.setattr(cuda, "usable_cupy", lambda: None)
    monkeypatch.setattr(cuda, "usable_torch", lambda: torch)
    return cudart


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(cuda, "usable_cupy", lambda: None)
    monkeypatch.setattr(cuda, "usable_torch", lambda: None)


def _entries(log: list, kind: str) -> list:
    return [entry for entry in log if entry[0] == kind]


# -- gputq.transport.cuda ----------------------------------------------------------------------

class CountingTorch:
    """``torch`` as ``import torch`` finds it in ``sys.modules``: counts the CUDA probes it answers."""

    def __init__(self):
        self.probes = 0
        self.cuda = types.SimpleNamespace(is_available=self._is_available)

    def _is_available(self) -> bool:
        self.probes += 1
        return True


@pytest.fixture
def counting_torch(monkeypatch):
    """torch's probe with no CuPy, the probes' caches cleared before and after."""
    torch = CountingTorch()
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setattr(cuda, "usable_cupy", lambda: None)
    cuda.usable_torch.cache_clear()
    yield torch
    cuda.usable_torch.cache_clear()


def test_torch_is_asked_only_on_a_host_with_a_cuda_driver(counting_torch, monkeypatch, tmp_path):
    monkeypatch.setattr(cuda, "DRIVER_FILES", (str(tmp_path / "nvidiactl"), str(tmp_path / "dxg")))
    assert cuda.usable_torch() is None and cuda.cuda_available() is False
    assert counting_torch.probes == 0  # not imported, not asked
    cuda.usable_torch.cache_clear()
    (tmp_path / "dxg").touch()  # a driver's device file: now torch is asked, and answers
    assert cuda.usable_torch() is counting_torch and counting_torch.probes == 1


@pytest.mark.skipif(any(os.path.exists(p) for p in cuda.DRIVER_FILES), reason="a CUDA driver is present")
def test_a_unit_on_a_host_without_a_cuda_driver_never_imports_torch(tmp_path):
    """A unit's arena asks whether to page-lock itself: on a CPU host that costs no torch import."""
    code = ("import sys; from gputq.unit.storage_unit import StorageUnit; "
            f"StorageUnit('u', 1 << 20, shm_dir={str(tmp_path)!r}).close(); print(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('torch', 'cupy')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_page_lock_without_cuda_does_nothing(no_cuda):
    memory = np.zeros(4 * KIB, np.uint8)
    assert cuda.page_lock(memory.ctypes.data, memory.nbytes) is False
    cuda.host_unregister(memory.ctypes.data)  # nothing was registered: a no-op, not an error
    with pytest.raises(MissingDependencyError, match="CuPy or torch"):
        cuda.host_register(memory.ctypes.data, memory.nbytes, cuda.HOST_REGISTER_PORTABLE)


def test_page_lock_registers_through_cupy_and_unregisters(host_cuda):
    memory = np.zeros(4 * KIB, np.uint8)
    ptr = memory.ctypes.data
    assert cuda.page_lock(ptr, memory.nbytes, cuda.HOST_REGISTER_PORTABLE | cuda.HOST_REGISTER_MAPPED)
    assert _entries(host_cuda.log, "register") == [("register", ptr, memory.nbytes, 0x03)]
    cuda.host_unregister(ptr)
    assert _entries(host_cuda.log, "unregister") == [("unregister", ptr)]
    with pytest.raises(GputqError, match="cudaHostUnregister failed: cudaErrorHostMemoryNotRegistered"):
        cuda.host_unregister(ptr)


def test_a_refused_cupy_registration_is_a_gputq_error_with_the_reason_and_hint(host_cuda):
    host_cuda.refuse_registration = True
    memory = np.zeros(4 * KIB, np.uint8)
    with pytest.raises(GputqError) as caught:
        cuda.page_lock(memory.ctypes.data, memory.nbytes, hint="try less")
    message = str(caught.value)
    assert not isinstance(caught.value, RuntimeError)  # the stand-in's CUDARuntimeError is one
    assert f"cudaHostRegister of {memory.nbytes} bytes (flags 0x1) failed" in message
    assert "out of page-lockable memory" in message and message.endswith("; try less")


def test_a_refused_torch_registration_is_a_gputq_error_with_the_cuda_error(torch_cuda):
    memory = np.zeros(4 * KIB, np.uint8)
    ptr = memory.ctypes.data
    assert cuda.page_lock(ptr, memory.nbytes, cuda.HOST_REGISTER_DEFAULT) is True
    cuda.host_unregister(ptr)
    assert torch_cuda.calls == [("register", ptr, memory.nbytes, 0), ("unregister", ptr)]
    torch_cuda.register_error, torch_cuda.unregister_error = 2, 712
    with pytest.raises(GputqError, match=r"failed: CUDA error 2; use tmpfs$") as caught:
        cuda.page_lock(ptr, memory.nbytes, hint="use tmpfs")
    assert not isinstance(caught.value, RuntimeError)
    with pytest.raises(GputqError, match="cudaHostUnregister failed: CUDA error 712"):
        cuda.host_unregister(ptr)


# -- the arena -----------------------------------------------------------------------------------

def test_the_arena_is_page_locked_portable_and_unregistered_on_close(host_cuda, tmp_path):
    arena = Arena(64 * KIB, "pinned", shm_dir=str(tmp_path))
    address = arena.address
    assert arena.pinned
    assert _entries(host_cuda.log, "register") == [("register", address, 64 * KIB, cuda.HOST_REGISTER_PORTABLE)]
    arena.close()
    arena.close()
    assert not arena.pinned and _entries(host_cuda.log, "unregister") == [("unregister", address)]
    assert not os.listdir(tmp_path)


def test_an_arena_with_pin_false_registers_nothing(host_cuda, tmp_path):
    with Arena(16 * KIB, "plain", shm_dir=str(tmp_path), pin=False) as arena:
        assert not arena.pinned
    assert not _entries(host_cuda.log, "register") and not _entries(host_cuda.log, "unregister")


def test_an_arena_without_cuda_stays_pageable_silently(no_cuda, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    with Arena(16 * KIB, "pageable", shm_dir=str(tmp_path)) as arena:
        assert arena.pinned is False
        arena.array[:4] = [1, 2, 3, 4]
        assert arena.array[:4].tolist() == [1, 2, 3, 4]
    assert not caplog.records


def test_a_refused_arena_registration_raises_with_the_pinning_hint_and_leaves_no_file(host_cuda, tmp_path):
    host_cuda.refuse_registration = True
    with pytest.raises(GputqError) as caught:
        Arena(16 * KIB, "refused", shm_dir=str(tmp_path))
    message = str(caught.value)
    assert "cudaHostRegister of 16384 bytes (flags 0x1) failed" in message
    assert "out of page-lockable memory" in message
    assert "can only be pinned on tmpfs" in message and "pin=False" in message
    assert not os.listdir(tmp_path)


def test_a_refused_arena_registration_through_torch_has_the_hint_too(torch_cuda, tmp_path):
    torch_cuda.register_error = 1
    with pytest.raises(GputqError, match=r"CUDA error 1; a file-backed arena can only be pinned on tmpfs"):
        Arena(16 * KIB, "refused-torch", shm_dir=str(tmp_path))
    assert not os.listdir(tmp_path)


def test_an_arena_whose_unregister_fails_still_frees_its_file(host_cuda, tmp_path):
    arena = Arena(16 * KIB, "lost", shm_dir=str(tmp_path))
    cuda.host_unregister(arena.address)  # someone else unregistered it: the arena's own call fails
    with pytest.raises(GputqError, match="cudaHostUnregister failed"):
        arena.close()
    assert arena.closed and not arena.pinned and not os.listdir(tmp_path)


# -- the rdma pool -------------------------------------------------------------------------------

def test_the_pool_page_locks_its_host_buffers_and_unlocks_them_when_dropped(host_cuda):
    agent = RecordingAgent()
    pool = nixl_pool.BufferPool(agent)
    buf = pool.acquire(1000, nixl_pool.DRAM)
    assert pool.pinned == 1 and pool.registrations == 1 and agent.registered == [buf.ptr]
    assert _entries(host_cuda.log, "register") == [
        ("register", buf.ptr, nixl_pool.MIN_POOL_BYTES, cuda.HOST_REGISTER_DEFAULT)]
    pool.release(buf)
    pool.trim()
    assert agent.deregistered == [buf.ptr]
    assert _entries(host_cuda.log, "unregister") == [("unregister", buf.ptr)]


def test_a_refused_page_lock_leaves_the_pool_buffer_pageable_and_working(host_cuda, caplog):
    host_cuda.refuse_registration = True
    caplog.set_level(logging.INFO, logger=nixl_pool.__name__)
    pool = nixl_pool.BufferPool(RecordingAgent())
    with pool.lend(10) as view:
        view[:] = 7
        assert view.tolist() == [7] * 10
    assert pool.pinned == 0 and pool.registrations == 1
    assert [r.getMessage() for r in caplog.records] == [
        f"page-locking a {nixl_pool.MIN_POOL_BYTES}-byte pool buffer failed (cudaHostRegister of "
        f"{nixl_pool.MIN_POOL_BYTES} bytes (flags 0x0) failed: cudaErrorMemoryAllocation: out of "
        f"page-lockable memory); it stays unpinned"]
    pool.trim()
    assert not _entries(host_cuda.log, "unregister")  # never locked, never unlocked


def test_a_torch_refusal_in_the_pool_is_caught_as_a_gputq_error(torch_cuda, caplog):
    # Only GputqError is taken for "stays unpinned": a bare RuntimeError would fail this lend.
    torch_cuda.register_error = 2
    caplog.set_level(logging.INFO, logger=nixl_pool.__name__)
    pool = nixl_pool.BufferPool(RecordingAgent())
    with pool.lend(10) as view:
        view[:] = 1
    assert pool.pinned == 0 and "CUDA error 2" in caplog.text
    pool.trim()
    assert [call[0] for call in torch_cuda.calls] == ["register"]


def test_a_pool_buffer_nixl_refuses_is_unlocked_again(host_cuda):
    pool = nixl_pool.BufferPool(RecordingAgent(refuse=True))
    with pytest.raises(RuntimeError, match="NIXL: registration refused"):
        pool.acquire(1000, nixl_pool.DRAM)
    registered = _entries(host_cuda.log, "register")
    assert len(registered) == 1 and _entries(host_cuda.log, "unregister") == [("unregister", registered[0][1])]
    assert pool.registrations == 0


def test_the_pool_without_cuda_pins_nothing(no_cuda):
    pool = nixl_pool.BufferPool(RecordingAgent())
    with pool.lend(100) as view:
        assert view.nbytes == 100
    assert pool.pinned == 0 and pool.registrations == 1
    pool.trim()
