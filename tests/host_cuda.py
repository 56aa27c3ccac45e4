"""A stand-in for CuPy that behaves like a GPU where gputq's bugs would show: gputq's GPU path on a CPU box.

Installed as the ``cupy`` module (:func:`installed`, the ``host_cuda``
fixture), it is what every probe of :mod:`gputq.transport.cuda` finds, so
the code under test takes its real CUDA branches: the reader allocates
"device" buffers and returns tensors over them, the arena mapping is
registered with ``cudaHostRegister``, copies into the device go through
``cudaMemcpyAsync``, and the kernel module is "compiled" and launched. A
launch runs the CPU build of ``widen_scatter.cu`` (the harness of
``test_kernel_on_host``), every block and thread in turn, which is what
the GPU computes.

It keeps the promises a GPU makes and no more:

- **Streams are asynchronous.** A copy or launch is queued on its stream
  and runs only when something forces it: ``synchronize`` of the stream or
  the device, an event synchronised or waited on by a stream that is
  forced, a blocking ``cudaMemcpy``. Host memory a queued copy reads is
  read when the copy runs, so a pinned buffer refilled before its copy ran
  shows up as wrong bytes (pageable memory is read at the call, as CUDA
  stages it). Streams never order with one another implicitly, as with
  per-thread default streams (``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1``)
  or torch's streams: each thread has its own current stream per device.
  :meth:`HostCupy.synchronize` drains every stream in the order
  :attr:`HostCupy.schedule` picks.
- **Device memory is not host memory.** Device addresses lie in a space of
  their own (from :data:`DEVICE_BASE`), mapped host memory has device
  addresses :attr:`HostCupy.mapped_offset` above its host ones, and a
  kernel reads or writes only device memory of its own device or mapped
  host memory through its device address. Every launch checks each
  fragment's source and destination extents from its table, and its grid.
  Device memory is freed when its last array (or tensor) goes; a later
  copy or launch touching it fails.
- **Registrations are enforced.** Registering a range twice, unregistering
  what was never registered, writing through a read-only registration, or
  asking a device pointer of a registration that is not mapped is an
  error; what is still registered when the stand-in is removed is reported.
- **Two devices** (:attr:`HostCupy.devices`): ``cuda.Device(i)`` selects
  one, arrays and pointers say which they are on, and a tensor handed to
  torch (``torch.from_dlpack``) is a :class:`DeviceTensor` whose
  ``device`` is ``cuda:i``; its ``cpu()`` reads the memory as it is then,
  ordered with no CuPy stream.
- **Leases** a test declares (:meth:`HostCupy.lease_started`,
  :meth:`HostCupy.lease_ended`) are checked: queued work that reads host
  memory after its lease ended fails when it runs, unless leases held
  then cover those bytes again (a stream leases other spans of one key) or
  lie on both sides of them (a copy in spans bridges its segments' gaps).

What it still cannot show (a GPU run of ``bench/gpu_check.sh`` does):
timing, real concurrency inside a kernel (threads of a launch run one after
the other), and alignment faults (the CPU loads misaligned vectors).

:attr:`HostCupy.log` lists the calls, in order: copies and launches (with
the memory type of what they read; a launch with its device), registrations,
stream and event calls.
:meth:`HostCupy.memory_type` answers what ``cudaPointerGetAttributes``
would (:data:`HOST` page-locked, :data:`DEVICE`).
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import random
import re
import sys
import threading
import types
import weakref
from collections import deque

import numpy as np

from gputq.kernels import cupy_backend
from gputq.kernels.cupy_backend import _KERNELS, _SOURCE, THREADS, UNPACK_KERNEL, UNPACK_SOURCE
from gputq.kernels.plan import packed_row_bytes
from tests.kernels.test_kernel_on_host import _KINDS, _kernel
from tests.kernels.test_unpack_kernel import unpack_kernel

__all__ = ["DEVICE_BASE", "DeviceArray", "DeviceTensor", "HostCupy", "installed", "UNREGISTERED", "HOST",
           "DEVICE", "CUDARuntimeError"]

#: cudaMemoryType values.
UNREGISTERED, HOST, DEVICE = 0, 1, 2
#: Where device addresses start: far above any host address (x86-64 user space ends at 2**47),
#: below 2**63 (gputq keeps addresses in int64 arrays).
DEVICE_BASE = 1 << 52
_MAPPED_OFFSET = 1 << 50
_READ_ONLY_SUPPORTED = 113  # cudaDevAttrReadOnlyHostRegisterSupported
_PORTABLE, _MAPPED, _READ_ONLY = 0x01, 0x02, 0x08
_H2D, _D2D = 1, 3
_INPUT_BYTES = {_KINDS["uint8"]: 1, _KINDS["uint16"]: 2, _KINDS["int32"]: 4, _KINDS["float32"]: 4}


class CUDARuntimeError(RuntimeError):
    pass


class _Allocation:
    """Device memory: ``nbytes`` at device address ``start``, held in host memory at ``host``."""

    __slots__ = ("start", "nbytes", "host", "device", "freed")

    def __init__(self, start: int, nbytes: int, host: int, device: int):
        self.start, self.nbytes, self.host, self.device, self.freed = start, nbytes, host, device, False


class _Registration:
    """A page-locked host range: registered (``cudaHostRegister``) or allocated pinned."""

    __slots__ = ("start", "stop", "flags", "device", "pinned", "freed")

    def __init__(self, start: int, stop: int, flags: int, device: int, pinned: bool):
        self.start, self.stop, self.flags, self.device, self.pinned = start, stop, flags, device, pinned
        self.freed = False  # pinned memory whose last view went (a finalizer may run in any thread)


class DeviceArray:
    """A CuPy-like array in the stand-in's device memory, held by the host numpy array ``host``.

    ``host`` is what the device holds *now*: read it after synchronising
    (or use :meth:`HostCupy.to_host`, which does what ``cupy.asnumpy`` does).
    """

    __module__ = "cupy._core.core"  # how kernels.widen_scatter tells CuPy arrays apart

    def __init__(self, host: np.ndarray, allocation: _Allocation):
        self.host, self._allocation = host, allocation
        self.dtype, self.size, self.nbytes, self.shape = host.dtype, host.size, host.nbytes, host.shape
        self.data = types.SimpleNamespace(ptr=allocation.start + host.ctypes.data - allocation.host)
        self.device = types.SimpleNamespace(id=allocation.device)
        self.flags = types.SimpleNamespace(c_contiguous=host.flags.c_contiguous)

    @property
    def __cuda_array_interface__(self) -> dict:
        strides = None if self.host.flags.c_contiguous else self.host.strides
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.data.ptr, False),
                "strides": strides, "version": 3}

    def __getitem__(self, key) -> "DeviceArray":
        return DeviceArray(self.host[key], self._allocation)

    def view(self, dtype) -> "DeviceArray":
        return DeviceArray(self.host.view(dtype), self._allocation)

    def reshape(self, *shape) -> "DeviceArray":
        return DeviceArray(self.host.reshape(*shape), self._allocation)

    def __dlpack_device__(self):
        return (2, self._allocation.device)  # kDLCUDA: torch.from_dlpack must not take it for host memory


class _Event:
    def __init__(self, cupy: "HostCupy"):
        self._cupy = cupy
        self.mark: tuple | None = None  # (stream, work queued on it when recorded)

    def record(self, stream=None) -> None:
        stream = self._cupy.cuda.get_current_stream() if stream is None else stream
        with self._cupy.lock:
            self.mark = (stream, stream.queued)
        self._cupy.log.append(("record", stream.ptr))

    def synchronize(self) -> None:
        self._cupy.log.append(("wait",))
        self._cupy._reach(self.mark)


class _Stream:
    """A queue of work for one device; work runs in order when something forces it."""

    def __init__(self, cupy: "HostCupy", ptr: int, device: int):
        self._cupy, self.ptr, self.device = cupy, ptr, device
        self.work: deque = deque()
        self.queued = self.done = 0

    def synchronize(self) -> None:
        self._cupy.log.append(("sync", self.ptr))
        self._cupy._reach((self, self.queued))

    def record(self) -> _Event:
        event = _Event(self._cupy)
        event.record(self)
        return event

    def wait_event(self, event) -> None:
        mark = event.mark
        self._cupy.log.append(("stream waits", self.ptr))
        self._cupy._enqueue(self, lambda: self._cupy._reach(mark))


class _Pinned(bytearray):
    """``cudaHostAlloc``'d memory: a buffer with a ``ptr``; unpinned when its last view goes."""

    @property
    def ptr(self) -> int:
        return ctypes.addressof((ctypes.c_char * len(self)).from_buffer(self))


