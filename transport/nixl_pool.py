"""The rdma backend's process-wide resources: the local NIXL agent and its memory.

A reader process has one NIXL agent (:class:`LocalAgent`, shared by all its
channels) and one :class:`BufferPool` beside it. The pool registers buffers with that agent
and reuses them: a NIXL READ into any byte of a pool buffer needs no
registration and no copy, whichever channel issues it. Buffers are lent
out whole (:meth:`BufferPool.lend`): the Reader stages a shard in one lent
buffer and several channels READ into disjoint slices of it at once.

Host buffers are page-locked with CUDA (:func:`gputq.transport.cuda.page_lock`)
where this process can run CUDA, so the host-to-device copy after a READ
into host memory runs at pinned speed; a refused page-lock leaves the
buffer pageable, which still works.

The CUDA helpers (:class:`CudaOps`) are imported lazily: only a device
buffer or a device destination reaches them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from gputq.errors import GputqError, InvalidInputError, MissingDependencyError
from gputq.transport.base import byte_view
from gputq.transport.cuda import HOST_REGISTER_DEFAULT, host_unregister, page_lock, usable_cupy, usable_torch
from gputq.transport.policy import infiniband_devices, load_nixl_api, local_hostname

__all__ = ["host_ptr", "import_nixl", "agent_name", "LocalAgent", "local_pool", "BufferPool", "CudaOps",
           "cuda_device_of", "MIN_POOL_BYTES", "DRAM", "DRAIN_S"]

_log = logging.getLogger(__name__)

#: Pool buffers start at this size and at least double, so a process whose
#: reads grow registers O(log(max read)) times in its lifetime.
MIN_POOL_BYTES = 1 << 20
#: The memory kind of host buffers: (NIXL memory type, device id).
DRAM = ("DRAM", 0)
#: Seconds the reader's worker is driven after it drops a unit's agent (see ``LocalAgent._drain``): long
#: enough for the unit's side of the closing handshake, short beside a channel's life.
DRAIN_S = 0.01
#: Seconds between two progress calls while draining: the unit's answer needs its own progress thread's turn.
_DRAIN_POLL_S = 0.001
_PAGE = 4096


def host_ptr(buf) -> tuple[int, int]:
    """Address and size of a writable, contiguous host buffer."""
    view = byte_view(buf, writable=True)
    return int(np.frombuffer(view, np.uint8).ctypes.data), view.nbytes


#: UCX's variable naming the transport modules it loads (``^ib``: all but InfiniBand).
UCX_MODULES_VAR = "UCX_MODULES"


def import_nixl():
    """Return ``(nixl_agent, nixl_agent_config, nixl_thread_sync_t)``.

    Raises
    ------
    MissingDependencyError
        NIXL is not installed or its native libraries do not load.
    """
    # NIXL logs INFO lines to stdout (one per agent); keep stdout clean for
    # --json tools unless the operator chose a level.
    quiet = "NIXL_LOG_LEVEL" not in os.environ
    if quiet:
        os.environ["NIXL_LOG_LEVEL"] = "WARN"
    if not infiniband_devices() and UCX_MODULES_VAR not in os.environ:
        # With the verbs library installed (Mooncake's bench needs it) and no InfiniBand device,
        # UCX still loads its ib module, which crashed every process with an agent at exit
        # (status 139, after its work was done). Where there is no device it has nothing to do.
        os.environ[UCX_MODULES_VAR] = "^ib"
    try:
        api = load_nixl_api()
    except Exception as exc:  # ImportError, or OSError from a native library
        raise MissingDependencyError(
            f"the rdma transport needs NIXL ({type(exc).__name__}: {exc}); "
            "pip install 'gputq[rdma]' (CUDA 13 hosts: pip install nixl-cu13), "
            "or use --transport tcp") from exc
    nixl_agent, nixl_agent_config, nixl_thread_sync_t = api.nixl_agent, api.nixl_agent_config, \
        api.nixl_thread_sync_t
    if quiet:  # NIXL may have been imported before the variable was set
        logging.getLogger("nixl").setLevel(logging.WARNING)
    return nixl_agent, nixl_agent_config, nixl_thread_sync_t


def agent_name(role: str) -> str:
    """A NIXL agent name unique across hosts, processes and calls."""
    return f"gputq-{role}-{local_hostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class _RawCuda:
    """A raw device range seen through ``__cuda_array_interface__``."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 3}


