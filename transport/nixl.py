"""The rdma backend: one-sided NIXL READs out of a StorageUnit's arena.

Data plane: the unit registers its arena with a NIXL agent once, at start.
A reader process owns one NIXL agent (shared by all its channels) and a pool
of registered destination buffers per channel, reused across reads, so no
memory is registered per request. One read is one NIXL READ whose
descriptor list covers every region of every key, built with numpy.

Control plane: the tcp backend. The unit serves tcp beside NIXL, and a
:class:`NixlChannel` reaches the unit's lease/end-lease and writes through a
:class:`~transport.tcp.TcpChannel`. The server wraps the handler so that
``nixl_lease`` / ``nixl_end_lease`` control calls reach
:meth:`ArenaHandler.lease` / :meth:`ArenaHandler.end_lease` (any handler
works; the StorageUnit needs no NIXL-specific control method). A read holds
a lease from before the READ is posted until it completed, so the unit
never frees or reuses a region while NIXL reads it, and a read racing a
release returns the right bytes or a typed error, never another key's
bytes. The lease's generations are not re-checked after the transfer: the
handler protocol has no generation lookup, so it would cost another round
trip, and the lease already rules the reuse out. Leases end on a background
thread, off the read's latency.

GPU destinations: where a NIC can DMA into GPU memory (GPUDirect, see
:func:`transport.policy.gpudirect_support`) the READ lands in a registered
device buffer; elsewhere it lands in host memory and one copy moves it to
the device (on one H200 host: 4 GB/s that way, 0.7 GB/s when UCX stages
device destinations itself).

Writes take the tcp path below :data:`PUSH_MIN_BYTES` and are pushed
above it: the push copies the payload into a registered staging buffer and
NIXL-WRITEs it into the region reserved by a control call, then commits. It
costs two more control round trips than tcp's single WRITE frame
(``recv_into`` straight into the arena), which loses for small payloads,
but moved bytes ~1.8x faster from 4 MiB on on the 2-core dev box; in the
gVisor sandbox of the GPU host the push lost at every size, so
``GPUTQ_RDMA_WRITE_PATH=tcp`` (or ``write_path``) forces the tcp path
(docs/operations.md has both tables).
"""

from __future__ import annotations

import contextlib
import logging
import operator
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from transport.base import ArenaHandler, Channel, Server, TransportType, is_device_buffer
from transport.errors import (
    ClosedError,
    GputqTimeoutError,
    InvalidInputError,
    MissingDependencyError,
    RequestTooLargeError,
    TransferError,
)
from transport.policy import gpudirect_support, infiniband_devices, local_hostname
from transport.staging import device_nbytes
from transport.tcp import TcpTransport
from transport.wire import byte_view

_log = logging.getLogger(__name__)

__all__ = ["NixlTransport", "NixlServer", "NixlChannel", "BufferPool", "import_nixl",
           "PUSH_MIN_BYTES", "PUSH_CHUNK_BYTES", "WRITE_PATH_ENV"]

#: Control methods the server adds in front of the handler's own.
LEASE, END_LEASE = "nixl_lease", "nixl_end_lease"
BEGIN_WRITE, COMMIT_WRITE, ABORT_WRITE = "nixl_begin_write", "nixl_commit_write", "nixl_abort_write"
WRITE_PATHS = ("auto", "tcp", "push")
#: ``write_path="auto"`` pushes payloads of at least this size with NIXL WRITE.
#: Measured on loopback (cma): tcp wins below ~1 MiB (one control round trip
#: against three), push wins above (2 MiB: 6.3 vs 3.2 GB/s; 128 MiB: 5.1 vs 3.0).
PUSH_MIN_BYTES = 1 << 20
#: Environment variable choosing the write path of channels built by default.
WRITE_PATH_ENV = "GPUTQ_RDMA_WRITE_PATH"
#: Staging chunk of a push: bounds the registered memory a writer holds.
PUSH_CHUNK_BYTES = 16 << 20