class _Device:
    """``cupy.cuda.Device``: a context that makes ``id`` the calling thread's current device."""

    def __init__(self, cupy: "HostCupy", device: int | None):
        self._cupy = cupy
        self.id = cupy.current_device() if device is None else int(device)
        if not 0 <= self.id < cupy.devices:
            raise CUDARuntimeError(f"cudaErrorInvalidDevice: device {self.id} of {cupy.devices}")

    def __enter__(self) -> "_Device":
        self._cupy._thread.__dict__.setdefault("devices", []).append(self.id)
        return self

    def __exit__(self, *exc) -> None:
        self._cupy._thread.devices.pop()


class HostCupy:
    """The part of CuPy gputq uses, as a GPU behaves; see the module's note."""

    ndarray = DeviceArray
    int64, uint8 = np.int64, np.uint8

    def __init__(self, compiled):
        self.log: list = []
        #: What the device answers; set before the code under test first asks (it asks once).
        self.read_only_register_supported = True
        #: Fail every cudaHostRegister, as a driver out of page-lockable memory does.
        self.refuse_registration = False
        #: Added to a mapped host address to make its device address.
        self.mapped_offset = _MAPPED_OFFSET
        #: Devices there are.
        self.devices = 2
        #: The order :meth:`synchronize` runs the streams' work in: "fifo" (the oldest stream's first),
        #: "reverse" (the newest's first), "interleaved" (one piece of work of each in turn) or
        #: "random" (a piece of work of a stream drawn with :attr:`seed`).
        self.schedule, self.seed = "random", 0
        self.lock = threading.RLock()  # the device: one piece of work runs at a time
        self._thread = threading.local()
        self._allocations: list[_Allocation] = []  # by start, ascending (addresses are never reused)
        self._starts: list[int] = []
        self._next_address = DEVICE_BASE
        self._registrations: dict[int, _Registration] = {}  # by start
        self._leases: dict[tuple[int, int], int] = {}  # host range -> leases holding it
        self._streams: list[_Stream] = []
        self._by_handle: dict[int, _Stream] = {}
        self._current: dict[tuple[int, int], _Stream] = {}  # (thread, device) -> its current stream
        runtime = types.SimpleNamespace(
            CUDARuntimeError=CUDARuntimeError, memcpyHostToDevice=_H2D, memcpyDeviceToDevice=_D2D,
            getDeviceCount=lambda: self.devices, memcpyAsync=self._copy_async, memcpy=self._copy,
            deviceSynchronize=self.synchronize, hostRegister=self._host_register,
            hostUnregister=self._host_unregister, deviceGetAttribute=self._device_attribute,
            pointerGetAttributes=self._pointer_attributes)
        self.cuda = types.SimpleNamespace(
            runtime=runtime, Device=lambda device=None: _Device(self, device),
            get_current_stream=self._current_stream,
            Stream=lambda non_blocking=False: self._new_stream(), alloc_pinned_memory=self._alloc_pinned,
            Event=lambda block=False, disable_timing=False: _Event(self))
        self.RawModule = lambda code, options: _HostModule(self, compiled, code, options)

    # -- devices and streams ------------------------------------------------------------

    def current_device(self) -> int:
        devices = getattr(self._thread, "devices", None)
        return devices[-1] if devices else 0

    def _new_stream(self) -> _Stream:
        with self.lock:
            stream = _Stream(self, 100 + len(self._streams), self.current_device())
            self._streams.append(stream)
            self._by_handle[stream.ptr] = stream
        return stream

    def _current_stream(self) -> _Stream:
        key = (threading.get_ident(), self.current_device())
        with self.lock:
            if key not in self._current:
                self._current[key] = self._new_stream()
            return self._current[key]

    def _enqueue(self, stream: _Stream, work) -> None:
        with self.lock:
            stream.work.append(work)
            stream.queued += 1

    def _reach(self, mark: tuple | None) -> None:
        """Run ``mark``'s stream until the work queued before it is done (an event never recorded: none)."""
        if mark is None:
            return
        stream, count = mark
        with self.lock:
            while stream.done < count:
                work = stream.work.popleft()
                stream.done += 1
                work()

    def synchronize(self) -> None:
        """``cudaDeviceSynchronize`` of every device: run all queued work, streams in :attr:`schedule`'s order."""
        self.log.append(("sync", None))
        rng = random.Random(self.seed)
        with self.lock:
            turn = 0
            while pending := [stream for stream in self._streams if stream.work]:
                if self.schedule == "fifo":
                    stream = pending[0]
                elif self.schedule == "reverse":
                    stream = pending[-1]
                elif self.schedule == "interleaved":
                    stream = pending[turn % len(pending)]
                    turn += 1
                else:
                    stream = rng.choice(pending)
                self._reach((stream, stream.done + 1))

    # -- memory ------------------------------------------------------------------------

    def _allocate(self, host: np.ndarray, owner) -> DeviceArray:
        """Device memory held by ``host``; freed when ``owner`` (what keeps ``host`` alive) goes."""
        with self.lock:
            allocation = _Allocation(self._next_address, host.nbytes, host.ctypes.data, self.current_device())
            self._next_address += -(-max(host.nbytes, 1) // 256) * 256 + 256  # a gap: overruns hit nothing
            self._allocations.append(allocation)
            self._starts.append(allocation.start)
        weakref.finalize(owner, setattr, allocation, "freed", True)
        return DeviceArray(host, allocation)

    def empty(self, shape, dtype=np.float64) -> DeviceArray:
        """Device memory on the current device. Fragment tables (int64) come zeroed, so a table
        never uploaded reads as empty fragments, not wild offsets; other memory holds 0xA5 bytes,
        so an element nobody wrote shows."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        raw = np.full(nbytes + 256, 0 if dtype == np.int64 else 0xA5, np.uint8)
        start = (-raw.ctypes.data) % 256
        return self._allocate(raw[start:start + nbytes].view(dtype).reshape(shape), raw)

    def device_array(self, host: np.ndarray) -> DeviceArray:
        """A test's input or output buffer: device memory on the current device holding ``host``
        (no copy; read it as ``.host`` once synchronised)."""
        return self._allocate(host, host)

    def to_host(self, array: DeviceArray) -> np.ndarray:
        """``cupy.asnumpy``: a blocking copy out of the device on the current stream (it runs first)."""
        self._current_stream().synchronize()
        with self.lock:
            self._device_range(array.data.ptr, array.nbytes, None, write=False, what="a copy to the host")
            return array.host.copy()

    def _alloc_pinned(self, nbytes: int) -> _Pinned:
        memory = _Pinned(max(nbytes, 1))
        registration = _Registration(memory.ptr, memory.ptr + nbytes, 0, self.current_device(), True)
        with self.lock:
            self._registrations[registration.start] = registration
        weakref.finalize(memory, setattr, registration, "freed", True)
        return memory

    def _allocation_at(self, ptr: int) -> _Allocation | None:
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i >= 0 and ptr < self._allocations[i].start + max(self._allocations[i].nbytes, 1):
            return self._allocations[i]
        return None

    def _registration_at(self, ptr: int, nbytes: int) -> _Registration | None:
        return next((r for r in self._registrations.values()
                     if not r.freed and r.start <= ptr and ptr + nbytes <= r.stop), None)

    def memory_type(self, ptr: int, nbytes: int = 1) -> int:
        """What ``[ptr, ptr + nbytes)`` lies in, whole: :data:`DEVICE` memory, page-locked
        :data:`HOST` memory (by its host or, mapped, its device address), or neither."""
        with self.lock:
            allocation = self._allocation_at(ptr)
            if allocation is not None and not allocation.freed and ptr + nbytes <= allocation.start + allocation.nbytes:
                return DEVICE
            mapped = self._registration_at(ptr - self.mapped_offset, nbytes)
            if mapped is not None and mapped.flags & _MAPPED:
                return HOST
            return HOST if self._registration_at(ptr, nbytes) is not None else UNREGISTERED

    def _device_range(self, ptr: int, nbytes: int, device: int | None, *, write: bool, what: str) -> int:
        """The host address holding device-accessible ``[ptr, ptr + nbytes)``, for ``what`` on ``device``
        (None: any). Raises :class:`CUDARuntimeError` as the device would fault."""
        allocation = self._allocation_at(ptr)
        if allocation is not None:
            if allocation.freed:
                raise CUDARuntimeError(f"cudaErrorIllegalAddress: {what} touches freed device memory at {ptr:#x}")
            if ptr + nbytes > allocation.start + allocation.nbytes:
                raise CUDARuntimeError(f"cudaErrorIllegalAddress: {what} runs {ptr + nbytes - allocation.start - allocation.nbytes} "
                                       f"bytes past an allocation of {allocation.nbytes}")
            if device is not None and allocation.device != device:
                raise CUDARuntimeError(f"cudaErrorIllegalAddress: {what} on device {device} touches memory of "
                                       f"device {allocation.device}")
            return allocation.host + ptr - allocation.start
        host = ptr - self.mapped_offset
        mapped = self._registration_at(host, nbytes)
        if mapped is not None and mapped.flags & _MAPPED:
            if write and mapped.flags & _READ_ONLY:
                raise CUDARuntimeError(f"cudaErrorIllegalAddress: {what} writes through a read-only registration")
            if device is not None and not mapped.flags & _PORTABLE and mapped.device != device:
                raise CUDARuntimeError(f"cudaErrorIllegalAddress: {what} on device {device} reads host memory "
                                       f"mapped for device {mapped.device} only (not portable)")
            self._check_leases(host, nbytes, what)
            return host
        if self._registration_at(ptr, nbytes) is not None:
            raise CUDARuntimeError(f"cudaErrorIllegalAddress: {what} uses the host address {ptr:#x} of page-locked "
                                   "memory: the device reaches it only through a mapped registration's device pointer")
        raise CUDARuntimeError(f"cudaErrorIllegalAddress: {what} touches {ptr:#x}, which is neither device memory "
                               "nor mapped host memory (pageable host memory?)")

    def _device_attribute(self, attribute: int, device: int) -> int:
        assert attribute == _READ_ONLY_SUPPORTED and 0 <= device < self.devices, "an attribute this stand-in does not know"
        return int(self.read_only_register_supported)

    def _host_register(self, ptr: int, nbytes: int, flags: int) -> None:
        if self.refuse_registration:
            self.log.append(("refused", ptr, nbytes, flags))
            raise CUDARuntimeError("cudaErrorMemoryAllocation: out of page-lockable memory")
        with self.lock:
            if any(not r.freed and r.start < ptr + nbytes and ptr < r.stop for r in self._registrations.values()):
                raise CUDARuntimeError("cudaErrorHostMemoryAlreadyRegistered")
            self._registrations[ptr] = _Registration(ptr, ptr + nbytes, flags, self.current_device(), False)
        self.log.append(("register", ptr, nbytes, flags))

    def _host_unregister(self, ptr: int) -> None:
        with self.lock:
            registration = self._registrations.get(ptr)
            if registration is None or registration.pinned or registration.freed:
                raise CUDARuntimeError("cudaErrorHostMemoryNotRegistered")
            del self._registrations[ptr]
        self.log.append(("unregister", ptr))

    def _pointer_attributes(self, ptr: int):
        with self.lock:
            kind, device, device_pointer = self.memory_type(ptr), 0, 0
            if kind == DEVICE:
                device, device_pointer = self._allocation_at(ptr).device, ptr
            elif kind == HOST:
                registration = self._registration_at(ptr, 1)
                if registration is not None:  # a host address
                    mapped = ptr + self.mapped_offset
                else:  # a mapped registration's device address
                    registration, mapped = self._registration_at(ptr - self.mapped_offset, 1), ptr
                device = registration.device
                if registration.flags & _MAPPED:  # only a mapped registration has a device address
                    device_pointer = mapped
        return types.SimpleNamespace(device=device, type=kind, devicePointer=device_pointer)

    # -- leases -------------------------------------------------------------------------

    def lease_started(self, ptr: int, nbytes: int) -> None:
        """Host memory ``[ptr, ptr + nbytes)`` is leased: work may read it until :meth:`lease_ended`."""
        with self.lock:
            self._leases[(ptr, ptr + nbytes)] = self._leases.get((ptr, ptr + nbytes), 0) + 1

    def lease_ended(self, ptr: int, nbytes: int) -> None:
        """The lease on ``[ptr, ptr + nbytes)`` ended: its owner may reuse it, and work reading it now fails."""
        with self.lock:
            self._leases[(ptr, ptr + nbytes)] -= 1

    def _check_leases(self, ptr: int, nbytes: int, what: str) -> None:
        """Fault where ``[ptr, ptr + nbytes)`` reads bytes of an ended lease outside the leases held now and the
        gaps between them: a later lease of other spans of the same keys may cover those bytes again, and a
        copy in spans bridges the gaps between its leased segments (bytes it reads and never uses)."""
        end = ptr + nbytes
        held = [(start, stop) for (start, stop), count in self._leases.items() if count and start < end and ptr < stop]
        first, last = (max(ptr, min(a for a, _ in held)), min(end, max(b for _, b in held))) if held else (end, end)
        for (start, stop), count in self._leases.items():
            if not count and start < end and ptr < stop and (max(start, ptr) < first or min(stop, end) > last):
                raise CUDARuntimeError(f"{what} reads host memory [{start:#x}, {stop:#x}) after its lease ended")

    # -- work ---------------------------------------------------------------------------

    def _copy_async(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        """``cudaMemcpyAsync`` on the stream whose handle is ``stream``."""
        self._queue_copy(dst, src, nbytes, kind, self._by_handle[stream])

    def _copy(self, dst: int, src: int, nbytes: int, kind: int) -> None:
        """``cudaMemcpy``: blocking, after all work queued before it."""
        self.synchronize()
        stream = self._current_stream()
        self._queue_copy(dst, src, nbytes, kind, stream)
        self._reach((stream, stream.queued))

    def _queue_copy(self, dst: int, src: int, nbytes: int, kind: int, stream: _Stream) -> None:
        assert kind in (_H2D, _D2D), "gputq copies into the device only"
        with self.lock:
            source = self.memory_type(src, nbytes)
            self.log.append(("copy", dst, src, nbytes, stream.ptr, source))
            self._device_range(dst, nbytes, None, write=True, what="a copy")  # fails at the call, as CUDA does
            if kind == _D2D:
                self._device_range(src, nbytes, None, write=False, what="a device-to-device copy")
                snapshot = None
            elif source == UNREGISTERED:
                # Pageable memory: CUDA stages it at the call, after the stream's earlier work.
                self._reach((stream, stream.queued))
                snapshot = ctypes.string_at(src, nbytes)
            else:
                snapshot = None

            def run():
                target = self._device_range(dst, nbytes, None, write=True, what="a copy")
                if snapshot is not None:
                    ctypes.memmove(target, snapshot, nbytes)
                    return
                if kind == _D2D:
                    origin = self._device_range(src, nbytes, None, write=False, what="a device-to-device copy")
                else:
                    if self._registration_at(src, nbytes) is None:
                        raise CUDARuntimeError(f"a queued copy reads page-locked memory at {src:#x} freed before it ran")
                    self._check_leases(src, nbytes, "a copy")
                    origin = src
                ctypes.memmove(target, origin, nbytes)

            self._enqueue(stream, run)

    def leaked(self) -> list[str]:
        """Registrations still held, described."""
        with self.lock:
            return [f"{r.stop - r.start} bytes at {r.start:#x} (flags {r.flags:#x})"
                    for r in self._registrations.values() if not r.pinned]

    def close(self) -> None:
        """Run what is still queued (its faults surface here) and report what is still registered."""
        self.synchronize()
        leaked = self.leaked()
        if leaked:
            raise AssertionError(f"still registered with CUDA when the stand-in was removed: {', '.join(leaked)}")


class _HostModule:
    def __init__(self, cupy: HostCupy, compiled, code: str, options):
        if code == UNPACK_SOURCE.read_text():
            assert f"-DUP_THREADS={THREADS}" in options
            self._cupy, self._unpack = cupy, _UnpackModule(cupy, compiled(None))
            return
        assert code == _SOURCE.read_text()
        self._steps = int(re.search(r"-DWS_STEPS=(\d+)", " ".join(options)).group(1))
        assert f"-DWS_THREADS={THREADS}" in options
        self._cupy, self._launch, self._unpack = cupy, compiled(self._steps), None

    def get_function(self, name: str):
        if self._unpack is not None:
            assert name == UNPACK_KERNEL
            return self._unpack.run
        kind = _KINDS[{kernel: dtype for dtype, kernel in _KERNELS.items()}[name]]
        return lambda grid, block, args, stream=None: self._run(kind, grid, block, args, stream)

    def _run(self, kind: int, grid, block, args, stream) -> None:
        cupy = self._cupy
        src, dst, table, nfrag, fill = args
        # The C types of widen_scatter.cu's parameters: two pointers, a table, int, int or float.
        assert block == (THREADS,) and len(grid) == 1
        assert type(src) is np.uint64 and type(dst) is np.uint64 and type(nfrag) is np.int32
        assert isinstance(table, DeviceArray) and table.dtype == np.int64
        assert type(fill) is (np.float32 if kind == _KINDS["float32"] else np.int32)
        stream = cupy.cuda.get_current_stream() if stream is None else stream
        device = cupy.current_device()
        if stream.device != device:
            raise CUDARuntimeError(f"cudaErrorInvalidResourceHandle: a launch on device {device} "
                                   f"into a stream of device {stream.device}")
        cupy.log.append(("launch", table.data.ptr, stream.ptr, int(src), int(dst), cupy.memory_type(int(src)), device,
                         "widen"))
        cupy._enqueue(stream, lambda: self._execute(kind, int(grid[0]), int(src), int(dst), table, int(nfrag),
                                                    fill, device))

    def _execute(self, kind: int, nblocks: int, src: int, dst: int, table: DeviceArray, nfrag: int, fill,
                 device: int) -> None:
        """The launch, run on the device: its table read now, every fragment's extents checked."""
        cupy = self._cupy
        table_host = cupy._device_range(table.data.ptr, 32 * nfrag, device, write=False, what="a launch's table")
        entries = np.frombuffer((ctypes.c_char * (32 * nfrag)).from_address(table_host), np.int64).copy()
        fragments, first = entries[:3 * nfrag].reshape(nfrag, 3), entries[3 * nfrag:]
        itemsize = _INPUT_BYTES[kind]
        chunk = self._steps * THREADS * (16 // itemsize)
        blocks = -(-fragments[:, 2] // chunk)
        if nblocks != int(blocks.sum()) or (first != np.cumsum(blocks) - blocks).any():
            raise CUDARuntimeError(f"a launch's grid ({nblocks} blocks) is not the one its table implies "
                                   f"({int(blocks.sum())})")
        src_host = dst_host = None
        for s, d, n in fragments.tolist():
            if n == 0:
                continue
            at = cupy._device_range(dst + 4 * d, 4 * n, device, write=True, what="a launch") - 4 * d
            if dst_host not in (None, at):
                raise CUDARuntimeError("a launch writes into two allocations (the stand-in runs one)")
            dst_host = at
            if s >= 0:
                at = cupy._device_range(src + itemsize * s, itemsize * n, device, write=False, what="a launch")
                at -= itemsize * s
                if src_host not in (None, at):
                    raise CUDARuntimeError("a launch reads device memory and mapped host memory at once "
                                           "(the stand-in runs one kind)")
                src_host = at
        if dst_host is None:
            return
        entries_buffer = np.ascontiguousarray(entries)
        self._launch(kind, src_host or 0, dst_host, entries_buffer.ctypes.data, nfrag, nblocks,
                     int(fill) if type(fill) is np.int32 else 0, float(fill) if type(fill) is np.float32 else 0.0)


class _UnpackModule:
    """``unpack_scatter.cu`` on the stand-in: launches checked as the widen kernel's are, run by its CPU build."""

    def __init__(self, cupy: HostCupy, launch):
        self._cupy, self._launch = cupy, launch

    def run(self, grid, block, args, stream=None) -> None:
        cupy = self._cupy
        src, dst, table, nfrag, fill, topk, bits = args
        # The C types of unpack_scatter_i32's parameters: two pointers, a table, then four ints.
        assert block == (THREADS,) and len(grid) == 1
        assert type(src) is np.uint64 and type(dst) is np.uint64 and isinstance(table, DeviceArray)
        assert all(type(v) is np.int32 for v in (nfrag, fill, topk, bits))
        stream = cupy.cuda.get_current_stream() if stream is None else stream
        device = cupy.current_device()
        cupy.log.append(("launch", table.data.ptr, stream.ptr, int(src), int(dst), cupy.memory_type(int(src)), device,
                         "unpack"))
        cupy._enqueue(stream, lambda: self._execute(int(grid[0]), int(src), int(dst), table, int(nfrag), int(fill),
                                                    int(topk), int(bits), device))

    def _execute(self, nblocks: int, src: int, dst: int, table: DeviceArray, nfrag: int, fill: int, topk: int,
                 bits: int, device: int) -> None:
        cupy = self._cupy
        table_host = cupy._device_range(table.data.ptr, 32 * nfrag, device, write=False, what="a launch's table")
        entries = np.frombuffer((ctypes.c_char * (32 * nfrag)).from_address(table_host), np.int64).copy()
        fragments, first = entries[:3 * nfrag].reshape(nfrag, 3), entries[3 * nfrag:]
        blocks = -(-fragments[:, 2] // THREADS)
        if nblocks != int(blocks.sum()) or (first != np.cumsum(blocks) - blocks).any():
            raise CUDARuntimeError(f"an unpack launch's grid ({nblocks} blocks) is not its table's ({int(blocks.sum())})")
        row_bytes, src_host, dst_host = packed_row_bytes(topk, bits), None, None
        for s, d, n in fragments.tolist():
            if n:
                dst_host = cupy._device_range(dst + 4 * topk * d, 4 * topk * n, device, write=True,
                                              what="an unpack launch") - 4 * topk * d
                if s >= 0:
                    src_host = cupy._device_range(src + row_bytes * s, row_bytes * n, device, write=False,
                                                  what="an unpack launch") - row_bytes * s
        if dst_host is not None:
            self._launch(src_host or 0, dst_host, np.ascontiguousarray(entries).ctypes.data, nfrag, nblocks, fill,
                         topk, bits)


def _from_dlpack(real):
    def from_dlpack(array):
        if not isinstance(array, DeviceArray):
            return real(array)
        import torch

        return torch.from_numpy(array.host).as_subclass(DeviceTensor)

    return from_dlpack


def _tensor_class():
    import torch

    class DeviceTensor(torch.Tensor):
        """A torch tensor over the stand-in's device memory: it says it is on ``cuda:N``."""

        @property
        def device(self):
            return torch.device("cuda", _device_of_host(self.data_ptr()))

        @property
        def is_cuda(self) -> bool:
            return True

        def cpu(self):
            """A copy in host memory of what the device holds now (ordered with no CuPy stream)."""
            with torch._C.DisableTorchFunctionSubclass():
                return self.clone()

        def numpy(self, *args, **kwargs):
            raise TypeError(f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() first.")

    return DeviceTensor


_installed: list[HostCupy] = []  # the stand-in in use, for DeviceTensor.device


def _device_of_host(address: int) -> int:
    cupy = _installed[-1]
    with cupy.lock:
        for allocation in cupy._allocations:
            if not allocation.freed and allocation.host <= address < allocation.host + max(allocation.nbytes, 1):
                return allocation.device
    raise AssertionError(f"a DeviceTensor over {address:#x}, which no live device allocation holds")


try:
    DeviceTensor = _tensor_class()
except ImportError:  # without torch, nothing hands tensors over
    DeviceTensor = None


def _forget_probes() -> None:
    from gputq.transport import cuda

    for probe in (cuda.usable_cupy, cuda.usable_torch, cuda.read_only_register_supported):
        probe.cache_clear()


@contextlib.contextmanager
def installed(monkeypatch, tmp_path_factory):
    """:class:`HostCupy` installed as ``cupy`` for a block; the CUDA probes forget it afterwards.

    The ``host_cuda`` fixture of ``tests/conftest.py``. Leaving the block
    runs the work still queued and fails on what is still registered.
    """
    fake = HostCupy(lambda steps: unpack_kernel(tmp_path_factory) if steps is None else _kernel(tmp_path_factory, steps))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(cupy_backend, "_modules", {})  # no stand-in module left for a real GPU test
    monkeypatch.setattr(cupy_backend, "_rings", {})
    if DeviceTensor is not None:
        import torch

        monkeypatch.setattr(torch, "from_dlpack", _from_dlpack(torch.from_dlpack))
    _installed.append(fake)
    _forget_probes()
    try:
        yield fake
        fake.close()
    finally:
        _installed.remove(fake)
        _forget_probes()