class CudaOps:
    """Allocate device buffers and copy between raw pointers (CuPy, else torch).

    Each call takes the modules the probes of :mod:`gputq.transport.cuda`
    return then (they are cached), never ones kept from before: the process's
    pool keeps its helper for good, and the probes may be run again (a test's
    CuPy stand-in, installed anew per test, forgets them).
    """

    def __init__(self):
        self._modules()  # refuse at once where neither can run

    @staticmethod
    def _modules() -> tuple[Any, Any]:
        cp, torch = usable_cupy(), usable_torch()
        if cp is None and torch is None:
            raise MissingDependencyError(
                "a CUDA destination needs CuPy or torch with a device: pip install cupy-cuda12x")
        return cp, torch

    def alloc(self, nbytes: int, device: int) -> tuple[Any, int]:
        """A device uint8 array of ``nbytes`` on ``device`` and its address."""
        cp, torch = self._modules()
        if cp is not None:
            with cp.cuda.Device(device):
                arr = cp.empty(nbytes, dtype=cp.uint8)
            return arr, int(arr.data.ptr)
        arr = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
        return arr, int(arr.data_ptr())

    def copy(self, dst: int, src: int, nbytes: int, device: int, src_host: bool) -> None:
        """Blocking copy of ``nbytes`` into device memory ``dst``."""
        cp, torch = self._modules()
        if cp is not None:
            rt = cp.cuda.runtime
            kind = rt.memcpyHostToDevice if src_host else rt.memcpyDeviceToDevice
            with cp.cuda.Device(device):
                rt.memcpy(dst, src, nbytes, kind)
                rt.deviceSynchronize()  # cudaMemcpy D2D does not wait for the copy
            return
        out = torch.as_tensor(_RawCuda(dst, nbytes), device=f"cuda:{device}")
        if src_host:
            import ctypes
            host = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(src))
            out.copy_(torch.from_numpy(host))
        else:
            out.copy_(torch.as_tensor(_RawCuda(src, nbytes), device=f"cuda:{device}"))
        torch.cuda.synchronize(device)


def cuda_device_of(buf, ptr: int) -> int:
    """The CUDA device of a device buffer at ``ptr`` (CuPy array, torch tensor, or anything CuPy can query)."""
    device = getattr(buf, "device", None)
    for attr in ("id", "index"):  # CuPy arrays, torch tensors
        value = getattr(device, attr, None)
        if isinstance(value, int):
            return value
    try:
        import cupy
        return int(cupy.cuda.runtime.pointerGetAttributes(ptr).device)
    except Exception as exc:
        raise InvalidInputError(f"cannot tell the CUDA device of {type(buf).__name__}: {exc}") from exc


@dataclass(eq=False)  # identity equality: records hold arrays
class _PoolBuffer:
    ptr: int
    nbytes: int
    kind: tuple[str, int]
    obj: Any  # the numpy / CuPy / torch array that owns the memory
    descs: Any  # NIXL registration, for deregister_memory
    pinned: bool = False