# Pool buffers start at this size and at least double, so a reader whose
# reads grow registers O(log(max read)) times in its lifetime.
_MIN_POOL_BYTES = 1 << 20
_PAGE = 4096
_SERVER_PROGRESS_S = 0.001


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
    try:
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
    except Exception as exc:  # ImportError, or OSError from a native library
        raise MissingDependencyError(
            f"the rdma transport needs NIXL ({type(exc).__name__}: {exc}); "
            "pip install nixl-cu12 (or nixl-cu13), or use --transport tcp") from exc
    if quiet:  # NIXL may have been imported before the variable was set
        logging.getLogger("nixl").setLevel(logging.WARNING)
    return nixl_agent, nixl_agent_config, nixl_thread_sync_t


def _agent_name(role: str) -> str:
    return f"gputq-{role}-{local_hostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _host_ptr(buf) -> tuple[int, int]:
    """Address and size of a writable, contiguous host buffer."""
    view = byte_view(buf, writable=True)
    return int(np.frombuffer(view, np.uint8).ctypes.data), view.nbytes


# -- CUDA helpers (lazy: only a CUDA destination reaches them) -----------------

class _RawCuda:
    """A raw device range seen through ``__cuda_array_interface__``."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 3}


def _cuda_device_of(buf, ptr: int) -> int:
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


class _Cuda:
    """Allocate device buffers and copy between raw pointers (CuPy, else torch)."""

    def __init__(self):
        try:
            import cupy
            cupy.cuda.runtime.getDeviceCount()
            self._cp, self._torch = cupy, None
        except Exception:
            try:
                import torch
            except ImportError as exc:
                raise MissingDependencyError(
                    "a CUDA destination needs CuPy or torch: pip install cupy-cuda12x") from exc
            self._cp, self._torch = None, torch

    def alloc(self, nbytes: int, device: int) -> tuple[Any, int]:
        if self._cp is not None:
            with self._cp.cuda.Device(device):
                arr = self._cp.empty(nbytes, dtype=self._cp.uint8)
            return arr, int(arr.data.ptr)
        arr = self._torch.empty(nbytes, dtype=self._torch.uint8, device=f"cuda:{device}")
        return arr, int(arr.data_ptr())

    def copy(self, dst: int, src: int, nbytes: int, device: int, src_host: bool) -> None:
        """Blocking copy of ``nbytes`` into device memory ``dst``."""
        if self._cp is not None:
            rt = self._cp.cuda.runtime
            kind = rt.memcpyHostToDevice if src_host else rt.memcpyDeviceToDevice
            with self._cp.cuda.Device(device):
                rt.memcpy(dst, src, nbytes, kind)
                rt.deviceSynchronize()  # cudaMemcpy D2D does not wait for the copy
            return
        torch = self._torch
        out = torch.as_tensor(_RawCuda(dst, nbytes), device=f"cuda:{device}")
        if src_host:
            import ctypes
            host = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(src))
            out.copy_(torch.from_numpy(host))
        else:
            out.copy_(torch.as_tensor(_RawCuda(src, nbytes), device=f"cuda:{device}"))
        torch.cuda.synchronize(device)


# -- the local agent ------------------------------------------------------------

class _LocalAgent:
    """The reader side's NIXL agent: one per process, shared by all channels.

    Its progress thread is off (the reader polls, which is faster measured
    here) and its sync mode is RW, so channels may use it from many threads.
    Remote agents are reference-counted: two channels to one unit share it.
    """

    _instance: "_LocalAgent | None" = None
    _create_lock = threading.Lock()

    def __init__(self):
        nixl_agent, nixl_agent_config, sync = import_nixl()
        self.name = _agent_name("reader")
        self.agent = nixl_agent(self.name, nixl_agent_config(
            enable_prog_thread=False, backends=["UCX"], sync_mode=sync.NIXL_THREAD_SYNC_RW))
        if "UCX" not in self.agent.backends:
            raise MissingDependencyError("NIXL has no UCX plugin here; use --transport tcp")
        self._lock = threading.Lock()
        self._remotes: dict[str, int] = {}

    @classmethod
    def get(cls) -> "_LocalAgent":
        with cls._create_lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def add_remote(self, metadata: bytes) -> str:
        with self._lock:
            name = self.agent.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else name
            self._remotes[name] = self._remotes.get(name, 0) + 1
            return name

    def remove_remote(self, name: str) -> None:
        with self._lock:
            left = self._remotes.get(name, 0) - 1
            if left > 0:
                self._remotes[name] = left
                return
            self._remotes.pop(name, None)
        try:
            self.agent.remove_remote_agent(name)
        except Exception:  # the agent may already be gone at interpreter exit
            pass


@dataclass(eq=False)  # identity equality: records hold arrays
class _PoolBuffer:
    ptr: int
    nbytes: int
    kind: tuple[str, int]
    obj: Any  # the numpy / CuPy / torch array that owns the memory
    descs: Any  # NIXL registration, for deregister_memory


class BufferPool:
    """Registered destination buffers, reused across reads.

    One free list per memory kind (``("DRAM", 0)`` or ``("VRAM", device)``).
    :meth:`acquire` hands out the smallest free buffer that fits; when none
    does, smaller free buffers are dropped and a new one of at least twice
    the largest size seen is registered. ``registrations`` counts calls to
    NIXL's ``register_memory``, for tests and stats.
    """

    def __init__(self, agent):
        self._agent = agent
        self._lock = threading.Lock()
        self._free: dict[tuple[str, int], list[_PoolBuffer]] = {}
        self._all: list[_PoolBuffer] = []
        self._largest: dict[tuple[str, int], int] = {}
        self._cuda: _Cuda | None = None
        self.registrations = 0

    def acquire(self, nbytes: int, kind: tuple[str, int]) -> _PoolBuffer:
        """Return a registered buffer of at least ``nbytes``."""
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
            size = max(_MIN_POOL_BYTES, 2 * self._largest.get(kind, 0), nbytes)
            size = 1 << (size - 1).bit_length()
            buf = self._register(size, kind)
            self._largest[kind] = max(size, self._largest.get(kind, 0))
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

    def buffer(self, buf: _PoolBuffer, nbytes: int):
        """A uint8 view of the first ``nbytes`` of a pool buffer (numpy or device array)."""
        return buf.obj[:nbytes]

    def cuda(self) -> _Cuda:
        if self._cuda is None:
            self._cuda = _Cuda()
        return self._cuda

    def close(self) -> None:
        with self._lock:
            for buf in list(self._all):
                self._drop(buf)
            self._free.clear()

    def _register(self, size: int, kind: tuple[str, int]) -> _PoolBuffer:
        mem, device = kind
        if mem == "VRAM":
            obj, ptr = self.cuda().alloc(size, device)
        else:
            raw = np.empty(size + _PAGE, dtype=np.uint8)
            start = (-raw.ctypes.data) % _PAGE
            obj = raw[start:start + size]
            ptr = int(obj.ctypes.data)
        descs = self._agent.register_memory(np.array([[ptr, size, device]], dtype=np.uint64), mem)
        self.registrations += 1
        buf = _PoolBuffer(ptr, size, kind, obj, descs)
        self._all.append(buf)
        return buf

    def _drop(self, buf: _PoolBuffer) -> None:
        self._all.remove(buf)
        try:
            self._agent.deregister_memory(buf.descs)
        except Exception:  # deregistering at interpreter exit is best effort
            pass


# -- server side -------------------------------------------------------------------

_OFFSET = operator.attrgetter("offset")
_NBYTES = operator.attrgetter("nbytes")


class _LeaseControl:
    """The handler as the tcp server sees it: NIXL's control calls added in front.

    Everything else (writes, the handler's own control methods) is delegated
    unchanged, so the tcp path of an rdma unit behaves exactly like a tcp unit.
    """

    def __init__(self, handler: ArenaHandler):
        self._handler = handler
        self.name = handler.name

    @property
    def arena(self) -> memoryview:
        return self._handler.arena

    def __getattr__(self, attr):  # begin_write, commit_write, lease, ...
        return getattr(self._handler, attr)

    def control(self, method: str, args: dict) -> Any:
        h = self._handler
        if method == LEASE:
            lease = h.lease(list(args["keys"]))
            # Regions travel as raw little-endian int64 (offset, length) rows:
            # packing, unpacking and converting 1024 [offset, length] lists
            # costs ~200 us, this ~60 us.
            n = len(lease.regions)
            regions = np.empty((n, 2), dtype="<i8")
            regions[:, 0] = np.fromiter(map(_OFFSET, lease.regions), dtype="<i8", count=n)
            regions[:, 1] = np.fromiter(map(_NBYTES, lease.regions), dtype="<i8", count=n)
            return {"lease_id": lease.lease_id, "regions": regions.tobytes()}
        if method == END_LEASE:
            for lease_id in args["lease_ids"]:
                h.end_lease(int(lease_id))
            return None
        if method == BEGIN_WRITE:
            return h.begin_write(args["key"], int(args["nbytes"]), dict(args.get("meta") or {}),
                                 args.get("wait_s"))
        if method == COMMIT_WRITE:
            return h.commit_write(args["key"])
        if method == ABORT_WRITE:
            h.abort_write(args["key"])
            return None
        return h.control(method, args)


class NixlServer(Server):
    """Serves one arena: registered with NIXL once, control over tcp.

    The address holds ``transport`` (``"rdma"``), ``unit``, ``control`` (the
    tcp server's address: a tcp client of this unit connects with it),
    ``agent``, ``agent_metadata`` (bytes), ``arena_base``, ``arena_nbytes``,
    ``hostname`` and ``ib_devices`` (what :mod:`transport.policy` looks at).
    """

    def __init__(self, handler: ArenaHandler, *, host: str, port: int, token: str,
                 max_frame_bytes: int):
        nixl_agent, nixl_agent_config, sync = import_nixl()
        self._closed = False
        self._reg = None
        self._tcp = None
        name = _agent_name(f"unit-{handler.name}")
        # The target side must make progress for connection wire-up (and for
        # every transfer on UCX's tcp lane). NIXL's own progress thread spins
        # without pause and holds a full core even when idle (measured: 2.0 s
        # of CPU per 2 s idle), which a unit cannot afford next to its tcp
        # server; a thread progressing every millisecond costs ~5% of a core.
        self._agent = nixl_agent(name, nixl_agent_config(
            enable_prog_thread=False, backends=["UCX"], sync_mode=sync.NIXL_THREAD_SYNC_RW))
        self._stop = threading.Event()
        self._progress = threading.Thread(target=self._progress_loop, name=f"gputq-nixl-{handler.name}",
                                          daemon=True)
        self._progress.start()
        try:
            base, nbytes = _host_ptr(handler.arena)
            if nbytes:
                self._reg = self._agent.register_memory(
                    np.array([[base, nbytes, 0]], dtype=np.uint64), "DRAM")
            self._tcp = TcpTransport().serve(_LeaseControl(handler), host=host, port=port,
                                             token=token, max_frame_bytes=max_frame_bytes)
            self._address = dict(transport="rdma", unit=handler.name, control=self._tcp.address, agent=name,
                                 agent_metadata=self._agent.get_agent_metadata(),
                                 arena_base=base, arena_nbytes=nbytes,
                                 hostname=local_hostname(), ib_devices=infiniband_devices())
        except BaseException:
            self.close()
            raise

    @property
    def address(self) -> dict:
        return dict(self._address)

    def _progress_loop(self) -> None:
        while not self._stop.wait(_SERVER_PROGRESS_S):
            try:
                self._agent.get_new_notifs()  # drives the UCX worker
            except Exception:  # a failing poll must not kill the unit; the reader sees the error
                pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._progress.join()
        if self._tcp is not None:
            self._tcp.close()
        if self._reg is not None:
            try:
                self._agent.deregister_memory(self._reg)
            except Exception:  # best effort during teardown
                pass
            self._reg = None


# -- client side -----------------------------------------------------------------------

def _describe(keys: Sequence[str]) -> str:
    shown = ", ".join(repr(k) for k in list(keys)[:4])
    return f"[{shown}{', ...' if len(keys) > 4 else ''}] ({len(keys)} keys)"


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)


def _descriptors(regions: np.ndarray, local_base: int, remote_base: int, device: int):
    """Nx3 (address, length, device) local and remote descriptor arrays for ``regions``.

    Regions are packed back to back from ``local_base``. Runs of regions that
    also follow each other in the arena (keys written in sequence usually do)
    become one descriptor: UCX moves one large block faster than many
    adjacent small ones (1024 x 16 KiB: 3.3 ms as 1024 descriptors, 2.3 ms
    merged, measured here).
    """
    regions = regions[regions[:, 1] > 0]
    if not len(regions):
        empty = np.empty((0, 3), dtype=np.uint64)
        return empty, empty
    offsets, lengths = regions[:, 0], regions[:, 1]
    starts = np.concatenate(([True], offsets[1:] != offsets[:-1] + lengths[:-1]))
    first = np.flatnonzero(starts)
    merged = np.add.reduceat(lengths, first)
    local = np.empty((len(first), 3), dtype=np.uint64)
    local[:, 0] = local_base + (np.cumsum(lengths) - lengths)[first]
    local[:, 1] = merged
    local[:, 2] = device
    remote = local.copy()
    remote[:, 0] = remote_base + offsets[first]
    remote[:, 2] = 0
    return local, remote


# Cleanup calls (end_lease, abort_write) must reach the unit even after the
# caller's deadline expired, but must not hang forever on a lost unit.
_CLEANUP_TIMEOUT_S = 5.0


class _LeaseEnder:
    """Ends a channel's leases on a background thread, off the read path.

    A read's data is complete once its READ is done; waiting for the unit to
    acknowledge end_lease would add a control round trip to every read.
    Leases queued meanwhile are ended in one call. :meth:`close` ends every
    queued lease before returning. A failed end_lease is logged: the unit
    keeps those regions pinned, which wastes space but never corrupts a read.
    """

    def __init__(self, tcp, unit: str):
        self._tcp = tcp
        self._unit = unit
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"gputq-nixl-end-lease-{unit}", daemon=True)
        self._thread.start()

    def end(self, lease_id: int) -> None:
        self._queue.put(lease_id)

    def _run(self) -> None:
        stop = False
        while not stop:
            ids = [self._queue.get()]
            while True:
                try:
                    ids.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = None in ids
            ids = [i for i in ids if i is not None]
            if not ids:
                continue
            try:
                self._tcp.call(END_LEASE, timeout=_CLEANUP_TIMEOUT_S, lease_ids=ids)
            except Exception as exc:
                _log.warning("unit %s: could not end leases %s: %s", self._unit, ids, exc)

    def close(self) -> None:
        """End every queued lease, then stop. Idempotent."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()


class NixlChannel(Channel):
    """A client of one unit: NIXL READs for data, tcp for control.

    Build it with :meth:`NixlTransport.connect`. Thread-safe: each read takes
    its own pool buffer, the tcp channel pools connections and the shared
    NIXL agent runs in RW sync mode.

    Attributes
    ----------
    pool : BufferPool
        The channel's registered destination buffers (``pool.registrations``
        counts registrations).
    """

    def __init__(self, address: dict, *, token: str, max_frame_bytes: int,
                 timeout: float | None = None, write_path: str = "auto"):
        if address.get("transport") != "rdma" or "agent_metadata" not in address:
            raise InvalidInputError(f"not an rdma address (no NIXL agent metadata): {sorted(address)}")
        self._closed = False
        self._local = _LocalAgent.get()
        self._write_path = write_path
        self._base = int(address["arena_base"])
        self._arena_nbytes = int(address["arena_nbytes"])
        # READ straight into GPU memory only where a NIC can DMA there; else
        # UCX stages in software (0.7 GB/s on one H200 host, against 4 GB/s
        # for READ into host memory plus a host-to-device copy). None: try
        # on the first CUDA read, fall back for good if NIXL refuses.
        self._vram_direct: bool | None = None if gpudirect_support()[0] else False
        self._tcp = TcpTransport().connect(address["control"], token=token,
                                           max_frame_bytes=max_frame_bytes, timeout=timeout)
        self.unit = self._tcp.unit
        try:
            self._remote = self._local.add_remote(address["agent_metadata"])
        except Exception as exc:
            self._tcp.close()
            raise TransferError(f"cannot add the NIXL agent of unit {self.unit}: {exc}", self.unit) from exc
        self.pool = BufferPool(self._local.agent)
        self._ender = _LeaseEnder(self._tcp, self.unit)

    # -- reads -------------------------------------------------------------------------

    def read(self, keys: Sequence[str], dest, timeout: float | None = None) -> list[int]:
        """Read ``keys`` back to back into ``dest`` with one NIXL READ.

        ``dest`` may be host memory, a CUDA buffer, or a view from
        :meth:`staging` (then the READ lands in it directly, with no copy).

        Raises
        ------
        UnknownKeyError
            A key is not stored on the unit.
        RequestTooLargeError
            ``dest`` is smaller than the keys' bytes.
        GputqTimeoutError
            The lease, transfer or completion outlasted ``timeout``.
        TransferError
            NIXL failed the transfer; names the unit and the keys.
        """
        self._check_open()
        keys = list(keys)
        deadline = None if timeout is None else time.monotonic() + timeout
        on_device = is_device_buffer(dest)
        if on_device:
            ptr = int(dest.__cuda_array_interface__["data"][0])
            capacity = device_nbytes(dest)
            device = _cuda_device_of(dest, ptr)
        else:
            ptr, capacity = _host_ptr(dest)
            device = 0
        if not keys:
            return []
        lease = self._tcp.call(LEASE, timeout=_left(deadline), keys=keys)
        try:
            regions = np.frombuffer(lease["regions"], dtype="<i8").reshape(len(keys), 2).astype(np.int64)
            lengths = regions[:, 1]
            total = int(lengths.sum())
            if total > capacity:
                raise RequestTooLargeError(
                    f"read of {len(keys)} keys from {self.unit} needs {total} bytes, dest holds {capacity}")
            if int((regions[:, 0] + lengths).max()) > self._arena_nbytes or int(regions.min()) < 0:
                raise TransferError(f"unit {self.unit} leased regions outside its arena for keys "
                                    f"{_describe(keys)}", self.unit, keys)
            staged = self._read_leased(keys, regions, total, ptr, device, on_device, deadline)
        except BaseException:
            self._ender.end(lease["lease_id"])
            raise
        self._ender.end(lease["lease_id"])
        if staged is not None:  # the copy runs after end_lease: the pool buffer is ours
            buf, kind = staged
            try:
                self._copy_out(buf, kind, ptr, dest, total, device, on_device)
            finally:
                self.pool.release(buf)
        return lengths.tolist()

    def _read_leased(self, keys, regions, total, ptr, device, on_device, deadline):
        """READ the leased regions; return ``(pool buffer, kind)`` when a copy-out is due."""
        direct = self.pool.find(ptr, total)
        if direct is not None and (direct[0] == "DRAM" or self._vram_direct is not False):
            try:
                self._transfer("READ", keys, regions, ptr, direct, deadline)
            except _SetupError:
                if direct[0] == "DRAM":
                    raise
                self._vram_direct = False  # device staging view: go through host memory below
            else:
                if direct[0] == "VRAM":
                    self._vram_direct = True
                return None
        if on_device and self._vram_direct is not False:
            staged = self._read_into_vram(keys, regions, total, device, deadline)
            if staged is not None:
                return staged
        kind = ("DRAM", 0)
        buf = self.pool.acquire(total, kind)
        self._read_into(buf, keys, regions, kind, deadline)
        return buf, kind

    def _read_into_vram(self, keys, regions, total, device, deadline):
        """READ straight into device memory, or ``None`` when this UCX cannot.

        The wheel's UCX reads into GPU memory over InfiniBand with GPUDirect;
        other lanes may refuse the registration or the transfer, and then
        every later read of this channel stages through host memory.
        """
        kind = ("VRAM", device)
        try:
            buf = self.pool.acquire(total, kind)
        except Exception as exc:  # no CUDA-aware UCX, or no device memory
            _log.info("unit %s: no device registration (%s); staging through host memory", self.unit, exc)
            self._vram_direct = False
            return None
        try:
            self._read_into(buf, keys, regions, kind, deadline)
        except _SetupError as exc:
            _log.info("unit %s: NIXL cannot READ into device memory (%s); staging through host memory",
                      self.unit, exc)
            self._vram_direct = False
            return None
        self._vram_direct = True
        return buf, kind

    def _read_into(self, buf: _PoolBuffer, keys, regions, kind, deadline) -> None:
        try:
            self._transfer("READ", keys, regions, buf.ptr, kind, deadline)
        except _SetupError:
            self.pool.release(buf)  # nothing moved: the buffer is clean
            raise
        except BaseException:
            self.pool.discard(buf)  # an aborted READ may still land in it
            raise

    def _transfer(self, op: str, keys, regions, local_base: int, kind, deadline) -> None:
        """One NIXL ``op`` of ``regions`` (arena offset, length) packed from ``local_base``."""
        local, remote = _descriptors(regions, local_base, self._base, kind[1])
        if not len(local):
            return
        agent = self._local.agent
        try:
            handle = agent.initialize_xfer(op, agent.get_xfer_descs(local, kind[0]),
                                           agent.get_xfer_descs(remote, "DRAM"), self._remote)
        except Exception as exc:
            raise _SetupError(f"unit {self.unit}: NIXL cannot {op} keys {_describe(keys)} "
                              f"({kind[0]} destination): {exc}", self.unit, keys) from exc
        done = False
        try:
            state = agent.transfer(handle)
            while state == "PROC":
                if deadline is not None and time.monotonic() > deadline:
                    raise GputqTimeoutError(
                        f"NIXL {op} of keys {_describe(keys)} from unit {self.unit} timed out")
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferError(f"unit {self.unit}: NIXL {op} of keys {_describe(keys)} failed "
                                    f"(transfer state {state})", self.unit, keys)
            done = True
        except (GputqTimeoutError, TransferError):
            raise
        except Exception as exc:  # NIXL's binding errors (nixlBackendError, ...)
            raise TransferError(f"unit {self.unit}: NIXL {op} of keys {_describe(keys)} failed: {exc}",
                                self.unit, keys) from exc
        finally:
            try:
                handle.release()  # aborts a transfer still in flight
            except Exception:
                if done:
                    raise

    def _copy_out(self, buf: _PoolBuffer, kind, ptr: int, dest, total: int, device: int, on_device: bool) -> None:
        if not on_device:
            out = np.frombuffer(byte_view(dest, writable=True), np.uint8)
            np.copyto(out[:total], buf.obj[:total])
        elif total:
            self.pool.cuda().copy(ptr, buf.ptr, total, device, src_host=kind[0] == "DRAM")

    @contextlib.contextmanager
    def staging(self, nbytes: int, device: int | None = None):
        """Lend a registered buffer of ``nbytes`` from the pool.

        A :meth:`read` into it is one NIXL READ with no copy: read a shard
        into it, then run the widen+scatter kernel straight from it.

        Parameters
        ----------
        nbytes : int
            Size of the view handed out.
        device : int or None
            CUDA device for a device buffer (CuPy or torch array); ``None``
            for a host numpy array.
        """
        self._check_open()
        kind = ("DRAM", 0) if device is None else ("VRAM", int(device))
        buf = self.pool.acquire(max(int(nbytes), 1), kind)
        try:
            yield self.pool.buffer(buf, nbytes)
        finally:
            self.pool.release(buf)

    # -- writes and control ------------------------------------------------------------

    def write(self, key: str, payload, meta: dict | None = None, timeout: float | None = None) -> dict:
        """Store ``payload`` under ``key``: over tcp, or pushed with NIXL WRITEs (see ``write_path``)."""
        self._check_open()
        view = byte_view(payload)
        nbytes = view.nbytes
        if self._write_path == "tcp" or (self._write_path == "auto" and nbytes < PUSH_MIN_BYTES):
            return self._tcp.write(key, payload, meta, timeout=timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        offset = self._tcp.call(BEGIN_WRITE, timeout=timeout, key=key, nbytes=nbytes,
                                meta=meta or {}, wait_s=timeout)
        try:
            if offset < 0 or offset + nbytes > self._arena_nbytes:
                raise TransferError(f"unit {self.unit} reserved a region outside its arena for {key!r}",
                                    self.unit, [key])
            if nbytes:
                self._push(key, np.frombuffer(view, np.uint8), offset, deadline)
        except BaseException:
            with contextlib.suppress(Exception):
                self._tcp.call(ABORT_WRITE, timeout=_CLEANUP_TIMEOUT_S, key=key)
            raise
        return self._tcp.call(COMMIT_WRITE, timeout=_left(deadline), key=key)

    def _push(self, key: str, data: np.ndarray, offset: int, deadline: float | None) -> None:
        """Copy ``data`` through a bounded registered staging buffer into the arena at ``offset``."""
        chunk = min(data.size, PUSH_CHUNK_BYTES)
        buf = self.pool.acquire(chunk, ("DRAM", 0))
        try:
            for start in range(0, data.size, chunk):
                part = data[start:start + chunk]
                np.copyto(buf.obj[:part.size], part)
                self._transfer("WRITE", [key], np.array([[offset + start, part.size]], dtype=np.int64),
                               buf.ptr, ("DRAM", 0), deadline)
        except BaseException:
            self.pool.discard(buf)
            raise
        self.pool.release(buf)

    def call(self, method: str, timeout: float | None = None, **args) -> Any:
        self._check_open()
        return self._tcp.call(method, timeout=timeout, **args)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._ender.close()
        self.pool.close()
        self._local.remove_remote(self._remote)
        self._tcp.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"rdma channel to {self.unit} is closed")


class _SetupError(TransferError):
    """NIXL refused to create the transfer: nothing moved, another lane may work."""


class NixlTransport(TransportType):
    """The rdma backend: ``serve`` an arena over NIXL, ``connect`` a :class:`NixlChannel`.

    Parameters
    ----------
    write_path : str or None
        ``None`` (default): ``GPUTQ_RDMA_WRITE_PATH``, else ``"auto"``.
        ``"auto"``: tcp below :data:`PUSH_MIN_BYTES`, push above;
        ``"tcp"``: always the tcp write (``recv_into`` the arena);
        ``"push"``: always NIXL WRITE from a registered staging buffer.
    """

    name = "rdma"

    def __init__(self, write_path: str | None = None):
        if write_path is None:
            write_path = os.environ.get(WRITE_PATH_ENV, "").strip().lower() or "auto"
        if write_path not in WRITE_PATHS:
            raise InvalidInputError(f"write_path must be one of {WRITE_PATHS}, got {write_path!r}")
        self.write_path = write_path

    def serve(self, handler: ArenaHandler, *, host: str = "127.0.0.1", port: int = 0,
              token: str, max_frame_bytes: int) -> NixlServer:
        return NixlServer(handler, host=host, port=port, token=token, max_frame_bytes=max_frame_bytes)

    def connect(self, address: dict, *, token: str, max_frame_bytes: int,
                timeout: float | None = None) -> NixlChannel:
        return NixlChannel(address, token=token, max_frame_bytes=max_frame_bytes, timeout=timeout,
                           write_path=self.write_path)
