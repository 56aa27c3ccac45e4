"""A stand-in for CuPy whose device memory is host memory: gputq's GPU code paths on a CPU box.

Installed as the ``cupy`` module (:func:`installed`, the ``host_cuda``
fixture), it is
what every probe of :mod:`gputq.transport.cuda` finds, so the code under test
takes its real CUDA branches: the reader allocates "device" buffers and
returns tensors over them, the arena mapping is registered with
``cudaHostRegister``, copies into the device go through
``cudaMemcpyAsync``, and the kernel module is "compiled" and launched. A
launch runs the CPU build of ``widen_scatter.cu`` (the harness of
``test_kernel_on_host``), every block and thread in turn, which is what
the GPU computes. The stand-in checks what a GPU would refuse: arguments of
the wrong C type, a host range registered twice, a copy or launch reading
host memory that is not page-locked.

:attr:`HostCupy.log` lists copies and launches (with the memory type of
what they read), registrations and event calls, in order;
:meth:`HostCupy.memory_type` answers what ``cudaPointerGetAttributes``
would (:data:`HOST` page-locked, :data:`DEVICE`).
"""

from __future__ import annotations

import contextlib
import ctypes
import re
import sys
import types

import numpy as np

from gputq.kernels import cupy_backend
from gputq.kernels.cupy_backend import _KERNELS, _SOURCE, THREADS
from tests.kernels.test_kernel_on_host import _KINDS, _kernel

__all__ = ["DeviceArray", "HostCupy", "installed", "UNREGISTERED", "HOST", "DEVICE"]

#: cudaMemoryType values.
UNREGISTERED, HOST, DEVICE = 0, 1, 2
_READ_ONLY_SUPPORTED = 113  # cudaDevAttrReadOnlyHostRegisterSupported


class CUDARuntimeError(RuntimeError):
    pass


class DeviceArray:
    """A CuPy-like array whose device memory is a host numpy array (``host``)."""

    __module__ = "cupy._core.core"  # how kernels.widen_scatter tells CuPy arrays apart

    def __init__(self, host: np.ndarray):
        self.host = host
        self.dtype, self.size, self.nbytes, self.shape = host.dtype, host.size, host.nbytes, host.shape
        self.data = types.SimpleNamespace(ptr=host.ctypes.data)
        self.device = types.SimpleNamespace(id=0)
        self.flags = types.SimpleNamespace(c_contiguous=host.flags.c_contiguous)

    @property
    def __cuda_array_interface__(self) -> dict:
        strides = None if self.host.flags.c_contiguous else self.host.strides
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.data.ptr, False),
                "strides": strides, "version": 3}

    def __getitem__(self, key) -> "DeviceArray":
        return DeviceArray(self.host[key])

    def view(self, dtype) -> "DeviceArray":
        return DeviceArray(self.host.view(dtype))

    def reshape(self, *shape) -> "DeviceArray":
        return DeviceArray(self.host.reshape(*shape))

    # torch.from_dlpack takes it as the CPU tensor over the same memory
    def __dlpack__(self, **kwargs):
        return self.host.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.host.__dlpack_device__()


class _Event:
    def __init__(self, log: list):
        self._log = log

    def record(self, stream) -> None:
        self._log.append(("record", stream.ptr))

    def synchronize(self) -> None:
        self._log.append(("wait",))


class _Stream:
    def __init__(self, log: list, ptr: int):
        self._log, self.ptr = log, ptr

    def synchronize(self) -> None:
        self._log.append(("sync", self.ptr))

    def record(self) -> _Event:
        event = _Event(self._log)
        event.record(self)
        return event

    def wait_event(self, event) -> None:
        self._log.append(("stream waits", self.ptr))


class _Pinned(bytearray):
    """``cudaHostAlloc``'d memory: a buffer with a ``ptr``."""

    @property
    def ptr(self) -> int:
        return ctypes.addressof((ctypes.c_char * len(self)).from_buffer(self))