class BufferPool:
    """Registered buffers of one NIXL agent, reused across reads and channels.

    One free list per memory kind (``("DRAM", 0)`` or ``("VRAM", device)``).
    :meth:`acquire` hands out the smallest free buffer that fits; when none
    does, smaller free buffers are dropped and a new one is registered, a
    power of two: twice the largest size seen for a read larger than it (a
    process whose reads grow registers O(log(max read)) times), else the
    read's own size (the buffers that fit are all lent out). Thread-safe.

    Attributes
    ----------
    registrations : int
        Calls to NIXL's ``register_memory`` so far (for tests and stats).
    registered_bytes : int
        Bytes of the buffers registered now, lent out or free.
    pinned : int
        Host buffers page-locked with CUDA so far.
    """

    def __init__(self, agent):
        self._agent = agent
        self._lock = threading.Lock()
        self._free: dict[tuple[str, int], list[_PoolBuffer]] = {}
        self._all: list[_PoolBuffer] = []
        self._largest: dict[tuple[str, int], int] = {}
        self._cuda: CudaOps | None = None
        self.registrations = 0
        self.registered_bytes = 0
        self.pinned = 0

    def acquire(self, nbytes: int, kind: tuple[str, int]) -> _PoolBuffer:
        """Return a registered buffer of at least ``nbytes``, owned by the caller until :meth:`release`."""
        with self._lock:
            free = self._free.setdefault(kind, [])
            fits = [b for b in free if b.nbytes >= nbytes]
            if fits:
                buf = min(fits, key=lambda b: b.nbytes)
                free.remove(buf)
                return buf
            for small in free:
                self._drop(small)
            free.clear()
            largest = self._largest.get(kind, 0)
            # Only a read that outgrew every buffer doubles the largest; one that finds the buffers of its
            # size all lent out (concurrent streams and fetches) takes its own size, or each such lender
            # would double it again.
            size = max(MIN_POOL_BYTES, nbytes, 2 * largest if nbytes > largest else 0)
            size = 1 << (size - 1).bit_length()
            buf = self._register(size, kind)
            self._largest[kind] = max(size, largest)
            return buf

    def release(self, buf: _PoolBuffer) -> None:
        """Return a buffer from :meth:`acquire` to the free list."""
        with self._lock:
            free = self._free.setdefault(buf.kind, [])
            if buf in self._all and buf not in free:
                free.append(buf)

    def discard(self, buf: _PoolBuffer) -> None:
        """Deregister a buffer instead of reusing it (a failed transfer may still write it)."""
        with self._lock:
            if buf in self._all:
                self._drop(buf)

    def find(self, ptr: int, nbytes: int) -> tuple[str, int] | None:
        """The kind of the pool buffer containing ``[ptr, ptr + nbytes)``, else ``None``."""
        with self._lock:
            for buf in self._all:
                if buf.ptr <= ptr and ptr + nbytes <= buf.ptr + buf.nbytes:
                    return buf.kind
        return None

    @contextlib.contextmanager
    def lend(self, nbytes: int, kind: tuple[str, int] = DRAM):
        """Lend a view of ``nbytes`` of one registered buffer for the ``with`` block.

        A READ into any slice of it lands there directly. The view must not
        be used after the block: the buffer goes back to the pool and the
        next lender gets it.
        """
        if not isinstance(nbytes, (int, np.integer)) or isinstance(nbytes, bool) or nbytes < 0:
            raise InvalidInputError(f"nbytes must be an int >= 0, got {nbytes!r}")
        buf = self.acquire(max(int(nbytes), 1), kind)
        try:
            yield buf.obj[:int(nbytes)]
        finally:
            self.release(buf)

    def cuda(self) -> CudaOps:
        """The CUDA helper (created on first use)."""
        if self._cuda is None:
            self._cuda = CudaOps()
        return self._cuda

    def trim(self) -> None:
        """Deregister and free every buffer not lent out now."""
        with self._lock:
            for kind, free in self._free.items():
                for buf in free:
                    self._drop(buf)
                free.clear()
                if not any(b.kind == kind for b in self._all):
                    self._largest.pop(kind, None)

    def _register(self, size: int, kind: tuple[str, int]) -> _PoolBuffer:
        mem, device = kind
        pinned = False
        if mem == "VRAM":
            obj, ptr = self.cuda().alloc(size, device)
        else:
            raw = np.empty(size + _PAGE, dtype=np.uint8)
            start = (-raw.ctypes.data) % _PAGE
            obj = raw[start:start + size]
            ptr = int(obj.ctypes.data)
            pinned = self._pin(ptr, size)
        try:
            descs = self._agent.register_memory(np.array([[ptr, size, device]], dtype=np.uint64), mem)
        except BaseException:
            if pinned:
                self._unpin(ptr)
            raise
        self.registrations += 1
        self.registered_bytes += size
        buf = _PoolBuffer(ptr, size, kind, obj, descs, pinned)
        self._all.append(buf)
        return buf

    def _pin(self, ptr: int, size: int) -> bool:
        try:
            pinned = page_lock(ptr, size, HOST_REGISTER_DEFAULT)
        except GputqError as exc:  # e.g. the process's page-lock limit: unpinned still works
            _log.info("page-locking a %d-byte pool buffer failed (%s); it stays unpinned", size, exc)
            return False
        if pinned:
            self.pinned += 1
        return pinned

    def _unpin(self, ptr: int) -> None:
        try:
            host_unregister(ptr)
        except GputqError as exc:  # best effort: the memory is freed either way
            _log.warning("unpinning a pool buffer failed: %s", exc)

    def _drop(self, buf: _PoolBuffer) -> None:
        self._all.remove(buf)
        self.registered_bytes -= buf.nbytes
        try:
            self._agent.deregister_memory(buf.descs)
        except Exception:  # deregistering at interpreter exit is best effort
            pass
        if buf.pinned:
            self._unpin(buf.ptr)


class LocalAgent:
    """The reader side's NIXL agent: one per process, shared by all channels.

    Its progress thread is off (the reader polls: no thread hand-off per
    transfer) and its sync mode is RW, so channels may use it from many threads.
    Remote agents are reference-counted: two channels to one unit share it.
    ``pool`` holds the process's registered destination buffers; it keeps
    them while a channel is open (or a buffer lent) and frees the idle ones
    when the last channel closes. A channel collected unclosed counts as
    closed from the next channel's close on.
    """

    _instance: "LocalAgent | None" = None
    _create_lock = threading.Lock()

    def __init__(self):
        nixl_agent, nixl_agent_config, sync = import_nixl()
        self.name = agent_name("reader")
        self.agent = nixl_agent(self.name, nixl_agent_config(
            enable_prog_thread=False, backends=["UCX"], sync_mode=sync.NIXL_THREAD_SYNC_RW))
        if "UCX" not in self.agent.backends:
            raise MissingDependencyError("NIXL has no UCX plugin here; use --transport tcp")
        self._lock = threading.Lock()
        self._remotes: dict[str, int] = {}
        self._channels = 0
        # The remotes of channels collected unclosed, put by their finalizers: a SimpleQueue's put is safe
        # wherever a garbage collection runs them (inside this agent's lock too); removed at the next close.
        self._dropped: queue.SimpleQueue = queue.SimpleQueue()
        self.pool = BufferPool(self.agent)

    @classmethod
    def get(cls) -> "LocalAgent":
        with cls._create_lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def add_remote(self, metadata: bytes) -> str:
        """Add a channel's unit; returns the remote agent's name."""
        with self._lock:
            name = self.agent.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else name
            self._remotes[name] = self._remotes.get(name, 0) + 1
            self._channels += 1
            return name

    def dropped(self, name: str) -> None:
        """A channel collected unclosed (its finalizer): removed as :meth:`remove_remote` does, at the next one."""
        self._dropped.put(name)

    def remove_remote(self, name: str) -> None:
        """A channel closed: drop its unit's agent when unused, trim the pool after the last; the same first for
        the channels collected unclosed since the last call."""
        self._remove_dropped()
        self._remove(name)

    def _remove_dropped(self) -> None:
        while True:
            try:
                name = self._dropped.get_nowait()
            except queue.Empty:
                return
            self._remove(name)

    def _remove(self, name: str) -> None:
        with self._lock:
            self._channels -= 1
            last_channel = self._channels == 0
            left = self._remotes.get(name, 0) - 1
            if left > 0:
                self._remotes[name] = left
                name = None
            else:
                self._remotes.pop(name, None)
        if name is not None:
            try:
                self.agent.remove_remote_agent(name)
                self._drain()
            except Exception:  # the agent may already be gone at interpreter exit
                pass
        if last_channel:
            self.pool.trim()

    def _drain(self) -> None:
        """Drive the worker for :data:`DRAIN_S`, so that the endpoints to a unit just dropped finish closing while
        it still answers.

        UCX closes them in the background, and with no progress thread this
        worker moves only while the reader transfers: left alone, an
        endpoint whose wire-up was still under way stays half open until its
        unit goes, is then reconnected at the next transfer, refused, and
        left in a state whose teardown can abort the process.
        """
        deadline = time.monotonic() + DRAIN_S
        while True:
            self.agent.get_new_notifs()  # the reader expects no notifications: this only progresses the worker
            if time.monotonic() >= deadline:
                return
            time.sleep(_DRAIN_POLL_S)


def local_pool() -> BufferPool:
    """The process-wide pool of registered destination buffers (starts the local NIXL agent).

    Raises
    ------
    MissingDependencyError
        NIXL or its UCX plugin is not available.
    """
    return LocalAgent.get().pool