class HostCupy:
    """The part of CuPy gputq uses, over host memory; see the module's note."""

    ndarray = DeviceArray
    int64, uint8 = np.int64, np.uint8

    def __init__(self, compiled):
        self.log: list = []
        #: What the device answers; set before the code under test first asks (it asks once).
        self.read_only_register_supported = True
        #: Fail every cudaHostRegister, as a driver out of page-lockable memory does.
        self.refuse_registration = False
        #: Added to a mapped host address to make its device address (0: unified addressing).
        self.mapped_offset = 0
        self._device_ranges: list = []  # (start, stop, owner): what empty() handed out
        self._host_ranges: dict = {}  # start -> (stop, flags, owner): registered or pinned
        self._streams = 0
        current = _Stream(self.log, 7)
        runtime = types.SimpleNamespace(
            CUDARuntimeError=CUDARuntimeError, memcpyHostToDevice=1, memcpyDeviceToDevice=3, getDeviceCount=lambda: 1,
            memcpyAsync=self._copy, memcpy=lambda dst, src, nbytes, kind: self._copy(dst, src, nbytes, kind, None),
            deviceSynchronize=lambda: self.log.append(("sync", None)),
            hostRegister=self._host_register, hostUnregister=self._host_unregister,
            deviceGetAttribute=self._device_attribute,
            pointerGetAttributes=self._pointer_attributes)
        self.cuda = types.SimpleNamespace(
            runtime=runtime, Device=lambda device=0: contextlib.nullcontext(), get_current_stream=lambda: current,
            Stream=self._stream, alloc_pinned_memory=self._alloc_pinned,
            Event=lambda block=False, disable_timing=False: _Event(self.log))
        self.RawModule = lambda code, options: _HostModule(self, compiled, code, options)

    # -- memory ------------------------------------------------------------------------

    def empty(self, shape, dtype=np.float64) -> DeviceArray:
        """Device memory, 256-byte aligned like CuPy's. Fragment tables (int64) come zeroed, so a
        table never uploaded reads as empty fragments, not wild offsets; other memory holds 0xA5
        bytes, so an element nobody wrote shows."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        raw = np.full(nbytes + 256, 0 if dtype == np.int64 else 0xA5, np.uint8)
        start = (-raw.ctypes.data) % 256
        array = raw[start:start + nbytes].view(dtype).reshape(shape)
        self._device_ranges.append((array.ctypes.data, array.ctypes.data + nbytes, raw))
        return DeviceArray(array)

    def device_array(self, host: np.ndarray) -> DeviceArray:
        """``host``'s memory taken as device memory (no copy): a test's input or output buffer."""
        self._device_ranges.append((host.ctypes.data, host.ctypes.data + host.nbytes, host))
        return DeviceArray(host)

    def _alloc_pinned(self, nbytes: int) -> _Pinned:
        memory = _Pinned(nbytes)
        self._host_ranges[memory.ptr] = (memory.ptr + nbytes, 0, memory)
        return memory

    def _device_attribute(self, attribute: int, device: int) -> int:
        assert (attribute, device) == (_READ_ONLY_SUPPORTED, 0), "an attribute this stand-in does not know"
        return int(self.read_only_register_supported)

    def _host_register(self, ptr: int, nbytes: int, flags: int) -> None:
        if self.refuse_registration:
            self.log.append(("refused", ptr, nbytes, flags))
            raise CUDARuntimeError("cudaErrorMemoryAllocation: out of page-lockable memory")
        if any(start < ptr + nbytes and ptr < stop for start, (stop, _, _) in self._host_ranges.items()):
            raise CUDARuntimeError("cudaErrorHostMemoryAlreadyRegistered")
        self._host_ranges[ptr] = (ptr + nbytes, flags, None)
        self.log.append(("register", ptr, nbytes, flags))

    def _host_unregister(self, ptr: int) -> None:
        if self._host_ranges.pop(ptr, None) is None:
            raise CUDARuntimeError("cudaErrorHostMemoryNotRegistered")
        self.log.append(("unregister", ptr))

    def memory_type(self, ptr: int, nbytes: int = 1) -> int:
        """What memory ``[ptr, ptr + nbytes)`` lies in, whole: :data:`HOST`, :data:`DEVICE` or neither."""
        if any(start <= ptr and ptr + nbytes <= stop for start, stop, _ in self._device_ranges):
            return DEVICE
        if any(start <= ptr and ptr + nbytes <= stop for start, (stop, _, _) in self._host_ranges.items()):
            return HOST
        return UNREGISTERED

    def _pointer_attributes(self, ptr: int):
        kind = self.memory_type(ptr)
        device_pointer = {UNREGISTERED: 0, HOST: ptr + self.mapped_offset, DEVICE: ptr}[kind]
        return types.SimpleNamespace(device=0, type=kind, devicePointer=device_pointer)

    # -- work ---------------------------------------------------------------------------

    def _stream(self) -> _Stream:
        self._streams += 1
        return _Stream(self.log, 100 + self._streams)

    def _copy(self, dst: int, src: int, nbytes: int, kind: int, stream: int | None) -> None:
        """``cudaMemcpyAsync`` (on ``stream``) or ``cudaMemcpy`` (``stream`` None)."""
        source = self.memory_type(src, nbytes)
        assert kind in (1, 3), "gputq copies into the device only"
        assert self.memory_type(dst, nbytes) == DEVICE, "a copy into memory that is not the device's"
        assert kind == 1 or source == DEVICE, "a device-to-device copy from host memory"
        ctypes.memmove(dst, src, nbytes)
        self.log.append(("copy", dst, src, nbytes, stream, source))


class _HostModule:
    def __init__(self, cupy: HostCupy, compiled, code: str, options):
        assert code == _SOURCE.read_text()
        steps = int(re.search(r"-DWS_STEPS=(\d+)", " ".join(options)).group(1))
        assert f"-DWS_THREADS={THREADS}" in options
        self._cupy, self._launch = cupy, compiled(steps)

    def get_function(self, name: str):
        kind = _KINDS[{kernel: dtype for dtype, kernel in _KERNELS.items()}[name]]
        return lambda grid, block, args, stream=None: self._run(kind, grid, block, args, stream)

    def _run(self, kind: int, grid, block, args, stream) -> None:
        src, dst, table, nfrag, fill = args
        # The C types of widen_scatter.cu's parameters: two pointers, a table, int, int or float.
        assert block == (THREADS,) and len(grid) == 1
        assert type(src) is np.uint64 and type(dst) is np.uint64 and type(nfrag) is np.int32
        assert isinstance(table, DeviceArray) and table.dtype == np.int64
        assert type(fill) is (np.float32 if kind == _KINDS["float32"] else np.int32)
        source = self._cupy.memory_type(int(src))
        assert source != UNREGISTERED, "the kernel reads pageable host memory"
        self._cupy.log.append(("launch", table.data.ptr, stream.ptr, int(src), int(dst), source))
        self._launch(kind, int(src), int(dst), table.data.ptr, int(nfrag), int(grid[0]),
                     int(fill) if type(fill) is np.int32 else 0, float(fill) if type(fill) is np.float32 else 0.0)


def _forget_probes() -> None:
    from gputq.transport import cuda

    for probe in (cuda.usable_cupy, cuda.usable_torch, cuda.read_only_register_supported):
        probe.cache_clear()


@contextlib.contextmanager
def installed(monkeypatch, tmp_path_factory):
    """:class:`HostCupy` installed as ``cupy`` for a block; the CUDA probes forget it afterwards.

    The ``host_cuda`` fixture of ``tests/conftest.py``.
    """
    fake = HostCupy(lambda steps: _kernel(tmp_path_factory, steps))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(cupy_backend, "_modules", {})  # no stand-in module left for a real GPU test
    monkeypatch.setattr(cupy_backend, "_rings", {})
    _forget_probes()
    try:
        yield fake
    finally:
        _forget_probes()
